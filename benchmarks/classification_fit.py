"""Classifier fitting time per cell, before and after warm-starting across folds, on the same features.

Encodes one classification set of the shared data once (one cell of a model), then runs the dataset's
C search three ways, side by side in one run: as before (every fold's path starts from zero, every C), with
warm starts across folds (every C), and as evaluate/classification.py does now (warm starts, and the search
stops once two larger C values in a row score below the best). Prints seconds, the chosen C and accuracy.

    OMP_NUM_THREADS=1 python benchmarks/classification_fit.py --dataset trec --layer 6 --dim 384
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.model_selection import StratifiedKFold

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_DATA, header
from matryoshka2d.evaluate import classification as cl
from matryoshka2d.models.encoder import ElasticEncoder


def cold_kfold(x, y, regs, k):
    """The search as it was: every fold's path and the refit start from zero."""
    folds = StratifiedKFold(n_splits=k, shuffle=True, random_state=cl.SEED)
    per_fold = [[p.score(x[te], y[te]) for p in cl.fit_path(x[tr], y[tr], regs)] for tr, te in folds.split(x, y)]
    scores = [round(100 * float(np.mean(col)), 2) for col in zip(*per_fold, strict=True)]
    best = int(np.argmax(scores))
    return cl.fit_path(x, y, [sorted(regs)[best]])[0], scores[best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--dataset", default="trec", help="a <name>_train/_test set (trec, mrpc)")
    parser.add_argument("--layer", type=int, default=6)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--folds", type=int, default=10)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    print(header())
    files = cl.discover(args.data_dir / "classification", [args.dataset])[args.dataset]
    if "train" not in files or "dev" in files:
        raise SystemExit(f"{args.dataset}: this benchmark times the train/test k-fold protocol (trec, mrpc)")
    ds = cl.load_dataset(args.dataset, files)
    encoder = ElasticEncoder(args.model, device="cpu")
    classes = sorted({label for s in ds.splits.values() for label in s.labels})
    x, y = {}, {}
    t0 = time.perf_counter()
    for split, s in ds.splits.items():
        texts = s.texts + (s.texts2 or [])
        v = encoder.encode(texts, layer=args.layer, dim=args.dim)
        n = len(s.texts)
        x[split] = cl.features(v, np.arange(n), None if s.texts2 is None else np.arange(n, 2 * n))
        y[split] = np.searchsorted(classes, s.labels)
    print(
        f"{args.dataset}: {len(y['train'])} train / {len(y['test'])} test rows encoded at "
        f"({args.layer},{args.dim}) in {time.perf_counter() - t0:.1f} s; {args.folds}-fold C search over "
        f"{len(cl.KFOLD_REGS)} values"
    )
    rows = {}
    searches = (
        ("before: cold folds, all C", cold_kfold),
        ("warm folds, all C", lambda *a: cl.choose_by_kfold(*a, patience=0)),
        ("now: warm folds, patience 2", cl.choose_by_kfold),
    )
    for name, search in searches:
        t = time.perf_counter()
        probe, dev = search(x["train"], y["train"], cl.KFOLD_REGS, args.folds)
        seconds = time.perf_counter() - t
        rows[name] = seconds
        acc = 100 * probe.score(x["test"], y["test"])
        print(f"{name:>28}: {seconds:7.1f} s  C={probe.reg:g}  cv accuracy {dev:.2f}  test accuracy {acc:.2f}")
    before, warm, now = rows.values()
    print(f"speed-up of the C search: warm starts alone {before / warm:.2f}x, with patience {before / now:.2f}x")


if __name__ == "__main__":
    main()
