"""pick.png: score against one-query time and against bytes per vector, one marker per backend, colour by dim, the
Pareto frontier circled and labelled, the recommendation starred and the budget drawn."""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.evaluate.plots import save_figure

MARKERS = {"torch": "o", "onnx": "s", "onnx-int8": "^"}


def plot(points: list, chosen, path: Path, title: str, budget: tuple[str, float] | None) -> Path:
    """Two panels, score against encode time and against bytes per vector; a marker per backend, colour by dim,
    frontier options labelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.2))
    FigureCanvasAgg(fig)
    dims = sorted({p.dim for p in points})
    sc = None
    for ax, attr, xlabel in (
        (fig.add_subplot(1, 2, 1), "latency_ms", "encode time per query (ms, this machine)"),
        (fig.add_subplot(1, 2, 2), "bytes", "bytes per vector"),
    ):
        for backend in sorted({p.backend for p in points}):
            mine = [p for p in points if p.backend == backend]
            sc = ax.scatter(
                [getattr(p, attr) for p in mine],
                [p.score for p in mine],
                c=[dims.index(p.dim) for p in mine],
                cmap="viridis",
                vmin=0,
                vmax=max(1, len(dims) - 1),
                marker=MARKERS.get(backend, "D"),
                s=28,
                alpha=0.55,
                label=backend,
            )
        front = sorted((p for p in points if p.frontier), key=lambda p: (getattr(p, attr), p.score))
        ax.scatter([getattr(p, attr) for p in front], [p.score for p in front], facecolors="none", edgecolors="k", s=70)
        for p in front:
            short = p.cell if p.kind == "cell" else p.name.rsplit(" ", 1)[0]
            tag = short + ("" if p.backend == "torch" else f" {p.backend}")
            ax.annotate(tag, (getattr(p, attr), p.score), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.scatter([getattr(chosen, attr)], [chosen.score], marker="*", s=320, c="red", zorder=5, label="recommended")
        if budget and budget[0] == attr:
            ax.axvline(budget[1], color="red", linestyle="--", linewidth=1, label="budget")
        if attr == "bytes":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    bar = fig.colorbar(sc, ax=fig.axes, ticks=range(len(dims)), fraction=0.03)
    bar.ax.set_yticklabels([str(d) for d in dims])
    bar.set_label("dim")
    fig.suptitle(title + "  (circled: Pareto frontier)", fontsize=10)
    return save_figure(fig, path, dpi=120)  # through the one writer (outputs.py)
