"""Classification on frozen embeddings, SentEval style: logistic regression per (layer, dim) cell.

Which protocol a dataset gets depends on the files it has, as in SentEval's tools/validation.py:

- `<name>_train/_dev/_test.tsv`: the L2 strength C is chosen on dev from 2^-2..2^3 (SplitClassifier; SST-2).
- `<name>_train/_test.tsv`: C is chosen from 2^-1..2^5 by k-fold cross-validation on train (KFoldClassifier;
  TREC, MRPC).
- `<name>_all.tsv`: k-fold cross-validation, with C chosen from 2^-2..2^3 by an inner k-fold on each outer
  training part (InnerKFoldClassifier; MR, CR, SUBJ, MPQA).

Rows with `sentence1, sentence2` are pairs and use SentEval's MRPC features np.c_[|u - v|, u * v]. Accuracy
is reported x 100, and F1 x 100 (of the positive label, "1") for two-class pair sets, as SentEval does for
MRPC. Three differences from SentEval, all for speed on a CPU: the solver is lbfgs (SentEval relied on
the old liblinear default, which also penalises the intercept); the features are centred on the training
mean, which leaves lbfgs's optimum unchanged (its intercept is not penalised and absorbs the shift) but cuts
its iterations 2-4x on anisotropic embeddings; and the values of C are fitted in increasing order, each fit
warm-started from the previous one, and each cross-validation fold starts from the previous fold's solution
(the folds share most rows). The objective is convex, so the last two change the path to the optimum, not
the optimum. One deviation can change a number: the C search walks C upwards and stops once two larger
values in a row score below the best (`--c-patience`, 0 tries every C as SentEval does); accuracy against C
has one peak in practice, and the skipped large C values are the slowest fits.
"""

from __future__ import annotations

import copy
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.model_selection import StratifiedKFold

from matryoshka2d.evaluate.grid import CellEmbedder, embed_distinct
from matryoshka2d.evaluate.results import GridResult, grid_result, model_record, provenance
from matryoshka2d.files import DataFormatError, read_tsv

SPLIT_REGS = [2.0**t for t in range(-2, 4)]  # SentEval SplitClassifier / InnerKFoldClassifier
KFOLD_REGS = [2.0**t for t in range(-1, 6)]  # SentEval KFoldClassifier
SEED = 1111  # SentEval's seed, for fold shuffling and the classifier
FILE_NAME = re.compile(r"^(?P<name>.+)_(?P<split>train|dev|test|all)\.tsv$")


def default_cells(num_layers: int, hidden_size: int) -> tuple[list[int], list[int]]:
    """Quarter-depth steps x three widths (minilm-l6: layers 2, 3, 4, 6 x dims 32, 128, 384).

    Fewer cells than the STS grid because every cell trains up to 71 classifiers per dataset; pass
    --layers/--dims for the full grid.
    """
    layers = sorted({max(1, round(num_layers * q / 4)) for q in range(1, 5)})
    dims = sorted({d for d in (32, 128) if d < hidden_size} | {hidden_size})
    return layers, dims


@dataclass
class Split:
    """One file of a dataset: its texts (a second list for pairs) and labels as strings."""

    path: Path
    texts: list[str]
    labels: list[str]
    texts2: list[str] | None = None


@dataclass
class Dataset:
    name: str
    splits: dict[str, Split] = field(default_factory=dict)

    @property
    def pair(self) -> bool:
        return next(iter(self.splits.values())).texts2 is not None

    def protocol(self, k: int) -> str:
        if "all" in self.splits:
            return f"{k}-fold cross-validation, C chosen by an inner {k}-fold on each training part"
        if "dev" in self.splits:
            return "C chosen on dev, classifier trained on train, scored on test"
        return f"C chosen by {k}-fold cross-validation on train, classifier trained on train, scored on test"


def discover(directory: str | Path, names: Sequence[str] | None = None) -> dict[str, dict[str, Path]]:
    """Find `<name>_{train,dev,test,all}.tsv` files and check each dataset has a usable set of splits."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataFormatError(f"{directory}: classification directory not found")
    found: dict[str, dict[str, Path]] = {}
    for path in sorted(directory.glob("*.tsv")):
        match = FILE_NAME.match(path.name)
        if match:
            found.setdefault(match["name"], {})[match["split"]] = path
    if names:
        unknown = [n for n in names if n not in found]
        if unknown:
            raise DataFormatError(
                f"{directory}: no files for dataset(s) {', '.join(unknown)} (found: {', '.join(found) or 'none'})"
            )
        found = {n: found[n] for n in names}
    if not found:
        raise DataFormatError(f"{directory}: no <name>_train.tsv / <name>_test.tsv / <name>_all.tsv files")
    for name, splits in found.items():
        have = ", ".join(p.name for p in splits.values())
        if "all" in splits and len(splits) > 1:
            raise DataFormatError(f"{directory}: {name} has both an _all file and split files ({have}); keep one")
        if "all" not in splits and not {"train", "test"} <= set(splits):
            raise DataFormatError(f"{directory}: {name} needs _train and _test files, or one _all file (has {have})")
    return found


def load_split(path: Path, label_column: str = "label") -> Split:
    """Read `sentence, label` or `sentence1, sentence2, label` rows; labels must not be empty."""
    table = read_tsv(path)
    if table.has("sentence1", "sentence2"):
        texts, texts2 = table.strings("sentence1"), table.strings("sentence2")
    elif table.has("sentence"):
        texts, texts2 = table.strings("sentence"), None
    else:
        raise DataFormatError(
            f"{path} line 1: expected a 'sentence' column or 'sentence1' and 'sentence2' "
            f"(columns: {', '.join(table.header)})"
        )
    labels = table.strings(label_column)
    for (line, _), label in zip(table.rows, labels, strict=True):
        if not label.strip():
            raise DataFormatError(f"{path} line {line}: empty {label_column}")
    return Split(path, texts, [label.strip() for label in labels], texts2)


def load_dataset(name: str, files: dict[str, Path], label_column: str = "label") -> Dataset:
    ds = Dataset(name, {split: load_split(path, label_column) for split, path in files.items()})
    kinds = {split: s.texts2 is not None for split, s in ds.splits.items()}
    if len(set(kinds.values())) > 1:
        raise DataFormatError(f"{name}: some files have sentence pairs and some single sentences ({kinds})")
    train = ds.splits.get("train") or ds.splits["all"]
    if len(set(train.labels)) < 2:
        raise DataFormatError(f"{train.path}: only one label ({train.labels[0]!r}); a classifier needs two or more")
    return ds


def features(cells: np.ndarray, rows: np.ndarray, rows2: np.ndarray | None) -> np.ndarray:
    """Sentence vectors, or SentEval's pair features [|u - v|, u * v] when there is a second sentence."""
    u = cells[rows]
    if rows2 is None:
        return np.ascontiguousarray(u, dtype=np.float32)
    v = cells[rows2]
    return np.ascontiguousarray(np.c_[np.abs(u - v), u * v], dtype=np.float32)


@dataclass
class Probe:
    """A fitted logistic regression and the training mean it subtracts from features first.

    Centring does not change the optimum (the intercept is not penalised and absorbs the shift), but it removes
    the large component that anisotropic embeddings share, so lbfgs converges in 2-4x fewer iterations.
    """

    clf: LogisticRegression
    mean: np.ndarray

    @property
    def reg(self) -> float:
        """C, the inverse L2 strength (SentEval calls it reg)."""
        return float(self.clf.C)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.clf.predict(x - self.mean)

    def score(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(self.predict(x) == y))


def fit_path(x: np.ndarray, y: np.ndarray, regs: list[float]) -> list[Probe]:
    """One classifier per C, in increasing C, each warm-started from the previous fit (copies are returned)."""
    mean = x.mean(axis=0)
    clf = _new_classifier(regs[0])
    return [_fit(clf, c, x, mean, y) for c in sorted(regs)]


PATIENCE = 2  # stop the C search after this many larger C values in a row score below the best; 0: try all


def _fit(clf: LogisticRegression, c: float, x: np.ndarray, mean: np.ndarray, y: np.ndarray) -> Probe:
    clf.set_params(C=c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x - mean, y)
    return Probe(copy.deepcopy(clf), mean)


def _new_classifier(c: float) -> LogisticRegression:
    return LogisticRegression(C=c, max_iter=1000, warm_start=True, random_state=SEED)


def _search(regs: list[float], score_at, patience: int) -> tuple[int, list[float]]:
    """Walk C upwards, scoring each; stop once `patience` values in a row score below the best so far.

    Accuracy against C rises to a peak and falls (less regularisation, more overfitting) and the large C values
    are the slow fits (weakly regularised problems need many more lbfgs iterations), so stopping after the peak
    saves most of the time and, on a curve with one peak, chooses the same C as trying them all."""
    scores: list[float] = []
    best, below = 0, 0
    for i, c in enumerate(regs):
        scores.append(score_at(i, c))
        if scores[i] > scores[best]:
            best, below = i, 0
        elif scores[i] < scores[best]:
            below += 1
            if patience and below >= patience:
                break
    return best, scores


def choose_by_dev(x, y, x_dev, y_dev, regs, patience: int = PATIENCE):
    """SplitClassifier: the C with the best dev accuracy (rounded to 0.01 as SentEval, first on ties)."""
    mean, clf, fitted = x.mean(axis=0), _new_classifier(regs[0]), []

    def score_at(_i, c):
        fitted.append(_fit(clf, c, x, mean, y))  # warm start from the previous C
        return round(100 * fitted[-1].score(x_dev, y_dev), 2)

    best, scores = _search(sorted(regs), score_at, patience)
    return fitted[best], scores[best]


def choose_by_kfold(x, y, regs, k, patience: int = PATIENCE):
    """KFoldClassifier: mean k-fold accuracy per C on (x, y); the best C is refitted on all of (x, y).

    C values are tried in increasing order, all folds at each; a fold's fit starts from its own fit at the
    previous C, and at the first C from the previous fold's fit (folds share most rows); the refit on all
    of (x, y) starts from a fold's fit at the chosen C. Warm starts change the path, not the optimum (the
    objective is convex); `patience` stops the search after the peak (see _search).
    """
    splits = list(StratifiedKFold(n_splits=k, shuffle=True, random_state=SEED).split(x, y))
    means = [x[tr].mean(axis=0) for tr, _ in splits]
    fold_clfs: list[LogisticRegression | None] = [None] * k
    first_fold_at: list[Probe] = []

    def score_at(_i, c):
        accs = []
        for f, (tr, te) in enumerate(splits):
            if fold_clfs[f] is None:
                fold_clfs[f] = copy.deepcopy(fold_clfs[f - 1]) if f else _new_classifier(c)
            probe = _fit(fold_clfs[f], c, x[tr], means[f], y[tr])
            if f == 0:
                first_fold_at.append(probe)
            accs.append(probe.score(x[te], y[te]))
        return round(100 * float(np.mean(accs)), 2)

    ordered = sorted(regs)
    best, scores = _search(ordered, score_at, patience)
    refit = copy.deepcopy(first_fold_at[best].clf)
    return _fit(refit, ordered[best], x, x.mean(axis=0), y), scores[best]


def evaluate_cell(
    ds: Dataset,
    x: dict[str, np.ndarray],
    y: dict[str, np.ndarray],
    k: int,
    positive: int | None,
    patience: int = PATIENCE,
):
    """Run the dataset's protocol on one cell's features; return accuracy (x100) and friends."""
    if "all" in ds.splits:
        outer = StratifiedKFold(n_splits=k, shuffle=True, random_state=SEED)
        accs, devs = [], []
        for tr, te in outer.split(x["all"], y["all"]):
            clf, dev = choose_by_kfold(x["all"][tr], y["all"][tr], SPLIT_REGS, k, patience)
            accs.append(round(100 * clf.score(x["all"][te], y["all"][te]), 2))
            devs.append(dev)
        return {"accuracy": float(np.mean(accs)), "dev_accuracy": float(np.mean(devs))}
    if "dev" in ds.splits:
        clf, dev = choose_by_dev(x["train"], y["train"], x["dev"], y["dev"], SPLIT_REGS, patience)
    else:
        clf, dev = choose_by_kfold(x["train"], y["train"], KFOLD_REGS, k, patience)
    predicted = clf.predict(x["test"])
    out = {"accuracy": 100 * float(np.mean(predicted == y["test"])), "dev_accuracy": dev, "C": clf.reg}
    if positive is not None:
        out["f1"] = 100 * float(f1_score(y["test"], predicted, pos_label=positive))
    return out


def check_folds(ds: Dataset, y: dict[str, np.ndarray], k: int) -> None:
    """Stratified k-fold needs every class k times in the data it splits; say so plainly if not."""
    split = "all" if "all" in ds.splits else ("train" if "dev" not in ds.splits else None)
    if split is None:
        return
    counts = np.bincount(y[split])
    counts = counts[counts > 0]
    if counts.min() < k:
        raise DataFormatError(
            f"{ds.splits[split].path}: the rarest label has {counts.min()} rows, fewer than the {k} folds; "
            "use --folds with a smaller number"
        )


def unseen_labels(ds: Dataset) -> str | None:
    """A warning when test labels never occur in train: every such row counts as wrong, whatever the cell."""
    train, test = ds.splits.get("train"), ds.splits.get("test")
    if train is None or test is None:
        return None
    known = set(train.labels)
    missing = sorted(set(test.labels) - known)
    if not missing:
        return None
    rows = sum(label in missing for label in test.labels)
    by_case = {label.casefold(): label for label in known}
    hint = [f"{m!r} vs train {by_case[m.casefold()]!r}" for m in missing if m.casefold() in by_case]
    return (
        f"warning: {test.path}: {rows} of {len(test.labels)} rows have labels that never occur in {train.path} "
        f"({', '.join(map(repr, missing[:10]))}); they count as wrong in every cell"
        + (f"; labels differ only in case: {', '.join(hint[:5])}" if hint else "")
    )


def evaluate_classification(
    embedder: CellEmbedder,
    directory: str | Path,
    datasets: Sequence[str] | None = None,
    label_column: str = "label",
    folds: int = 10,
    log: Callable[[str], None] | None = None,
    patience: int = PATIENCE,
) -> GridResult:
    """Evaluate every cell of `embedder` on each discovered dataset.

    `patience` stops each C search once that many larger C values in a row score below the best (0: try
    every C, as SentEval)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if folds < 2:
        raise ValueError(f"--folds must be at least 2, got {folds}")
    files = discover(directory, datasets)
    loaded = {name: load_dataset(name, split_files, label_column) for name, split_files in files.items()}
    started, start = provenance(), time.perf_counter()  # the load average is the one at the start
    encode_seconds, scores, described = 0.0, [], {}
    for name, ds in loaded.items():
        if warning := unseen_labels(ds):
            log(warning)
        classes = sorted({label for s in ds.splits.values() for label in s.labels})
        y = {split: np.searchsorted(classes, s.labels) for split, s in ds.splits.items()}
        check_folds(ds, y, folds)
        positive = None
        if ds.pair and len(classes) == 2:
            positive = classes.index("1") if "1" in classes else 1
        texts = [t for s in ds.splits.values() for t in (s.texts + (s.texts2 or []))]
        t0 = time.perf_counter()
        cells, rows = embed_distinct(embedder, texts)
        encode_seconds += time.perf_counter() - t0
        index = {
            split: (
                np.array([rows[t] for t in s.texts]),
                None if s.texts2 is None else np.array([rows[t] for t in s.texts2]),
            )
            for split, s in ds.splits.items()
        }
        log(
            f"{name}: {', '.join(f'{k} {len(s.labels)}' for k, s in ds.splits.items())} rows, "
            f"{len(classes)} classes, {len(rows)} distinct texts embedded in {time.perf_counter() - t0:.1f} s"
        )
        for (layer, dim), arr in cells.items():
            t1 = time.perf_counter()
            x = {split: features(arr, *index[split]) for split in ds.splits}
            row = evaluate_cell(ds, x, y, folds, positive, patience)
            scores.append({"dataset": name, "layer": layer, "dim": dim, **row})
            log(
                f"  {name} layer {layer} dim {dim}: accuracy {row['accuracy']:.2f}"
                + (f", F1 {row['f1']:.2f}" if "f1" in row else "")
                + f" ({time.perf_counter() - t1:.1f} s)"
            )
        described[name] = {
            "files": {split: str(s.path) for split, s in ds.splits.items()},
            "rows": {split: len(s.labels) for split, s in ds.splits.items()},
            "classes": classes,
            "pair": ds.pair,
            "protocol": ds.protocol(folds),
        }
    settings = {
        "data_dir": str(Path(directory).resolve()),
        "label_column": label_column,
        "folds": folds,
        "classifier": "sklearn LogisticRegression (lbfgs, max_iter 1000, centred features, warm start along C "
        "and across folds), SentEval C grids"
        + (f", C search stopped after {patience} values below the best" if patience else ", every C tried"),
        "datasets": described,
    }
    seconds = {"total": time.perf_counter() - start, "encode": encode_seconds}
    return grid_result(
        "classification",
        ["accuracy", "f1"],
        list(loaded),
        scores,
        embedder.cells(),
        model_record(embedder),
        settings,
        seconds,
        started,
    )
