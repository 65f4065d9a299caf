"""Training time per step of every method, and our 2DMSE against sentence-transformers' Matryoshka2dLoss.

    python benchmarks/train_speed.py [--steps 30] [--warmup 3] [--rounds 2] [--batch-size 32]
        [--device cpu|cuda] [--precision bf16|fp16|fp32]

All runs use minilm-l6, the shared NLI triplets, batch 32, the same batches, AdamW and clipping. Each run
takes `warmup` untimed steps and then `steps` timed ones; the runs are repeated for `rounds` rounds in
alternating order, and the best round of each is kept, so that a slow spell of the machine hits all alike.
The peer is Matryoshka2dLoss(MultipleNegativesRankingLoss) with its defaults; our matching run is `2dmse` with
the `infonce` loss (the same in-batch objective as MultipleNegativesRankingLoss, scale 20), in one process and
in two (`train --processes 2`: the cores split between the processes, each encoding half of every batch; the
loss still sees the whole batch). Both run on
`--device`; ours in the trainer's default precision for that device unless `--precision` says otherwise (the
peer in fp32, or under the same autocast with `--peer-autocast`). On CUDA each timed span ends with a device
synchronize, so queued kernels are counted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import DEFAULT_DATA, header, to_device
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.trainer import Trainer

RUNS = [
    ("plain", "plain", "angle", {}),
    ("mrl", "mrl", "angle", {}),
    ("2dmse", "2dmse", "angle", {}),
    ("ese", "ese", "angle", {}),
    ("starbucks", "starbucks", "angle", {}),
    ("separate (2,128)", "separate", "angle", {"layer": 2, "dim": 128}),
    ("2dmse + infonce", "2dmse", "infonce", {}),
    # The same step with each column padded to its own longest text, as before padding-free steps (and as
    # sentence-transformers does): the difference is the padding alone (matryoshka2d.training.packing).
    ("2dmse + infonce (padded columns)", "2dmse", "infonce", {}, {"padding_free": False}),
]
# Ours data-parallel (matryoshka2d.training.parallel): N processes on this machine, the threads shared out among them.
PROCESS_RUNS = {"2dmse + infonce in 2 processes": ("2dmse", "infonce", {}, 2)}


# What a span is measured with: wall time by default; `--clock cpu` takes this process's CPU time instead, which
# on a machine busy with other work moves far less than the wall time (with --threads 1: one thread's work).
CLOCK = time.perf_counter


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ours(
    method, loss, options, data, batch_size, warmup, steps, device="cpu", precision=None, extra=None
) -> float:
    cfg = TrainConfig(
        data=[str(data)],
        output=str(Path(tempfile.gettempdir()) / "m2d-train-speed"),  # never written: train_step saves nothing
        method=method,
        loss=loss,
        batch_size=batch_size,
        steps=warmup + steps,
        method_options=options,
        save_steps=0,
        device=device,
        precision=precision,
        **(extra or {}),
    )
    trainer = Trainer(cfg)
    trainer._lazy_records = True  # as in Trainer.run between logging steps: no host sync per step
    for _ in range(warmup):
        trainer.train_step()
    sync(device)
    trainer.processes.barrier()
    start = CLOCK()
    for _ in range(steps):
        trainer.train_step()
    sync(device)
    trainer.processes.barrier()
    return (CLOCK() - start) / steps


def _process_worker(rank, world, port, args, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    seconds = time_ours(*args)
    if rank == 0:
        results.put(seconds)


def time_ours_processes(processes, *args) -> float:
    """time_ours in `processes` processes (rank 0's time, between barriers): what `train --processes` runs."""
    import multiprocessing

    from matryoshka2d.training.parallel import _free_port

    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), _free_port()
    workers = [
        context.Process(target=_process_worker, args=(rank, processes, port, args, results))
        for rank in range(processes)
    ]
    for worker in workers:
        worker.start()
    seconds = results.get()
    for worker in workers:
        worker.join()
    return seconds


def time_peer(data, batch_size, warmup, steps, device="cpu", precision="fp32") -> float:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import Matryoshka2dLoss, MultipleNegativesRankingLoss

    from matryoshka2d.cells import nested_dims
    from matryoshka2d.models.backbones import minilm_dir
    from matryoshka2d.training.data import read_training_data

    rows = read_training_data([str(data)])
    from matryoshka2d.training.throughput import autocast

    model = SentenceTransformer(str(minilm_dir()), device=device)
    dims = sorted(nested_dims(model.get_embedding_dimension()), reverse=True)
    loss_fn = Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    order = np.random.default_rng([42, 0]).permutation(len(rows))
    model.train()

    def step(i: int) -> None:
        columns, _ = rows.rows(order[i * batch_size : (i + 1) * batch_size])
        features = [to_device(model.tokenize(c), device) for c in columns]
        with autocast(precision, torch.device(device)):
            loss = loss_fn(features, labels=None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(warmup):
        step(i)
    sync(device)
    start = CLOCK()
    for i in range(warmup, warmup + steps):
        step(i)
    sync(device)
    return (CLOCK() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--only",
        help="comma-separated run names to time (default: all), by name or first words, e.g. '2dmse + infonce,st'",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda; ours and the peer both run there")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], help="ours (default: the trainer's)")
    parser.add_argument("--peer-autocast", action="store_true", help="run the peer under the same autocast as ours")
    parser.add_argument("--threads", type=int, help="torch threads in this process (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time spans by wall clock or by this process's CPU time (use with --threads 1 on a busy machine; "
        "runs in several processes are timed in their first process)",
    )
    args = parser.parse_args()
    global CLOCK
    if args.clock == "cpu":
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    print(header())
    from matryoshka2d.training.throughput import resolve_precision

    ours_precision = resolve_precision(args.precision, torch.device(args.device))
    peer_precision = ours_precision if args.peer_autocast else "fp32"
    if peer_precision == "fp16":
        raise SystemExit("--peer-autocast with fp16 would need a GradScaler in the peer loop; use bf16")
    print(
        f"device: {args.device}; ours in {ours_precision}, the peer in {peer_precision}; {torch.get_num_threads()} "
        f"torch thread(s); timed by {'CPU time of this process' if args.clock == 'cpu' else 'wall clock'}"
    )
    data = args.data_dir / "nli" / "train_triplets.tsv"
    print(f"data: {data}, batch {args.batch_size} triplets, {args.warmup} warm-up + {args.steps} timed steps")
    names = [r[0] for r in RUNS] + list(PROCESS_RUNS) + ["st Matryoshka2dLoss(MNRL)"]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        # a full run name selects that run; other words select the runs whose names start with them
        names = [n for n in names if any(n == w or (w not in names and n.startswith(w + " ")) for w in wanted)]
    best = dict.fromkeys(names, float("inf"))
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if name.startswith("st "):
                seconds = time_peer(data, args.batch_size, args.warmup, args.steps, args.device, peer_precision)
            elif name in PROCESS_RUNS:
                method, loss, options, processes = PROCESS_RUNS[name]
                run = (method, loss, options, data, args.batch_size, args.warmup, args.steps, args.device)
                seconds = time_ours_processes(processes, *run, ours_precision)
            else:
                _, method, loss, options, *extra = next(run for run in RUNS if run[0] == name)
                seconds = time_ours(
                    method,
                    loss,
                    options,
                    data,
                    args.batch_size,
                    args.warmup,
                    args.steps,
                    args.device,
                    ours_precision,
                    extra[0] if extra else None,
                )
            best[name] = min(best[name], seconds)
            print(f"  round {r + 1}: {name}: {seconds:.3f} s/step", flush=True)
    base = best.get("plain", best[names[0]])
    print(f"\n| run | s/step | samples/s | vs {'plain' if 'plain' in best else names[0]} |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {best[name]:.3f} | {args.batch_size / best[name]:.1f} | {best[name] / base:.2f}x |")
    if "st Matryoshka2dLoss(MNRL)" not in best:
        return
    print()
    peer = best["st Matryoshka2dLoss(MNRL)"]
    for name in ("2dmse + infonce", "2dmse + infonce (padded columns)", *PROCESS_RUNS):
        if name in best:
            print(
                f"our {name} trains {peer / best[name]:.2f}x the samples/second of sentence-transformers' "
                f"Matryoshka2dLoss(MNRL) ({args.batch_size / best[name]:.1f} vs {args.batch_size / peer:.1f})"
            )


if __name__ == "__main__":
    main()
