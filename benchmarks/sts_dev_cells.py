"""STS-B dev at issue 18's cells, per trained run: what a run may use to choose between recipes (STS-B dev is the
only STS data a fit or a choice may see; the STS test sets only report).

For each model folder: Spearman x 100 of cosine on STS-B dev at (N, D), the shallow average (layers 1..N-1 at
full width), (1,64), (2,128) and (3,128), each cell made by the encoder itself (`encode_grid`, exit heads on where
the folder has them), and the mean of the four shallow columns, the number to rank runs by.

    python benchmarks/sts_dev_cells.py runs/protocol-r3/RUN [runs/protocol-r3/OTHER ...]
"""

from __future__ import annotations

import argparse

import numpy as np

from common import header
from matryoshka2d.cells import unit_rows
from matryoshka2d.evaluate.sts import load_pairs, spearman_x100
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.paths import sts_dev_file

SMALL_CELLS = ((1, 64), (2, 128), (3, 128))


def cell_columns(encoder: ElasticEncoder, pairs) -> dict[str, float]:
    """Spearman x 100 on `pairs` at (N, D), the shallow average, the small cells and (N-1, D), each cell made by
    the encoder itself (exit heads on where it has them)."""
    top, full = encoder.num_layers, encoder.hidden_size
    texts = list(dict.fromkeys(pairs.sentences1 + pairs.sentences2))
    row = {t: i for i, t in enumerate(texts)}
    first, second = [row[t] for t in pairs.sentences1], [row[t] for t in pairs.sentences2]
    dims = sorted({d for _, d in SMALL_CELLS} | {full})
    grid = encoder.encode_grid(texts, layers=range(1, top + 1), dims=dims)

    def score(layer: int, dim: int) -> float:
        vectors = unit_rows(grid[(layer, dim)])
        return spearman_x100(pairs.gold, (vectors[first] * vectors[second]).sum(1))

    columns = {f"({top},{full})": score(top, full), "shallow": float(np.mean([score(n, full) for n in range(1, top)]))}
    columns |= {f"({n},{d})": score(n, d) for n, d in SMALL_CELLS}
    return columns | {f"({top - 1},{full})": score(top - 1, full)}


def dev_columns(encoder: ElasticEncoder, pairs) -> list[float]:
    """(N, D), the shallow average, (1,64), (2,128), (3,128): the columns that rank runs (their shallow four)."""
    return list(cell_columns(encoder, pairs).values())[:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model folders (or names)")
    args = parser.parse_args()
    print(header())
    pairs = load_pairs(sts_dev_file())
    print("| model | (N,D) | shallow | (1,64) | (2,128) | (3,128) | mean of the shallow columns |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models:
        cols = dev_columns(ElasticEncoder(model, device="cpu"), pairs)
        print(f"| {model} | " + " | ".join(f"{c:.2f}" for c in cols) + f" | {np.mean(cols[1:]):.2f} |", flush=True)


if __name__ == "__main__":
    main()
