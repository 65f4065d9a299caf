"""One result type for every evaluator, and its four outputs: results.json, results.md, results.csv, heatmap.png.

A GridResult is written as a plain JSON object (`to_dict`), so that `matryoshka2d report` (and anyone else) can
read it back without this package. `scores` holds one row per (dataset, layer, dim) with every metric of that
row; `average` is each metric averaged over datasets for each cell, the number the tables and heatmaps show.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from matryoshka2d.cells import Cell
from matryoshka2d.outputs import make_folder, open_for_writing, write_text
from matryoshka2d.result_files import check_grid_record, read_result_record

TITLES = {"sts": "STS", "classification": "Classification", "retrieval": "Retrieval"}


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def provenance() -> dict:
    """When, where and how a result was made: date, exact command, machine, software and load."""
    import torch
    import transformers

    cpu = cpu_name()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}",
        "software": f"Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def model_record(embedder) -> dict:
    """What a result records about its model: the embedder's description plus the weights checksum of the
    encoder underneath (models/identity.py), so that `pick` can tell whether the model it times is this one."""
    import torch

    from matryoshka2d.models.identity import weights_sha256

    info = dict(embedder.info())
    encoder = embedder  # the encoder itself, or a cell embedder wrapping one (or wrapping another embedder)
    for _ in range(3):
        if isinstance(encoder, torch.nn.Module):
            info["weights_sha256"] = weights_sha256(encoder)
            break
        encoder = getattr(encoder, "encoder", None) or getattr(encoder, "source", None)
    return info


def provenance_lines(prov: dict, seconds: float | None = None) -> list[str]:
    """The markdown lines that say when, where and how a result was made (see provenance())."""
    took = f"; time taken: {seconds:.1f} s" if seconds is not None else ""
    return [
        f"- date: {prov.get('date')}; machine: {prov.get('machine')}; {prov.get('software')}",
        f"- load average at start / end: {prov.get('load_average_at_start')} / {prov.get('load_average_at_end')}"
        + took,
        f"- command: `{prov.get('command')}`",
    ]


def cell_average(scores: list[dict], metric: str) -> dict[Cell, float]:
    """Mean of `metric` over the datasets that report it, per (layer, dim)."""
    sums: dict[Cell, list[float]] = {}
    for row in scores:
        if metric in row:
            sums.setdefault((row["layer"], row["dim"]), []).append(row[metric])
    return {cell: float(np.mean(v)) for cell, v in sums.items()}


def summarize(scores: list[dict], metric: str, num_layers: int) -> dict:
    """The two headline numbers of the ESE paper's tables.

    `average`: the dataset average at the deepest evaluated layer and widest evaluated dim (the full model when
    the grid includes it). `shallow_average` (ESE's ≺Avg): the mean over layers 1..N-1 that were evaluated of
    the dataset average at that widest dim, where N is the model's depth.
    """
    avg = cell_average(scores, metric)
    if not avg:
        return {}
    top_layer = max(n for n, _ in avg)
    top_dim = max(d for _, d in avg)
    out = {"metric": metric, "cell": [top_layer, top_dim], "average": avg.get((top_layer, top_dim))}
    shallow = sorted(n for n, d in avg if d == top_dim and 0 < n < num_layers)  # layer 0, the static cell, is none
    if shallow:
        out["shallow_layers"] = shallow
        out["shallow_average"] = float(np.mean([avg[(n, top_dim)] for n in shallow]))
    return out


@dataclass
class GridResult:
    """Scores of every (layer, dim) cell on one task's datasets, with what made them (fields in the order of
    results.json)."""

    task: str  # sts, classification or retrieval
    metric: str  # the primary metric: the one tables, heatmaps and the summary show
    metrics: list[str]
    datasets: list[str]
    layers: list[int]
    dims: list[int]
    scores: list[dict]  # one row per (dataset, layer, dim): {"dataset", "layer", "dim", metric: value, ...}
    model: dict = field(default_factory=dict)  # CellEmbedder.info()
    settings: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    average: list[dict] = field(default_factory=list)  # one row per cell: each metric averaged over datasets
    summary: dict = field(default_factory=dict)  # see summarize()

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> GridResult:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("metrics", [data["metric"]])
        values.setdefault("datasets", sorted({r["dataset"] for r in data.get("scores", [])}))
        values.setdefault("scores", [])
        return cls(**values)


def grid_result(
    task: str,
    metrics: Sequence[str],
    datasets: Sequence[str],
    scores: list[dict],
    cells: Sequence[Cell],
    model: dict,
    settings: dict,
    seconds: dict,
    provenance: dict,
) -> GridResult:
    """The one way a result is made: the first metric is the primary one; scores sorted by dataset (in the
    order given), layer and dim; the averages and the summary derived from them; the load average at the end
    added to the provenance."""
    names = list(datasets)
    result = GridResult(
        task=task,
        metric=metrics[0],
        metrics=list(metrics),
        datasets=names,
        layers=sorted({n for n, _ in cells}),
        dims=sorted({d for _, d in cells}),
        scores=sorted(scores, key=lambda r: (names.index(r["dataset"]), r["layer"], r["dim"])),
        model=model,
        settings=settings,
        seconds=seconds,
        provenance={**provenance, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
    )
    for layer, dim in sorted({(r["layer"], r["dim"]) for r in result.scores}):
        rows = [r for r in result.scores if (r["layer"], r["dim"]) == (layer, dim)]
        row = {"layer": layer, "dim": dim}
        for metric in result.metrics:
            if value := cell_average(rows, metric):
                row[metric] = value[(layer, dim)]
        result.average.append(row)
    result.summary = summarize(result.scores, result.metric, int(model.get("layers", 0)))
    return result


def grid_of(rows: list[dict], metric: str) -> dict[Cell, float]:
    return {(r["layer"], r["dim"]): r[metric] for r in rows if metric in r}


def markdown_grid(values: dict[Cell, float], layers: list[int], dims: list[int], digits: int = 2) -> str:
    """A markdown table with layers as rows and dims as columns."""
    lines = ["| layer \\ dim | " + " | ".join(str(d) for d in dims) + " |", "|---:" * (len(dims) + 1) + "|"]
    for n in layers:
        cells = [f"{values[(n, d)]:.{digits}f}" if (n, d) in values else "" for d in dims]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_per_dataset(result: GridResult, dim: int) -> str:
    """Rows: layers; columns: each dataset's metrics at one dim, then the average of the primary metric."""
    columns = [(ds, m) for ds in result.datasets for m in result.metrics if _has(result, ds, m)]
    primary = result.metric
    heads = [(ds if m == primary else f"{ds} {m}").replace("|", "\\|") for ds, m in columns]  # a | ends a cell
    lines = ["| layer | " + " | ".join(heads) + f" | avg {primary} |", "|---:" * (len(columns) + 2) + "|"]
    index = {(r["dataset"], r["layer"], r["dim"]): r for r in result.scores}
    avg = grid_of(result.average, primary)
    for n in result.layers:
        cells = []
        for ds, m in columns:
            row = index.get((ds, n, dim), {})
            cells.append(f"{row[m]:.2f}" if m in row else "")
        mean = f"{avg[(n, dim)]:.2f}" if (n, dim) in avg else ""
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def _has(result: GridResult, dataset: str, metric: str) -> bool:
    return any(r["dataset"] == dataset and metric in r for r in result.scores)


def to_markdown(result: GridResult) -> str:
    title = TITLES.get(result.task, result.task)
    model, prov = result.model, result.provenance
    lines = [
        f"# {title} grid: {model.get('model')} ({result.metric} x 100)",
        "",
        f"- model: {model.get('model')} ({model.get('layers')} layers x {model.get('hidden_size')}, "
        f"pooling {model.get('pooling')}, max_length {model.get('max_length')})",
        f"- datasets: {', '.join(result.datasets)}",
        *[f"- {k}: {v}" for k, v in result.settings.items() if not isinstance(v, (dict, list))],
        *provenance_lines(prov, result.seconds.get("total", 0)),
    ]
    summary = result.summary
    if summary.get("average") is not None:
        layer, dim = summary["cell"]
        lines.append(f"- average of {summary['metric']} at layer {layer}, dim {dim}: **{summary['average']:.2f}**")
    if "shallow_average" in summary:
        lines.append(
            f"- shallow average (layers {_span(summary['shallow_layers'])}, dim {summary['cell'][1]}): "
            f"**{summary['shallow_average']:.2f}**"
        )
    for metric in result.metrics:
        values = grid_of(result.average, metric)
        if not values:
            continue
        having = [ds for ds in result.datasets if _has(result, ds, metric)]
        what = f"average over {len(having)} datasets" if len(having) > 1 else having[0]
        lines += ["", f"## {metric}: {what} (rows: layer, columns: dim)", ""]
        lines.append(markdown_grid(values, result.layers, result.dims))
    full = max(result.dims)
    lines += ["", f"## Per dataset at dim {full}", "", markdown_per_dataset(result, full), ""]
    return "\n".join(lines)


def _span(layers: list[int]) -> str:
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))


def write_outputs(result: GridResult, out_dir: str | Path) -> list[Path]:
    """Write results.json, results.md, results.csv and heatmap.png into out_dir (created if needed), each through
    the one writer (outputs.py): a temporary file beside it renamed into place, so a link in a result's place is
    replaced and never written through, and a result that is (or links to) a file the command reads is refused."""
    from matryoshka2d.evaluate.plots import heatmap

    out = Path(out_dir)
    make_folder(out, check=False)  # `eval --output RUN/sts` lies inside the model it reads; each file is checked
    paths = [out / "results.json", out / "results.md", out / "results.csv", out / "heatmap.png"]
    write_text(paths[0], json.dumps(result.to_dict(), indent=1, ensure_ascii=False) + "\n")
    write_text(paths[1], to_markdown(result))
    with open_for_writing(paths[2], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["dataset", "layer", "dim", *result.metrics])
        for row in result.scores:
            writer.writerow([row["dataset"], row["layer"], row["dim"], *(_fmt(row.get(m)) for m in result.metrics)])
        for row in result.average:
            writer.writerow(["average", row["layer"], row["dim"], *(_fmt(row.get(m)) for m in result.metrics)])
    metric = result.metric
    having = [ds for ds in result.datasets if _has(result, ds, metric)] or result.datasets  # the metric's datasets
    title = f"{result.model.get('model')}: {TITLES.get(result.task, result.task)} {metric} x 100"
    title += f", average of {len(having)} datasets" if len(having) > 1 else f", {having[0]}"
    heatmap(grid_of(result.average, metric), result.layers, result.dims, paths[3], title, metric)
    return paths


def _fmt(value) -> str:
    return "" if value is None else f"{value:.4f}"


def load_result(path: str | Path) -> GridResult:
    """Read a results.json, or the results.json inside a directory, through the one reader of result files
    (result_files.read_result_record): any malformed field is an error naming the file and the field."""
    _, _, record = read_result_record(path, kinds=("grid",))
    return GridResult.from_dict(record)


def result_of(result, file: Path) -> GridResult:
    """A GridResult from the parsed contents of `file`, checked as result_files.check_grid_record checks them."""
    return GridResult.from_dict(check_grid_record(result, file))
