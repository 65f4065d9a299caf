"""What the whole layer x dim STS grid costs next to one plain full-depth encoding of the same sentences.

    python benchmarks/eval_grid_cost.py [--model minilm-l6] [--repeats 2] [--variant raw]

Plain: each STS set's distinct sentences encoded once at the last layer and full width (what any evaluation
must at least do). Grid: `evaluate_sts` over every layer and the default dims, scoring every cell. Both run in
the same process, alternating which goes first, and the best of `repeats` is kept; the target is a ratio of
at most 1.25.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from common import DEFAULT_DATA, header
from matryoshka2d.evaluate.grid import EncoderCells
from matryoshka2d.evaluate.sts import STS_SETS, evaluate_sts, load_pairs, sts_file
from matryoshka2d.models.encoder import ElasticEncoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--variant", default="raw")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    print(header())
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    sets = [load_pairs(sts_file(args.data_dir, args.variant, name), name) for name in STS_SETS]
    distinct = [list(dict.fromkeys(p.sentences1 + p.sentences2)) for p in sets]
    enc = ElasticEncoder(args.model, device="cpu")
    embedder = EncoderCells(enc, batch_size=args.batch_size)
    print(
        f"data: {', '.join(STS_SETS)} ({args.variant}) in {args.data_dir}: {sum(len(p.gold) for p in sets)} pairs, "
        f"{sum(map(len, distinct))} distinct sentences (per set, summed)"
    )
    print(
        f"model {enc.name}: {enc.num_layers} layers x {enc.hidden_size}; grid {len(embedder.cells())} cells "
        f"(layers {embedder.layers} x dims {embedder.dims})"
    )
    enc.encode(distinct[0][:256], batch_size=args.batch_size)  # warm-up

    def plain() -> float:
        start = time.perf_counter()
        for texts in distinct:
            enc.encode(texts, batch_size=args.batch_size)
        return time.perf_counter() - start

    def grid() -> float:
        start = time.perf_counter()
        evaluate_sts(embedder, args.data_dir, variant=args.variant, log=lambda m: None)
        return time.perf_counter() - start

    best = {"plain": float("inf"), "grid": float("inf")}
    for r in range(args.repeats):
        order = [("plain", plain), ("grid", grid)] if r % 2 == 0 else [("grid", grid), ("plain", plain)]
        for name, run in order:
            seconds = run()
            best[name] = min(best[name], seconds)
            print(f"round {r + 1}: {name:<5} {seconds:7.1f} s")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n| run | best seconds |\n|---|---:|")
    print(f"| plain full-depth encoding (layer {enc.num_layers}, dim {enc.hidden_size}) | {best['plain']:.1f} |")
    print(f"| full grid evaluation ({len(embedder.cells())} cells, scored) | {best['grid']:.1f} |")
    print(f"\nratio grid / plain: {best['grid'] / best['plain']:.3f} (target <= 1.25)")


if __name__ == "__main__":
    main()
