"""Quality for `pick`: every result file `eval` writes, read into options a user can deploy.

- A grid (`results.json` of `eval sts|classification|retrieval`): one option per (layer, dim), on the backend that
  scored it (serve/served.py: torch, onnx, onnx-int8). Several grids of one backend are averaged over the cells
  they share (the mean of their primary metrics), as `pick` always did.
- A cascade / asymmetric retrieval file (`cascade.json` of `eval retrieval --cascade / --query-layer /
  --query-model / --storage`): one option per row, its nDCG@10 averaged over the datasets. Rows differ in what they
  do to an index that already holds the full model's documents: queries at a shallow layer and distilled query
  encoders keep it; a storage tier (float16, int8, binary with float16 rescoring) rebuilds it from the same vectors;
  a flat shallow cell or a cascade re-encodes the corpus.

Every file must be of one model (the weights checksum it records); the error names the two that differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from matryoshka2d.evaluate.results import grid_of, result_of
from matryoshka2d.result_files import read_result_record
from matryoshka2d.serve.served import served_as


@dataclass
class Option:
    """One thing pick can recommend, before its cost is known."""

    layer: int  # the layer the query runs to (a query encoder: its own depth)
    dim: int
    score: float
    backend: str = "torch"
    kind: str = "cell"  # cell | query-layer (documents at the full cell) | query-encoder | cascade
    query_model: str | None = None  # query-encoder: the student's folder
    shortlist_cell: tuple[int, int] | None = None  # cascade: the small cell the shortlist comes from
    storage: str | None = None  # storage: how the index holds the documents (float16, int8, binary, ...)


@dataclass
class Quality:
    label: str  # what the score is, e.g. "sts spearman"
    task: str
    model: dict  # the model record of the first file (with its weights checksum)
    options: list[Option] = field(default_factory=list)
    backends: dict[str, list[str]] = field(default_factory=dict)  # backend -> the files scored with it


def _checksum(record) -> str | None:
    return record.get("weights_sha256") if isinstance(record, dict) else None


def _described(path: str, model: dict) -> str:
    from matryoshka2d.models.identity import short

    return f"{path} (model {model.get('model', '?')}, weights sha256 {short(_checksum(model))})"


def read_file(path: str) -> tuple[str, dict, str]:
    """('grid', GridResult) or ('cascade', the cascade record), and the file read, from a file or a result folder,
    read by the one reader of result files (result_files.read_result_record), which names the file and the field
    of anything wrong."""
    kind, file, record = read_result_record(path)
    return kind, (record if kind == "cascade" else result_of(record, file)), str(file)


# A layer or a width has at most 9 digits (int() of thousands of digits stops at Python's digit limit with a message
# that names no file): a longer one is a mode pick does not know, named with its file.
_N = r"(\d{1,9})"
CASCADE_MODES = [  # the `mode` of a cascade.json row -> an option
    (re.compile(rf"flat \({_N},{_N}\) stored as ([a-z0-9-]+)(?: \(.*\))?"), "storage"),
    (re.compile(rf"flat \({_N},{_N}\)(?: \(queries and docs at layer \d+\))?"), "cell"),
    (re.compile(rf"queries at layer {_N} -> docs \({_N},{_N}\)"), "query-layer"),
    (re.compile(rf"cascade \({_N},{_N}\) top \d+ -> \({_N},{_N}\)"), "cascade"),
    (re.compile(rf"query encoder (.+) \({_N} layers\) -> docs \({_N},{_N}\)"), "query-encoder"),
]


def cascade_options(record: dict, path: str) -> list[Option]:
    """One option per mode, nDCG@10 averaged over the datasets."""
    scores: dict[str, list[float]] = {}
    for row in record["rows"]:
        scores.setdefault(row["mode"], []).append(float(row["ndcg@10"]))
    options = []
    for mode, values in scores.items():
        score = sum(values) / len(values)
        for pattern, kind in CASCADE_MODES:
            m = pattern.fullmatch(mode)
            if m is None:
                continue
            g = m.groups()
            if kind == "cell":
                options.append(Option(int(g[0]), int(g[1]), score))
            elif kind == "storage":
                options.append(Option(int(g[0]), int(g[1]), score, kind=kind, storage=g[2]))
            elif kind == "query-layer":
                options.append(Option(int(g[0]), int(g[2]), score, kind=kind))
            elif kind == "cascade":
                options.append(Option(int(g[2]), int(g[3]), score, kind=kind, shortlist_cell=(int(g[0]), int(g[1]))))
            else:
                options.append(Option(int(g[1]), int(g[3]), score, kind=kind, query_model=g[0]))
            break
        else:
            shown = repr(mode) if len(mode) <= 120 else f"{mode[:100]!r}... ({len(mode)} characters)"
            raise ValueError(f"{path}: a row's mode {shown} is not one pick knows")
    return options


def load_quality(paths: list[str]) -> Quality:
    """Every file's options, grids of one backend averaged. Files of different models, grids of different tasks
    across backends, and cascades next to grids of another task are refused."""
    read_with_files = [(p, *read_file(p)) for p in paths]
    read = [(p, kind, r) for p, kind, r, _ in read_with_files]
    models = [(p, r.model if kind == "grid" else r["model"]) for p, kind, r in read]
    recorded = [(p, m) for p, m in models if _checksum(m)]
    for path, model in recorded[1:]:
        if _checksum(model) != _checksum(recorded[0][1]):
            raise ValueError(
                f"the result files are of different models: {_described(*recorded[0])} and "
                f"{_described(path, model)}; pick compares the options of one model"
            )
    model = dict(models[0][1])
    if recorded:
        model["weights_sha256"] = _checksum(recorded[0][1])
    grids: dict[str, list[tuple[str, object]]] = {}
    for path, kind, result in read:
        if kind == "grid":
            grids.setdefault(served_as(result.model), []).append((path, result))
    labels = {}
    quality = Quality(label="", task="", model=model)
    for backend, files in grids.items():
        label = " + ".join(f"{r.task} {r.metric}" for _, r in files)
        labels[backend] = f"mean of {label}" if len(files) > 1 else label
        cells = [grid_of(r.average, r.metric) for _, r in files]
        shared = set(cells[0]).intersection(*cells[1:])
        if not shared:
            raise ValueError(f"the result files {', '.join(p for p, _ in files)} have no (layer, dim) cell in common")
        for n, d in sorted(shared):
            score = sum(c[(n, d)] for c in cells) / len(cells)
            quality.options.append(Option(n, d, score, backend=backend))
        quality.backends[backend] = [p for p, _ in files]
    if len(set(labels.values())) > 1:
        said = "; ".join(f"{b}: {label}" for b, label in labels.items())
        raise ValueError(f"each backend's quality must come from the same tasks to be compared ({said})")
    quality.label = next(iter(labels.values()), "retrieval ndcg@10")
    quality.task = next((r.task for _, kind, r in read if kind == "grid"), "retrieval")
    for path, kind, record, file in read_with_files:
        if kind != "cascade":
            continue
        if quality.label != "retrieval ndcg@10":
            raise ValueError(f"{path} holds retrieval nDCG@10; it cannot be compared with {quality.label}")
        backend = served_as(record["model"])
        quality.backends.setdefault(backend, []).append(path)
        for option in cascade_options(record, file):
            option.backend = backend
            quality.options.append(option)
    seen = set()  # the full cell of a retrieval grid and of a cascade file is one option: the first file's score
    unique = []
    for o in quality.options:
        key = (o.layer, o.dim, o.backend, o.kind, o.query_model, o.shortlist_cell, o.storage)
        if key not in seen:
            seen.add(key)
            unique.append(o)
    quality.options = unique
    return quality
