"""The budget-aware picker: for a budget, which cell on which backend, and what it loses.

Quality comes from result files as served (pick/quality.py): the primary metric of each grid per (layer, dim) on
the backend that scored it (torch, onnx, onnx-int8), and every row of a cascade / asymmetric retrieval file
(queries at a shallow layer or from a distilled query encoder against the full model's documents, cascades).
Cost is measured the same way (pick/cost.py): encode time per query at the option's layer with the backend that
would serve it, on this machine; and bytes per stored vector (dim x the bytes of a number).

One frontier holds every (option, backend): the full model in int8 next to shallow cells in fp32 and int8. An option
is on it when no other scores at least as well at no more time and no more bytes (and is strictly better in one);
every recommendation is on it. A results file of another backend than `--backend` times, or of another model than
the one timed (its weights checksum), is refused.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matryoshka2d.models.backbones import SHORT_NAMES
from matryoshka2d.outputs import make_folder, write_json, write_text
from matryoshka2d.pick.commands import SERVE_FLAGS, deployment
from matryoshka2d.pick.cost import layer_latency, load_timed
from matryoshka2d.pick.frontier_plot import plot
from matryoshka2d.pick.quality import Quality, load_quality
from matryoshka2d.retrieval.shards import STORAGES

DEFAULT_TOLERANCE = 1.0  # with no budget: the cheapest option within this many points of the best score
KEEPS_INDEX = {"query-layer", "query-encoder"}


def index_effect(p: Point, full: tuple[int, int]) -> str:
    """What an option does to an index of the full model's documents at `full`."""
    if p.kind in KEEPS_INDEX or (p.kind == "cell" and (p.layer, p.dim) == full):
        return "keeps"
    return "rebuilds (same vectors)" if p.kind == "storage" else "re-encodes"


@dataclass
class Point:
    layer: int
    dim: int
    score: float
    latency_ms: float
    bytes: int
    backend: str = "torch"
    kind: str = "cell"  # see pick/quality.Option
    query_model: str | None = None
    shortlist_cell: tuple[int, int] | None = None
    storage: str | None = None  # kind "storage": how the index holds the documents
    frontier: bool = False
    batched_ms: float | None = None  # ms per text in calls of --batch texts

    @property
    def cell(self) -> str:
        return f"({self.layer},{self.dim})"

    @property
    def name(self) -> str:
        what = {
            "cell": self.cell,
            "query-layer": f"queries {self.cell} -> full docs",
            "storage": f"{self.cell} stored as {self.storage}",
            "query-encoder": f"query encoder {Path(str(self.query_model)).name} {self.cell}",
            "cascade": f"cascade ({self.shortlist_cell[0]},{self.shortlist_cell[1]}) -> {self.cell}"
            if self.shortlist_cell
            else self.cell,
        }[self.kind]
        return f"{what} {self.backend}"


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


def check_backends(quality: Quality, timed: list[str], model: str) -> None:
    """Every result file's backend is timed, and every timed backend has results: an int8 score is never assumed
    from fp32, nor an fp32 one from int8."""
    for backend, files in quality.backends.items():
        if backend not in timed:
            raise ValueError(
                f"{', '.join(files)} scored with the {backend} backend, but pick times {', '.join(timed)}: add "
                f"--backend {backend}, or leave those files out"
            )
    for backend in timed:
        if backend not in quality.backends:
            given = "; ".join(f"{b}: {', '.join(f)}" for b, f in quality.backends.items())
            raise ValueError(
                f"pick --backend {backend}: no result file was scored with it (given: {given}); score it first: "
                f"`matryoshka2d eval {quality.task} --model {model}{SERVE_FLAGS.get(backend, '')} --output DIR`"
            )


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
    reference: Point | None = None,
) -> tuple[Point, str]:
    """The option for the budget and why. A latency or size cap: the best score under it (ties: the cheaper). A
    score floor, or no budget: the cheapest option (time, then bytes) that reaches it. `reference` (default: the
    deepest, widest cell) is what the speed-up and the score change are stated against."""
    full = reference or max(points, key=lambda p: (p.kind == "cell", p.layer, p.dim, p.backend == "torch"))
    cheapest = min(points, key=lambda p: (p.latency_ms, p.bytes))
    if max_latency_ms is not None or max_bytes is not None:
        if max_latency_ms is not None:
            fits = [p for p in points if p.latency_ms <= max_latency_ms]
            budget = f"encode time <= {max_latency_ms:g} ms/query"
            least = f"{cheapest.latency_ms:.2f} ms/query at layer {cheapest.layer} ({cheapest.backend})"
        else:
            fits = [p for p in points if p.bytes <= max_bytes]
            budget = f"<= {max_bytes:g} bytes/vector"
            least = f"{min(p.bytes for p in points)} bytes/vector"
        if not fits:
            raise ValueError(f"no cell fits the budget {budget}: the cheapest needs {least}")
        chosen = min(fits, key=lambda p: (-p.score, p.latency_ms, p.bytes))
        why = f"the highest score among the {len(fits)} options with {budget}"
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
        why = f"the cheapest (encode time, then bytes) of the {len(fits)} options with {what}"
    top = max(points, key=lambda p: (p.score, -p.latency_ms, -p.bytes))
    loses = (
        "the best score of all"
        if top.score <= chosen.score
        else f"{top.score - chosen.score:.2f} below the best option, {top.name} at {top.score:.2f}"
    )
    reason = (
        f"{chosen.name}: score {chosen.score:.2f} ({chosen.score - full.score:+.2f} vs {full.name} "
        f"{full.score:.2f}), {full.latency_ms / chosen.latency_ms:.2f}x faster encoding "
        f"({chosen.latency_ms:.2f} vs {full.latency_ms:.2f} ms/query), {chosen.bytes} bytes/vector "
        f"({full.bytes / chosen.bytes:.1f}x smaller); {why}; {loses}"
    )
    return chosen, reason


def table(points: list[Point], chosen: Point, only_frontier: bool, full: tuple[int, int] | None = None) -> str:
    """The options as a markdown table; with `full` (retrieval results), what each does to an index at `full`."""
    retrieval = full is not None
    rows = sorted((p for p in points if p.frontier or not only_frontier), key=lambda p: (p.latency_ms, p.bytes))
    batched = any(p.batched_ms is not None for p in points)
    head = "| option | backend | score | ms/query |" + (" ms/text batched |" if batched else "")
    head += " bytes/vector |" + (" index |" if retrieval else "") + " frontier |"
    lines = [head, "|---|---|" + "---:|" * (3 + batched) + (":---:|" if retrieval else "") + ":---:|"]
    for p in rows:
        mark = "yes" if p.frontier else ""
        label = p.name.rsplit(" ", 1)[0]
        name = f"**{label}**" if p is chosen else label
        line = f"| {name} | {p.backend} | {p.score:.2f} | {p.latency_ms:.2f} |"
        if batched:
            line += f" {p.batched_ms:.3f} |" if p.batched_ms is not None else " |"
        line += f" {p.bytes} |"
        if retrieval:
            line += f" {index_effect(p, full)} |"
        lines.append(line + f" {mark} |")
    return "\n".join(lines)


def _timings(encoder, quality, backends, args, log) -> tuple[dict, dict, dict]:
    """ms per query per (backend, layer) for the model and each query encoder in the results; the timing records;
    with --batch, ms per text in batched calls too."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.query_record import query_encoder_layer, query_encoder_record

    latency, batched, records = {}, {}, {}
    for backend in backends:
        latency[backend], records[backend] = layer_latency(encoder, None, args.remeasure, log, backend)
        if getattr(args, "batch", None):
            batched[backend], _ = layer_latency(encoder, None, args.remeasure, log, backend, args.batch)
    for o in quality.options:
        if o.kind == "query-encoder" and (o.query_model, o.backend) not in latency:
            student = ElasticEncoder(o.query_model, device="cpu")
            own = query_encoder_layer(query_encoder_record(student) or {}, student)  # 0: a static cell
            ms, _ = layer_latency(student, None, args.remeasure, log, o.backend)
            latency[(o.query_model, o.backend)] = {o.layer: ms[own]}
            if getattr(args, "batch", None):
                ms, _ = layer_latency(student, None, args.remeasure, log, o.backend, args.batch)
                batched[(o.query_model, o.backend)] = {o.layer: ms[own]}
    return latency, batched, records


def points_of(quality: Quality, latency: dict, batched: dict, storage: str) -> list[Point]:
    per_number = STORAGES[storage]
    points = []
    for o in quality.options:
        key = (o.query_model, o.backend) if o.kind == "query-encoder" else o.backend
        numbers = o.dim + (o.shortlist_cell[1] if o.shortlist_cell else 0)
        size = math.ceil(numbers * STORAGES[o.storage]) if o.storage else round(numbers * per_number)
        points.append(
            Point(
                o.layer,
                o.dim,
                o.score,
                latency[key][o.layer],
                size,
                o.backend,
                o.kind,
                o.query_model,
                o.shortlist_cell,
                o.storage,
                batched_ms=batched.get(key, {}).get(o.layer),
            )
        )
    return points


def run_pick(args, latency: dict[int, float] | None = None, log: Callable[[str], None] | None = None) -> int:
    """`latency` (ms per query per layer, torch) stands in for a measurement: tests and the demo's fixed timings."""
    log = log or (lambda m: print(m, file=sys.stderr))
    quality = load_quality(args.results)
    model = quality.model
    backends = list(getattr(args, "backend", None) or quality.backends)
    name = _model_name(args, model)
    check_backends(quality, backends, name)
    threads = getattr(args, "threads", None)
    if threads is not None:
        import torch

        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    ms, batched, timing, num_layers = _costs(args, name, quality, backends, latency, log)
    _leave_out_scoreless(quality, args.results, log)
    points = points_of(quality, ms, batched, args.storage)
    mark_frontier(points)
    reference_backend = "torch" if "torch" in backends else backends[0]
    cells = [p for p in points if p.kind == "cell" and p.backend == reference_backend] or points
    reference = max(cells, key=lambda p: (p.layer, p.dim))
    max_latency_ms = args.max_latency_ms
    ratio = getattr(args, "max_latency_ratio", None)
    if ratio is not None:
        if not ratio > 0:
            raise ValueError(f"--max-latency-ratio must be above 0, got {ratio}")
        max_latency_ms = ratio * ms[reference_backend][num_layers]
        log(
            f"budget: {ratio:g} x the full model on {reference_backend} ({ms[reference_backend][num_layers]:.2f} "
            f"ms/query) = {max_latency_ms:.2f} ms/query"
        )
    chosen, reason = recommend(points, max_latency_ms, args.max_bytes, args.min_score, reference)
    full = (reference.layer, reference.dim)
    retrieval = quality.task == "retrieval"
    how = deployment(chosen, name, full, retrieval)
    first = Path(args.results[0])
    out = Path(args.output) if args.output else (first if first.is_dir() else first.parent)
    make_folder(out, check=False)  # by default the results folder pick reads: each file is checked as written
    budget = None
    if max_latency_ms is not None:
        budget = ("latency_ms", max_latency_ms)
    elif args.max_bytes is not None:
        budget = ("bytes", args.max_bytes)
    title = f"{Path(str(model.get('model', '?'))).name}: {quality.label} vs cost ({args.storage})"
    png = plot(points, chosen, out / "pick.png", title, budget)
    frontier_table = table(points, chosen, only_frontier=True, full=full if retrieval else None)
    every_option = table(points, chosen, only_frontier=False, full=full if retrieval else None)
    # pick.md, pick.json and pick.png through the one writer (outputs.py): a link in a file's place is replaced,
    # never written through, and one that reaches a file pick reads is refused.
    write_text(
        out / "pick.md", _pick_markdown(args, quality, backends, timing, reason, how, frontier_table, every_option)
    )
    record = {
        "quality": quality.label,
        "storage": args.storage,
        "backends": backends,
        "timing": timing.get(reference_backend, {}),
        "timings": timing,
        "points": [p.__dict__ for p in points],
        "recommended": {
            "layer": chosen.layer,
            "dim": chosen.dim,
            "backend": chosen.backend,
            "kind": chosen.kind,
            "query_model": chosen.query_model,
            "score": chosen.score,
            "reason": reason,
            "deploy": how,
        },
    }
    write_json(out / "pick.json", record, indent=1)
    print(f"Pareto frontier ({quality.label} vs encode time and bytes; recommended in bold):")
    print(frontier_table)
    print(f"recommended {reason}")
    for line in how:
        print(f"  {line}")
    print(f"-> {out / 'pick.md'}, {out / 'pick.json'}, {png}")
    return 0


def _model_name(args, model: dict) -> str:
    """The model the deploy commands name: --model, else a short name (minilm-l6 reads better than its install
    path), else where the results' model was loaded from."""
    given = model.get("model")
    short = given if given in SHORT_NAMES else None
    name = args.model or short or model.get("location") or given
    if not name:
        raise ValueError(f"{args.results[0]}: the result names no model; pass --model")
    return name


def _costs(args, name: str, quality: Quality, backends: list[str], latency, log) -> tuple[dict, dict, dict, int]:
    """(ms per query per layer per backend, the same in batches, the timing records, the model's layers): measured
    on the model the results were made with (checked first), or `latency` as given. Every layer the results hold
    must be one the timed model has."""
    model = quality.model
    timing = {}
    if latency is None:
        encoder, checksum = load_timed(name, model.get("pooling"), model.get("weights_sha256"))
        check_timed_model(args.results, model, checksum, name, log)  # before anything is measured or written
        ms, batched, timing = _timings(encoder, quality, backends, args, log)
        for record in timing.values():
            record["weights_sha256"] = checksum
        num_layers, timed = encoder.num_layers, set(encoder.layers)
    else:
        ms, batched, num_layers = {"torch": latency}, {}, max(latency)
        timed = set(latency)
    missing = sorted({o.layer for o in quality.options if o.kind != "query-encoder"} - timed)
    if missing:
        raise ValueError(f"the results have layers {missing} that the timed model does not (it has {num_layers})")
    return ms, batched, timing, num_layers


def _leave_out_scoreless(quality: Quality, results: list[str], log) -> None:
    """Options without a finite score (NaN or inf) are named and left out: a NaN compares false with everything."""
    bad = [o for o in quality.options if not math.isfinite(o.score)]
    if not bad:
        return
    named = ", ".join(f"({o.layer},{o.dim}) {o.backend}" for o in bad)
    log(f"pick: {len(bad)} cells have no finite score (NaN or inf) and are left out: {named}")
    quality.options = [o for o in quality.options if math.isfinite(o.score)]
    if not quality.options:
        raise ValueError(f"{', '.join(results)}: no cell has a finite score (every score is NaN or inf)")


def _pick_markdown(args, quality: Quality, backends, timing: dict, reason: str, how, frontier: str, every: str) -> str:
    """pick.md: what was compared, the recommendation with its deploy commands, the frontier and every option."""
    model = quality.model
    timed = "; ".join(f"{b}: {r.get('key', '')}, measured {r.get('date', '-')}" for b, r in timing.items()) or "given"
    md = [
        f"# Cell picker: {model.get('model', '?')}",
        "",
        f"- quality: {quality.label}, as served by {', '.join(backends)}; results: {', '.join(args.results)}",
        f"- cost: encode time per query at each layer with each backend (one query per call; {timed}); bytes per "
        f"vector as {args.storage}",
        f"- recommended: {reason}",
        *[f"  - {line}" for line in how],
        "",
        "## Pareto frontier",
        "",
        frontier,
        "",
        "## Every option",
        "",
        every,
        "",
    ]
    return "\n".join(md)
