"""The budget-aware cell picker: quality from result files against measured cost, its Pareto frontier, and the
cell that fits a budget.

Quality is the primary metric of any of our result files (STS Spearman, classification accuracy, retrieval
nDCG@10) per (layer, dim); with several files, the mean of their primary metrics over the cells they share.
Cost is two numbers per cell:

- encode time per query (ms): one text per call (how a query arrives at a server), at the cell's layer, on
  this machine. An exit at layer n runs n layers, so this depends on the layer only. It is measured once per
  architecture, machine and thread count, and cached in the cache directory (`--remeasure` refreshes it).
- bytes per vector: dim x the bytes of the stored number (float32 4, float16 2, int8 1).

Quality and cost must describe one model: result files record the weights checksum of the model they
evaluated (evaluate/results.py), and pick compares it across the result files and with the model it times.
A mismatch is refused; a result file written before the checksum was recorded gets a warning.

A cell is on the frontier when no other cell scores at least as well at no more time and no more bytes (and
is strictly better in one). Every cell the picker recommends is on the frontier.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matryoshka2d.evaluate.results import cpu_name, grid_of, load_result
from matryoshka2d.retrieval.shards import STORAGES

QUERY_TEXTS = [
    "how do vaccines train the immune system",
    "a man is playing a guitar on stage",
    "effects of caffeine on sleep quality in adults",
    "the central bank raised interest rates",
    "which proteins bind to the promoter region",
    "children riding bicycles down a quiet street",
    "symptoms of vitamin d deficiency",
    "fresh snow covered the mountain village overnight",
]
DEFAULT_TOLERANCE = 1.0  # with no budget: the cheapest cell within this many points of the best score


@dataclass
class Point:
    layer: int
    dim: int
    score: float
    latency_ms: float
    bytes: int
    frontier: bool = False

    @property
    def cell(self) -> str:
        return f"({self.layer},{self.dim})"


def _checksum(result) -> str | None:
    return result.model.get("weights_sha256") if isinstance(result.model, dict) else None


def _described(path: str, result) -> str:
    from matryoshka2d.models.identity import short

    model = result.model if isinstance(result.model, dict) else {}
    return f"{path} (model {model.get('model', '?')}, weights sha256 {short(_checksum(result))})"


def load_quality(paths: list[str]) -> tuple[dict[tuple[int, int], float], str, dict]:
    """Per-cell quality, a description of it, and the first result's model info (with the weights checksum
    of the first result that records one). Result files of different models are refused."""
    results = [load_result(p) for p in paths]
    recorded = [(p, r) for p, r in zip(paths, results, strict=True) if _checksum(r)]
    for path, result in recorded[1:]:
        if _checksum(result) != _checksum(recorded[0][1]):
            raise ValueError(
                f"the result files are of different models: {_described(*recorded[0])} and "
                f"{_described(path, result)}; pick averages the scores of one model"
            )
    grids = [grid_of(r.average, r.metric) for r in results]
    shared = set(grids[0]).intersection(*grids[1:])
    if not shared:
        raise ValueError(f"the result files {', '.join(paths)} have no (layer, dim) cell in common")
    label = " + ".join(f"{r.task} {r.metric}" for r in results)
    if len(results) > 1:
        label = f"mean of {label}"
    quality = {cell: sum(g[cell] for g in grids) / len(grids) for cell in shared}
    model = dict(results[0].model)
    if recorded:
        model["weights_sha256"] = _checksum(recorded[0][1])
    return quality, label, model


def check_timed_model(paths: list[str], model: dict, timed_checksum: str, timed_name: str, log) -> None:
    """The model pick times is the one the result files evaluated (their weights checksum), or a warning when
    the files are older than the checksum."""
    from matryoshka2d.models.identity import short

    recorded = model.get("weights_sha256")
    if recorded is None:
        log(
            f"warning: {', '.join(paths)} record no weights checksum (written by an earlier matryoshka2d): pick "
            f"cannot check that {timed_name}, which it times, is the model they evaluated"
        )
    elif recorded != timed_checksum:
        raise ValueError(
            f"the results in {', '.join(paths)} are of {model.get('model', '?')} (weights sha256 {short(recorded)}), "
            f"but the model timed, {timed_name}, has other weights (sha256 {short(timed_checksum)}): pick would "
            "combine one model's scores with another's timings; pass --model with the evaluated model, or evaluate "
            "this one"
        )


def measure_latency(encoder, layers: list[int], repeats: int = 3) -> dict[int, float]:
    """ms to encode one short query, one text per call, at each layer: per text the fastest of `repeats`
    runs (other processes only ever add time), then the median over texts. Layers take turns round by round,
    so a change in machine load touches them all alike."""
    layers = sorted(layers)
    for layer in layers:
        encoder.encode([QUERY_TEXTS[0]], layer=layer)  # warm-up
    best = {(n, t): float("inf") for n in layers for t in QUERY_TEXTS}
    for _ in range(repeats):
        for t in QUERY_TEXTS:
            for n in layers:
                start = time.perf_counter()
                encoder.encode([t], layer=n)
                best[(n, t)] = min(best[(n, t)], 1000 * (time.perf_counter() - start))
    return {n: statistics.median(best[(n, t)] for t in QUERY_TEXTS) for n in layers}


def cost_key(info: dict) -> str:
    """Timing depends on the architecture, the machine and the threads, not on the weights."""
    import torch

    cpu = cpu_name()
    parts = [info.get(k) for k in ("architecture", "layers", "transformer_size", "hidden_size", "parameters")]
    return f"{'/'.join(map(str, parts))} | {cpu} x{os.cpu_count()} | torch threads {torch.get_num_threads()}"


def load_timed(model: str, pooling: str | None, recorded: str | None):
    """The encoder pick times, and its weights checksum. Results evaluated with a folder's exit heads left off
    (`--no-heads`) recorded the checksum without them: when that is the one that matches, the heads stay off for
    the timing too."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.identity import weights_sha256

    encoder = ElasticEncoder(model, pooling=pooling, device="cpu")
    checksum = weights_sha256(encoder)
    if recorded and checksum != recorded and encoder.exit_heads is not None:
        heads = encoder.exit_heads
        encoder.set_exit_heads(None)
        if weights_sha256(encoder) == recorded:
            return encoder, recorded
        encoder.set_exit_heads(heads)
    return encoder, checksum


def layer_latency(model, pooling: str | None, remeasure: bool, log: Callable[[str], None]) -> tuple[dict, dict]:
    """ms per query at every layer of `model` (a name, or an ElasticEncoder already loaded), from the cache or
    measured now; and the timing record."""
    from matryoshka2d.models.backbones import cache_dir
    from matryoshka2d.models.encoder import ElasticEncoder

    encoder = ElasticEncoder(model, pooling=pooling, device="cpu") if isinstance(model, str) else model
    key = cost_key(encoder.info())
    cache = cache_dir() / "layer_latency.json"
    table = {}
    if cache.is_file():
        try:
            table = json.loads(cache.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            table = {}  # a damaged cache is re-measured, not fatal
    if key in table and not remeasure:
        record = table[key]
        log(f"encode time per layer: cached {record['date']} ({cache})")
    else:
        log(f"measuring encode time per layer of {encoder.name} (one query per call)...")
        ms = measure_latency(encoder, list(range(1, encoder.num_layers + 1)))
        record = {
            "ms_per_query": {str(k): v for k, v in ms.items()},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "model_measured": encoder.name,
        }
        table[key] = record
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    return {int(k): v for k, v in record["ms_per_query"].items()}, {**record, "key": key}


def mark_frontier(points: list[Point]) -> None:
    for p in points:
        p.frontier = not any(
            q is not p
            and q.score >= p.score
            and q.latency_ms <= p.latency_ms
            and q.bytes <= p.bytes
            and (q.score > p.score or q.latency_ms < p.latency_ms or q.bytes < p.bytes)
            for q in points
        )


def recommend(
    points: list[Point],
    max_latency_ms: float | None = None,
    max_bytes: float | None = None,
    min_score: float | None = None,
) -> tuple[Point, str]:
    """The cell for the budget and why. A latency or size cap: the best score under it (ties: the cheaper).
    A score floor, or no budget: the cheapest cell (time, then bytes) that reaches it."""
    full = max(points, key=lambda p: (p.layer, p.dim))
    cheapest = min(points, key=lambda p: (p.latency_ms, p.bytes))
    if max_latency_ms is not None or max_bytes is not None:
        if max_latency_ms is not None:
            fits = [p for p in points if p.latency_ms <= max_latency_ms]
            budget = f"encode time <= {max_latency_ms:g} ms/query"
            least = f"{cheapest.latency_ms:.2f} ms/query at layer {cheapest.layer}"
        else:
            fits = [p for p in points if p.bytes <= max_bytes]
            budget = f"<= {max_bytes:g} bytes/vector"
            least = f"{min(p.bytes for p in points)} bytes/vector"
        if not fits:
            raise ValueError(f"no cell fits the budget {budget}: the cheapest needs {least}")
        chosen = min(fits, key=lambda p: (-p.score, p.latency_ms, p.bytes))
        why = f"the highest score among the {len(fits)} cells with {budget}"
    else:
        best = max(p.score for p in points)
        floor = min_score if min_score is not None else best - DEFAULT_TOLERANCE
        fits = [p for p in points if p.score >= floor]
        if not fits:
            raise ValueError(f"no cell reaches the score {floor:g}: the best is {best:.2f}")
        chosen = min(fits, key=lambda p: (p.latency_ms, p.bytes, -p.score))
        what = f"score >= {floor:.2f}" + (
            "" if min_score is not None else f" (no budget given: within {DEFAULT_TOLERANCE:g} point of the best)"
        )
        why = f"the cheapest (encode time, then bytes) of the {len(fits)} cells with {what}"
    reason = (
        f"{chosen.cell}: score {chosen.score:.2f} ({chosen.score - full.score:+.2f} vs full {full.cell} "
        f"{full.score:.2f}), {full.latency_ms / chosen.latency_ms:.2f}x faster encoding "
        f"({chosen.latency_ms:.2f} vs {full.latency_ms:.2f} ms/query), {chosen.bytes} bytes/vector "
        f"({full.bytes / chosen.bytes:.1f}x smaller); {why}"
    )
    return chosen, reason


def table(points: list[Point], chosen: Point, only_frontier: bool) -> str:
    rows = sorted((p for p in points if p.frontier or not only_frontier), key=lambda p: (p.latency_ms, p.bytes))
    lines = ["| cell | score | ms/query | bytes/vector | frontier |", "|---|---:|---:|---:|:---:|"]
    for p in rows:
        mark = "yes" if p.frontier else ""
        name = f"**{p.cell}**" if p is chosen else p.cell
        lines.append(f"| {name} | {p.score:.2f} | {p.latency_ms:.2f} | {p.bytes} | {mark} |")
    return "\n".join(lines)


def plot(points: list[Point], chosen: Point, path: Path, title: str, budget: tuple[str, float] | None) -> Path:
    """Two panels, score against encode time and against bytes per vector; frontier cells labelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.2))
    FigureCanvasAgg(fig)
    dims = sorted({p.dim for p in points})
    for ax, attr, xlabel in (
        (fig.add_subplot(1, 2, 1), "latency_ms", "encode time per query (ms, this machine)"),
        (fig.add_subplot(1, 2, 2), "bytes", "bytes per vector"),
    ):
        colours = [dims.index(p.dim) for p in points]
        sc = ax.scatter(
            [getattr(p, attr) for p in points], [p.score for p in points], c=colours, cmap="viridis", s=28, alpha=0.55
        )
        front = sorted((p for p in points if p.frontier), key=lambda p: (getattr(p, attr), p.score))
        ax.scatter([getattr(p, attr) for p in front], [p.score for p in front], facecolors="none", edgecolors="k", s=70)
        for p in front:
            ax.annotate(p.cell, (getattr(p, attr), p.score), textcoords="offset points", xytext=(4, 3), fontsize=7)
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
    fig.savefig(path, dpi=120)
    return path


def run_pick(args, latency: dict[int, float] | None = None, log: Callable[[str], None] | None = None) -> int:
    log = log or (lambda m: print(m, file=sys.stderr))
    quality, label, model = load_quality(args.results)
    timing = {}
    if latency is None:
        name = args.model or model.get("location") or model.get("model")
        if not name:
            raise ValueError(f"{args.results[0]}: the result names no model; pass --model")
        encoder, checksum = load_timed(name, model.get("pooling"), model.get("weights_sha256"))
        check_timed_model(args.results, model, checksum, name, log)  # before anything is measured or written
        latency, timing = layer_latency(encoder, None, args.remeasure, log)
        timing["weights_sha256"] = checksum
    missing = sorted({n for n, _ in quality} - set(latency))
    if missing:
        raise ValueError(f"the results have layers {missing} that the timed model does not (it has {len(latency)})")
    per_number = STORAGES[args.storage]
    unscored = sorted(cell for cell, s in quality.items() if not math.isfinite(s))
    if unscored:  # a NaN would compare false with everything: named, and left out of the frontier
        named = ", ".join(f"({n},{d})" for n, d in unscored)
        log(f"pick: {len(unscored)} cells have no finite score (NaN or inf) and are left out: {named}")
        quality = {cell: s for cell, s in quality.items() if math.isfinite(s)}
        if not quality:
            raise ValueError(f"{', '.join(args.results)}: no cell has a finite score (every score is NaN or inf)")
    points = [Point(n, d, s, latency[n], d * per_number) for (n, d), s in sorted(quality.items())]
    mark_frontier(points)
    chosen, reason = recommend(points, args.max_latency_ms, args.max_bytes, args.min_score)
    first = Path(args.results[0])
    out = Path(args.output) if args.output else (first if first.is_dir() else first.parent)
    out.mkdir(parents=True, exist_ok=True)
    budget = None
    if args.max_latency_ms is not None:
        budget = ("latency_ms", args.max_latency_ms)
    elif args.max_bytes is not None:
        budget = ("bytes", args.max_bytes)
    title = f"{Path(str(model.get('model', '?'))).name}: {label} vs cost ({args.storage})"
    png = plot(points, chosen, out / "pick.png", title, budget)
    frontier_table = table(points, chosen, only_frontier=True)
    md = [
        f"# Cell picker: {model.get('model', '?')}",
        "",
        f"- quality: {label}; results: {', '.join(args.results)}",
        f"- cost: encode time per query at each layer (one query per call; {timing.get('key', 'given')}), "
        f"measured {timing.get('date', '-')}; bytes per vector as {args.storage}",
        f"- recommended: {reason}",
        "",
        "## Pareto frontier",
        "",
        frontier_table,
        "",
        "## Every cell",
        "",
        table(points, chosen, only_frontier=False),
        "",
    ]
    (out / "pick.md").write_text("\n".join(md), encoding="utf-8")
    record = {
        "quality": label,
        "storage": args.storage,
        "timing": timing,
        "points": [p.__dict__ for p in points],
        "recommended": {"layer": chosen.layer, "dim": chosen.dim, "score": chosen.score, "reason": reason},
    }
    (out / "pick.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"Pareto frontier ({label} vs encode time and bytes; recommended in bold):")
    print(frontier_table)
    print(f"recommended {reason}")
    print(f"-> {out / 'pick.md'}, {out / 'pick.json'}, {png}")
    return 0
