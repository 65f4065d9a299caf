"""An exported cell against the full model: encoding speed side by side, size on disk, STS-B score.

    python benchmarks/export_speed.py [--model minilm-l6] [--cell 3,128] [--sentences 2000] [--repeats 3]

Exports the cell with `--format onnx --quantize int8` into a temporary folder, then encodes the same distinct
sentences (length-sorted batches of 64, the same thread count for torch and onnxruntime) with: the full model in
torch fp32, the cell in torch fp32 (ElasticEncoder, layer exit), the cell's ONNX fp32 graph and its ONNX int8
graph. Forms are visited in alternating order over `repeats` rounds and the best time of each is kept, so that
a slow spell of the shared machine does not favour one of them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from common import DEFAULT_DATA, header, sts_sentences
from matryoshka2d.evaluate.sts import load_pairs, spearman_x100
from matryoshka2d.export.cell import export_cell
from matryoshka2d.export.onnx_graphs import ONNX_FILE, ONNX_INT8_FILE, OnnxCellEncoder
from matryoshka2d.models.encoder import ElasticEncoder


def layer_bytes(weights: Path) -> tuple[int, int]:
    """(bytes in transformer layers, bytes in total) of a safetensors file."""
    layers = total = 0
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
            t = f.get_slice(key)
            size = int(np.prod(t.get_shape())) * 4
            total += size
            if ".layer." in f".{key}" or "layers." in key:
                layers += size
    return layers, total


def sts_score(encode, data_dir: Path) -> float:
    pairs = load_pairs(data_dir / "sts" / "raw" / "stsb_test.tsv", "stsb")
    texts = sorted(set(pairs.sentences1) | set(pairs.sentences2))
    row = {t: i for i, t in enumerate(texts)}
    v = encode(texts)
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    a, b = v[[row[s] for s in pairs.sentences1]], v[[row[s] for s in pairs.sentences2]]
    return spearman_x100(pairs.gold, np.einsum("ij,ij->i", a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--cell", default="3,128")
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    layer, dim = (int(x) for x in args.cell.split(","))
    threads = torch.get_num_threads()
    print(header())
    texts = sts_sentences(args.data_dir, args.sentences)
    print(f"data: {len(texts)} distinct STS sentences; batch 64; torch and onnxruntime with {threads} threads")
    encoder = ElasticEncoder(args.model, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "cell"
        report = export_cell(encoder, layer, dim, folder, fmt="onnx", quantize="int8")
        print("\n".join(report.lines()))
        onnx32 = OnnxCellEncoder(folder, ONNX_FILE, threads=threads)
        onnx8 = OnnxCellEncoder(folder, ONNX_INT8_FILE, threads=threads)
        n = encoder.num_layers
        forms = {
            f"torch fp32, full model ({n},{encoder.hidden_size})": lambda t: encoder.encode(t, normalize=True),
            f"torch fp32, cell ({layer},{dim})": lambda t: encoder.encode(t, layer=layer, dim=dim, normalize=True),
            f"ONNX fp32, cell ({layer},{dim})": onnx32.encode,
            f"ONNX int8, cell ({layer},{dim})": onnx8.encode,
        }
        for encode in forms.values():
            encode(texts[:128])  # warm-up
        best = dict.fromkeys(forms, float("inf"))
        for r in range(args.repeats):
            for name in list(forms) if r % 2 == 0 else list(forms)[::-1]:
                start = time.perf_counter()
                forms[name](texts)
                best[name] = min(best[name], time.perf_counter() - start)
        scores = {name: sts_score(encode, args.data_dir) for name, encode in forms.items()}
        full_layers, full_total = layer_bytes(Path(encoder.location) / "model.safetensors")
        cell_layers, cell_total = layer_bytes(folder / "model.safetensors")
        sizes = {
            "full model.safetensors": (Path(encoder.location) / "model.safetensors").stat().st_size,
            "cell model.safetensors": (folder / "model.safetensors").stat().st_size,
            "cell ONNX fp32": (folder / ONNX_FILE).stat().st_size,
            "cell ONNX int8": (folder / ONNX_INT8_FILE).stat().st_size,
        }
    full_time = best[next(iter(forms))]
    print(f"\n| form | seconds (best of {args.repeats}) | sentences/s | speed-up vs full torch fp32 | STS-B test |")
    print("|---|---:|---:|---:|---:|")
    for name in forms:
        print(
            f"| {name} | {best[name]:.2f} | {len(texts) / best[name]:.0f} | {full_time / best[name]:.2f}x "
            f"| {scores[name]:.2f} |"
        )
    mb = 1024 * 1024
    print("\n| file | MiB | vs full model.safetensors |")
    print("|---|---:|---:|")
    for name, size in sizes.items():
        print(f"| {name} | {size / mb:.1f} | {size / sizes['full model.safetensors']:.0%} |")
    print(
        f"\ntransformer-layer weights: full {full_layers / mb:.1f} MiB, cell {cell_layers / mb:.1f} MiB "
        f"({cell_layers / full_layers:.0%}); other weights {(cell_total - cell_layers) / mb:.1f} "
        f"MiB in both (full total {full_total / mb:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
