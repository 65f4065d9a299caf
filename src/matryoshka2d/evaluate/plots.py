"""Annotated layer x dim heatmaps, drawn with matplotlib's Agg canvas (no display, no global pyplot state)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from matryoshka2d.cells import Cell
from matryoshka2d.outputs import writing


def save_figure(fig, path: str | Path, **options) -> Path:
    """Save `fig` as a PNG at `path` through the one writer (outputs.writing): drawn into a temporary file beside
    it and renamed into place, so a link in its place is replaced, never written through."""
    path = Path(path)
    with writing(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", **options)
    return path


def heatmap(
    values: dict[Cell, float],
    layers: list[int],
    dims: list[int],
    path: str | Path,
    title: str,
    label: str,
    diverging: bool = False,
) -> Path:
    """Save a PNG with layers as rows (layer 1 at the bottom, like a stack) and dims as columns.

    Every cell carries its number. A diverging map (for differences) is centred on zero, so red and blue mean
    worse and better whatever the range. Missing cells are left blank.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grid = np.full((len(layers), len(dims)), np.nan)
    for i, n in enumerate(layers):
        for j, d in enumerate(dims):
            grid[i, j] = values.get((n, d), np.nan)
    finite = grid[np.isfinite(grid)]
    if diverging:
        span = float(np.abs(finite).max()) if finite.size else 1.0
        cmap, vmin, vmax = "RdBu", -(span or 1.0), span or 1.0
    else:
        cmap = "viridis"
        vmin = float(finite.min()) if finite.size else 0.0
        vmax = float(finite.max()) if finite.size else 1.0
    fig = Figure(figsize=(1.0 + 0.85 * len(dims), 1.2 + 0.5 * len(layers)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, origin="lower", aspect="auto")
    ax.set_xticks(range(len(dims)), [str(d) for d in dims])
    ax.set_yticks(range(len(layers)), [str(n) for n in layers])
    ax.set_xlabel("dim (first k numbers)")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    mid = (vmin + vmax) / 2
    for i in range(len(layers)):
        for j in range(len(dims)):
            v = grid[i, j]
            if math.isnan(v):
                continue
            strong = abs(v) > 0.6 * vmax if diverging else v <= mid  # dark background: white text
            colour = "white" if strong else "black"
            text = f"{v:+.1f}" if diverging else f"{v:.1f}"
            ax.text(j, i, text, ha="center", va="center", color=colour, fontsize=7)
    fig.colorbar(image, ax=ax, label=label, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return save_figure(fig, path)


def paired_points(rows, path: str | Path, title: str) -> Path:
    """Save a PNG of t-SNE panels (evaluate/compression.py's Panel), a row of panels per list in `rows`: each
    sentence's whole vector as a dark dot and its cut as a light one, as ESE's Figure 7 draws them, with the
    average distance under each panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = max(len(row) for row in rows)
    fig = Figure(figsize=(3.6 * columns, 3.9 * len(rows)), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), columns, squeeze=False)
    for r, row in enumerate(rows):
        for c in range(columns):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c >= len(row):
                ax.set_axis_off()
                continue
            panel = row[c]
            (n, d), (cn, cd) = panel.full, panel.cut
            ax.scatter(*panel.cut_points.T, s=2, color="#9ecae1", label=f"cut ({cn}, {cd})", linewidths=0)
            ax.scatter(*panel.full_points.T, s=2, color="#08306b", label=f"whole ({n}, {d})", linewidths=0)
            ax.set_title(f"{panel.name}: ({n}, {d}) vs ({cn}, {cd})", fontsize=8)
            ax.set_xlabel(
                f"avg. distance {panel.tsne_distance:.2f}\ncosine {panel.cosine_distance:.3f}, "
                f"neighbours lost {panel.neighbour_loss:.2f}",
                fontsize=8,
            )
            ax.legend(loc="upper right", fontsize=6, markerscale=3, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
