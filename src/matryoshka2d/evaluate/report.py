"""`matryoshka2d report`: several results of one task side by side, and how each differs from the first.

Typical use is RAW against a trained model: the table shows every cell both runs evaluated, and the heatmap
shows second minus first, so the layers and widths a training method improved stand out at a glance.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from matryoshka2d.cells import Cell
from matryoshka2d.evaluate.plots import heatmap
from matryoshka2d.evaluate.results import TITLES, GridResult, grid_of, load_result, markdown_grid
from matryoshka2d.outputs import make_folder, write_text


def default_names(results: list[GridResult], paths: Sequence[str | Path]) -> list[str]:
    """Model names; if two runs share a model, their directory names; if those clash too, numbered."""
    names = [str(r.model.get("model", "?")) for r in results]
    if len(set(names)) < len(names):
        names = [Path(p).name if Path(p).is_dir() else Path(p).parent.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{n}#{i + 1}" for i, n in enumerate(names)]
    return names


def check_comparable(results: list[GridResult], paths: Sequence[str | Path]) -> None:
    first = results[0]
    for r, p in zip(results[1:], paths[1:], strict=True):
        if (r.task, r.metric) != (first.task, first.metric):
            raise ValueError(
                f"{p}: a {r.task} result ({r.metric}) cannot be compared with {paths[0]}, a {first.task} "
                f"result ({first.metric})"
            )


def per_dataset(result: GridResult, cell: Cell) -> dict[str, float]:
    metric = result.metric
    return {r["dataset"]: r[metric] for r in result.scores if (r["layer"], r["dim"]) == cell and metric in r}


def build_report(results: list[GridResult], names: list[str], paths: Sequence[str | Path]) -> tuple[str, list[dict]]:
    """The markdown report and, per later result, its difference grid against the first."""
    metric = results[0].metric
    grids = [grid_of(r.average, metric) for r in results]
    common = sorted(set.intersection(*(set(g) for g in grids)))
    if not common:
        raise ValueError("the results share no (layer, dim) cell; nothing to compare")
    layers = sorted({n for n, _ in common})
    dims = sorted({d for _, d in common})
    lines = [
        f"# Report: {TITLES.get(results[0].task, results[0].task)}, {metric} x 100",
        "",
        "| name | model | datasets | average (cell) | shallow average | date | result |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for name, r, p in zip(names, results, paths, strict=True):
        s = r.summary
        avg = f"{s['average']:.2f} ({s['cell'][0]}, {s['cell'][1]})" if s.get("average") is not None else ""
        shallow = f"{s['shallow_average']:.2f}" if "shallow_average" in s else ""
        lines.append(
            f"| {name} | {r.model.get('model')} | {len(r.datasets)} | {avg} | {shallow} | "
            f"{r.provenance.get('date', '')} | {p} |"
        )
    diff_heads = [f"{n} - {names[0]}" for n in names[1:]]
    lines += [
        "",
        f"## Per cell: {metric}, average over each result's datasets",
        "",
        "| layer | dim | " + " | ".join(names + diff_heads) + " |",
        "|---:" * (2 + len(names) + len(diff_heads)) + "|",
    ]
    for cell in common:
        values = [g[cell] for g in grids]
        cells = [f"{v:.2f}" for v in values] + [f"{v - values[0]:+.2f}" for v in values[1:]]
        lines.append(f"| {cell[0]} | {cell[1]} | " + " | ".join(cells) + " |")
    top = (max(layers), max(d for n, d in common if n == max(layers)))
    tables = [per_dataset(r, top) for r in results]
    datasets = [d for d in results[0].datasets if all(d in t for t in tables)]
    if datasets:
        lines += [
            "",
            f"## Per dataset at layer {top[0]}, dim {top[1]}",
            "",
            "| dataset | " + " | ".join(names + diff_heads) + " |",
            "|---" + "|---:" * (len(names) + len(diff_heads)) + "|",
        ]
        for ds in datasets:
            values = [t[ds] for t in tables]
            cells = [f"{v:.2f}" for v in values] + [f"{v - values[0]:+.2f}" for v in values[1:]]
            lines.append(f"| {ds} | " + " | ".join(cells) + " |")
    diffs = []
    for name, grid in zip(names[1:], grids[1:], strict=True):
        diff = {cell: grid[cell] - grids[0][cell] for cell in common}
        diffs.append({"name": name, "grid": diff, "layers": layers, "dims": dims})
        lines += ["", f"## {name} - {names[0]} (rows: layer, columns: dim)", "", markdown_grid(diff, layers, dims)]
    return "\n".join(lines) + "\n", diffs


def write_report(paths: Sequence[str | Path], out_dir: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """Write report.md and one diff_<name>_minus_<first>.png per later result into out_dir."""
    if len(paths) < 2:
        raise ValueError("report needs at least two results to compare")
    results = [load_result(p) for p in paths]
    check_comparable(results, paths)
    if names is not None and len(names) != len(paths):
        raise ValueError(f"--names has {len(names)} names for {len(paths)} results")
    names = list(names) if names else default_names(results, paths)
    markdown, diffs = build_report(results, names, paths)
    out = Path(out_dir)
    make_folder(out, check=False)  # a folder of named files, each checked as written
    written = [write_text(out / "report.md", markdown)]  # through the one writer (outputs.py), as the heatmaps
    metric = results[0].metric
    for diff in diffs:
        file = out / f"diff_{_slug(diff['name'])}_minus_{_slug(names[0])}.png"
        title = f"{metric} x 100: {diff['name']} minus {names[0]}"
        heatmap(diff["grid"], diff["layers"], diff["dims"], file, title, f"{metric} difference", diverging=True)
        written.append(file)
    return written


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "result"
