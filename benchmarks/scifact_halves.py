"""Split SciFact's 809 train queries once at random into half A (to train on, when a recipe trains on queries) and
half B (to report), as a BEIR folder that `eval retrieval --dataset-dir OUT --split half_b` reads.

    python benchmarks/scifact_halves.py [--data DATA_DIR] [--seed 18] --output OUT

OUT holds symlinks to the corpus and queries, qrels/half_a.tsv and qrels/half_b.tsv (the qrels rows of each half's
queries) and split.json (the query ids of each half). Nothing is copied from the data folder but the qrels rows.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np

from common import DEFAULT_DATA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    source = args.data / "retrieval" / "scifact"
    with (source / "qrels" / "train.tsv").open(encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, rows = rows[0], rows[1:]
    queries = sorted({r[0] for r in rows}, key=lambda q: (len(q), q))
    order = np.random.default_rng(args.seed).permutation(len(queries))
    half_a = {queries[i] for i in order[: len(queries) // 2]}
    out = args.output
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    for name in ("corpus.jsonl.gz", "queries.jsonl"):
        link = out / name
        if not link.exists():
            link.symlink_to((source / name).resolve())
    for half, keep in (("half_a", lambda q: q in half_a), ("half_b", lambda q: q not in half_a)):
        with (out / "qrels" / f"{half}.tsv").open("w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(r for r in rows if keep(r[0]))
    split = {"seed": args.seed, "half_a": sorted(half_a), "half_b": sorted(set(queries) - half_a)}
    (out / "split.json").write_text(json.dumps(split, indent=1) + "\n", encoding="utf-8")
    print(f"{len(queries)} queries: half A {len(split['half_a'])}, half B {len(split['half_b'])} -> {out}")


if __name__ == "__main__":
    main()
