"""Sentences per second at every layer exit, against the ideal speed-up N/n.

    python benchmarks/layer_speed.py --models minilm-l6 mpnet-base [--sentences 2000] [--repeats 2]
        [--layers 8 15 30] [--device cpu|cuda]

Each exit encodes the same distinct sentences (length-sorted batches of 64); the best of `repeats` runs is
kept, and layers are visited deepest-first then shallowest-first in alternate rounds so that a slow spell of
the machine does not favour one end of the stack.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import DEFAULT_DATA, header, sts_sentences
from matryoshka2d.models.encoder import ElasticEncoder


def measure(model: str, texts: list[str], repeats: int, batch_size: int, layers=None, device="cpu") -> None:
    enc = ElasticEncoder(model, device=device)
    n_layers = enc.num_layers
    exits = sorted({enc.check_layer(n) for n in (layers or range(1, n_layers + 1))} | {n_layers})
    enc.encode(texts[:256], batch_size=batch_size)  # warm-up: allocator, kernels
    best = dict.fromkeys(exits, float("inf"))
    for r in range(repeats):
        order = exits[::-1] if r % 2 == 0 else exits
        for layer in order:
            start = time.perf_counter()
            enc.encode(texts, layer=layer, batch_size=batch_size)
            best[layer] = min(best[layer], time.perf_counter() - start)
    full = best[n_layers]
    print(f"\nmodel {model}: {n_layers} layers x {enc.hidden_size}, {len(texts)} sentences, batch {batch_size}")
    print("| layer | seconds | sentences/s | speed-up vs full | ideal N/n | share of ideal |")
    print("|---:|---:|---:|---:|---:|---:|")
    for layer in exits:
        speedup, ideal = full / best[layer], n_layers / layer
        print(
            f"| {layer} | {best[layer]:.2f} | {len(texts) / best[layer]:.0f} | {speedup:.2f}x | {ideal:.2f}x "
            f"| {speedup / ideal:.0%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm-l6", "mpnet-base"])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--layers", type=int, nargs="+", help="exits to time (default: every layer; the last always)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(header())
    texts = sts_sentences(args.data_dir, args.sentences)
    print(f"data: first {len(texts)} distinct sentences of STS-B test, dev and SICK-R test (raw) in {args.data_dir}")
    for model in args.models:
        measure(model, texts, args.repeats, args.batch_size, args.layers, args.device)


if __name__ == "__main__":
    main()
