"""The per-call costs behind length groups (matryoshka2d.models.batching): what a forward pass costs apart from
its tokens, for a training step, a torch inference pass and an onnxruntime pass.

    OMP_NUM_THREADS=1 python benchmarks/call_overhead.py [--parts train torch onnx] [--steps 8]

All timings are CPU time of this process with one thread (the machine may be shared: CPU time moves far less
than wall time), minilm-l6.

- train: the forward and backward pass of a 2dmse + infonce step (batch 32 of the shared NLI triplets) with the
  step's texts grouped for each overhead value in `--overheads` (token positions per call), next to per-column
  padding; the steps are the trainer's own (Trainer.prepare_batch and compute_loss), in alternating order over
  two rounds, the best round kept. The value with the cheapest step is what TRAINING_CALL_OVERHEAD_TOKENS["cpu"] in
  training/packing.py holds.
- torch: one inference pass of n texts of t tokens at layers 3 and 6, for small shapes; the intercept of the
  line through them, in token positions, is TORCH_CALL_OVERHEAD_TOKENS in models/batching.py.
- onnx: the same through the cached exit graphs of the onnx serving backend (fp32 and int8, layers 3 and 6),
  for serve/backends.py (built first if the cache does not hold them).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import DEFAULT_DATA, header

SMALL_SHAPES = [(1, 10), (2, 10), (4, 10), (8, 10), (8, 20)]  # (texts, tokens): where the fixed cost shows


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(ms per call, ms per token position) of the least-squares line through (positions, ms)."""
    x = np.array([p for p, _ in points], dtype=float)
    y = np.array([ms for _, ms in points])
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def report(name: str, points: list[tuple[int, float]]) -> None:
    intercept, slope = fit(points)
    shapes = ", ".join(f"{p} positions {ms:.2f} ms" for p, ms in points)
    print(f"| {name} | {intercept:.2f} | {slope:.3f} | {intercept / slope:.0f} | {shapes} |")


def cpu_ms(function, repeats: int = 15) -> float:
    function()  # warm-up
    start = time.process_time()
    for _ in range(repeats):
        function()
    return (time.process_time() - start) / repeats * 1000


def part_train(args) -> None:
    from matryoshka2d.training.config import TrainConfig
    from matryoshka2d.training.trainer import Trainer

    config = TrainConfig(
        data=[str(args.data_dir / "nli" / "train_triplets.tsv")],
        output=str(Path(tempfile.gettempdir()) / "m2d-call-overhead"),  # never written: train_step saves nothing
        method="2dmse",
        loss="infonce",
        batch_size=32,
        steps=1000,
        save_steps=0,
        device="cpu",
    )
    trainer = Trainer(config)
    trainer.encoder.train()
    values = [None, *args.overheads]
    best = dict.fromkeys(values, float("inf"))
    groups = {}
    for round_ in range(2):
        for value in values if round_ == 0 else values[::-1]:
            trainer._overhead = value
            total = 0.0
            for step in range(1, args.steps + 1):
                micro = trainer.prepare_batch(step)
                start = time.process_time()
                loss, _ = trainer.compute_loss(step, micro[0])
                loss.backward()
                total += time.process_time() - start
                trainer.optimizer.zero_grad(set_to_none=True)
                groups[value] = len(micro[0][0].groups)
            best[value] = min(best[value], total / args.steps)
    print(f"\ntraining step, forward + backward, CPU s (best of 2 rounds of {args.steps} steps, batch 32 triplets):")
    print("| grouping | s per step | vs per-column padding | forward passes in the last step |")
    print("|---|---:|---:|---:|")
    for value in values:
        name = "per-column padding" if value is None else f"length groups, overhead {value:g}"
        print(f"| {name} | {best[value]:.3f} | {best[None] / best[value]:.2f}x | {groups[value]} |")


def part_torch(args) -> None:
    from matryoshka2d.models.encoder import ElasticEncoder

    encoder = ElasticEncoder(args.model, device="cpu")
    print("\ntorch inference pass, CPU ms (fp32, 1 thread):")
    print("| pass | ms per call | ms per position | call cost in positions | measured |")
    print("|---|---:|---:|---:|---|")
    for layer in (3, 6):
        points = []
        for n, t in SMALL_SHAPES:
            features = {
                "input_ids": torch.randint(1000, 2000, (n, t)),
                "attention_mask": torch.ones(n, t, dtype=torch.long),
                "token_type_ids": torch.zeros(n, t, dtype=torch.long),
            }
            features = {k: v for k, v in features.items() if k in encoder._input_names}
            with torch.inference_mode():
                points.append((n * t, cpu_ms(lambda f=features, n=layer: encoder.forward(f, [n]))))
        report(f"torch, layer {layer}", points)


def part_onnx(args) -> None:
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.serve.backends import OnnxBackend, _session

    encoder = ElasticEncoder(args.model, device="cpu")
    print("\nonnxruntime pass, CPU ms (1 thread):")
    print("| pass | ms per call | ms per position | call cost in positions | measured |")
    print("|---|---:|---:|---:|---|")
    for quantize in (None, "int8"):
        backend = OnnxBackend(encoder, quantize, layers=[3, 6])
        for layer in (3, 6):
            session = _session(backend.paths[layer], 1)
            names = [i.name for i in session.get_inputs()]
            points = []
            for n, t in SMALL_SHAPES:
                features = {
                    "input_ids": np.random.default_rng(0).integers(1000, 2000, (n, t)),
                    "attention_mask": np.ones((n, t), dtype=np.int64),
                    "token_type_ids": np.zeros((n, t), dtype=np.int64),
                }
                feed = {k: features[k].astype(np.int64) for k in names}
                points.append((n * t, cpu_ms(lambda s=session, f=feed: s.run(None, f))))
            report(f"onnx {quantize or 'fp32'}, layer {layer}", points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--parts", nargs="+", default=["train", "torch", "onnx"], choices=["train", "torch", "onnx"])
    parser.add_argument("--overheads", type=float, nargs="+", default=[0, 20, 40, 86, 150, 300])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(header())
    for part in args.parts:
        {"train": part_train, "torch": part_torch, "onnx": part_onnx}[part](args)


if __name__ == "__main__":
    main()
