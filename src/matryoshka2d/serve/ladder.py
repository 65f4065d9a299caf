"""Quality under load: a ladder of encoders that all answer in the full model's space, mixed by the arrival rate.

`serve --adaptive-depth` answers a request that leaves its layer open (no `layer`, `layer: "auto"`, or
`input_type: "query"` without a pair) at one rung of a ladder. Every rung lands in the space of the model's last
layer, so one index (documents encoded at full depth) answers them all:

- the model's full depth, and each of its exits that has a head into the last layer's space (`heads fit`,
  `distill --mode shared`), down to `--min-layer`;
- its static cell (layer 0), when the model holds one;
- every `--query-model` served beside it (`distill --mode query` / `--mode static` of this very model: a query
  encoder of another model is refused at start, serve/catalog.py and models/query_record.py).

Each rung has a cost and a quality, both measured at start on the backend that serves: the cost as pick measures it
(serve/depth.LayerCost: one query per call and a batch per call, then refreshed by every model call the server
makes), the quality as the mean cosine between the rung's vectors and the full depth's of calibration texts
(`--calibration-texts`, else the query-like texts the rungs' distill records name). The choice below depends only
on the qualities' order and spacing: any affine map of them (mean cosine against the nDCG share, say) gives the same
mix, so the measure need only be affine in what the operator cares about across rungs.

The mix: at the present arrival rate (texts a second over the last `RATE_WINDOW`), the share of requests per rung
with the most mean quality whose model time fits the time there is: the benchmark's linear program (maximise
sum f_r q_r subject to sum f_r = 1 and rate x sum f_r c_r <= budget), solved online. Its optimum lies on the upper
convex hull of the rungs' (cost, quality) points and mixes at most two neighbours of it (`best_mix`), so it is a
few microseconds per request. The budget is `UTILISATION` of a core (of the model thread, and of the core the event
loop shares with it when the process has one core: the stack's own time per request is measured too), times a
correction that the share of the core the process really used moves towards that utilisation (`Ladder.correct`:
the costs predict, the core's use corrects), less what
the requests of fixed layers take, less a share that drains a backlog once it is more than a quarter of
`--target-ms`; when the backlog alone is the whole target, every open request goes to the cheapest rung until it
drains. Requests are dealt to the rungs in the mix's proportions by credit (each rung earns its share per text, the
richest answers), so a mix of 30% / 70% is 3 in 10 requests, not a coin's luck.

Documents (`input_type: "document"`) and requests that name a layer or an encoder are never moved; every answer
says which rung made it (`encoder` and `layer` on each item, and in the response headers).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from matryoshka2d.serve.depth import LayerCost

if TYPE_CHECKING:
    from matryoshka2d.serve.backends import Backend

# The share of a core the mix may fill. Queueing delay grows as 1 / (1 - utilisation): at 0.9 and this server's
# mixes of 0.7 ms and 3 ms requests a Poisson load waits about 10-20 ms on average, within a target of 50.
UTILISATION = 0.9
RATE_WINDOW = 1.0  # seconds of arrivals the rate is measured over (a tenth of a second of Poisson varies by a third)
REFRESH = 0.05  # how far each observation moves a running average (texts per call, tokens per text, stack time)
STACK_PERIOD = 0.25  # seconds between two readings of the process's CPU time, for the stack's time per request
DRAIN_SECONDS = 0.5  # a backlog past a quarter of the target is planned to drain within this long
CALIBRATION_TEXTS = 256  # texts each rung's quality is measured on at start
# How fast the correction follows the core's measured use (a factor of e^(2 x the gap) a period: from 3 back to 1 in
# about a second at a full core), and how far it may go.
CORRECTION_GAIN = 2.0
CORRECTION_RANGE = (0.5, 3.0)


@dataclass
class Rung:
    """One encoder at one layer that answers in the full model's space."""

    encoder: str  # the served name that runs it (the engine finds it by this name: serve/engine.py)
    layer: int
    quality: float  # the measure against the full depth (1.0 for the full depth itself)
    cost: LayerCost | None = field(default=None, repr=False, compare=False)  # its encoder's cost model
    texts_per_call: float = 1.0  # running average of the calls that ran it

    @property
    def name(self) -> str:
        return f"{self.encoder}@{self.layer}"


def upper_hull(costs: Sequence[float], qualities: Sequence[float]) -> list[int]:
    """Indexes of the rungs on the upper convex hull of (cost, quality), cheapest first, each better than the one
    before it: the only rungs an optimal mix ever uses."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], -qualities[i]))
    hull: list[int] = []
    for i in order:
        if hull and qualities[i] <= qualities[hull[-1]]:
            continue  # no better than a cheaper rung: dominated
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or below the chord from a to i: mixing a and i gives more for b's cost
            if (qualities[b] - qualities[a]) * (costs[i] - costs[a]) <= (qualities[i] - qualities[a]) * (
                costs[b] - costs[a]
            ):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def best_mix(costs: Sequence[float], qualities: Sequence[float], budget: float) -> list[float]:
    """The share of requests per rung that keeps the most mean quality at `budget` ms of model time per request:
    the linear program max sum f q, sum f c <= budget, sum f = 1, f >= 0, solved on the upper hull (two neighbours
    of it, or one rung). Below the cheapest rung's cost nothing fits: all to the cheapest (the guards then refuse
    what is over their bounds)."""
    shares = [0.0] * len(costs)
    hull = upper_hull(costs, qualities)
    if budget >= costs[hull[-1]]:
        shares[hull[-1]] = 1.0
        return shares
    if budget <= costs[hull[0]]:
        shares[hull[0]] = 1.0
        return shares
    for low, high in itertools.pairwise(hull):
        if costs[low] <= budget <= costs[high]:
            upper = (budget - costs[low]) / (costs[high] - costs[low])
            shares[low], shares[high] = 1.0 - upper, upper
            return shares
    raise AssertionError("the budget lies between the hull's ends")  # unreachable: the ends were handled above


def process_cores() -> float:
    """The cores this server's threads may run on: the CPUs of its affinity, shared among `serve --workers`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    from matryoshka2d.serve.workers import WORKER_ENV

    told = os.environ.get(WORKER_ENV, "").split()  # a worker's "FD PORT INDEX COUNT" (serve/workers.py)
    workers = int(told[3]) if len(told) == 4 and told[3].isdigit() else 1
    return max(1.0, cpus / max(1, workers))


class Ladder:
    """The rungs, the present load, and the rung each open request goes to (see the module's docstring)."""

    def __init__(self, rungs: list[Rung], target_ms: float, cores: float | None = None):
        if target_ms <= 0:
            raise ValueError(f"--target-ms must be positive, got {target_ms}")
        if not rungs:
            raise ValueError("adaptive depth needs at least one rung")
        self.rungs = sorted(rungs, key=lambda r: -r.quality)  # the full depth first
        self.costs = {r.encoder: r.cost for r in self.rungs if r.cost is not None}  # encoder -> its LayerCost
        self.target_ms, self.cores = target_ms, cores if cores is not None else process_cores()
        self._arrivals: deque[tuple[float, int]] = deque()  # open requests: (time, texts)
        self._arrived = 0  # texts over the window
        self._fixed: deque[tuple[float, float]] = deque()  # requests of a fixed layer: (time, model ms)
        self._fixed_ms = 0.0
        self._first: float | None = None
        self.credits = [0.0] * len(self.rungs)
        self.shares = [1.0 if i == 0 else 0.0 for i in range(len(self.rungs))]
        self.tokens_per_text = 12.0  # a short query, until texts are seen
        # The stack's own CPU time per request (HTTP, parsing, tokenizing, answering): the process's CPU time less
        # the model thread's, per request, read every STACK_PERIOD.
        self.stack_ms = 0.0
        self._requests = 0
        self._model_cpu = 0.0
        self._last_read: tuple[float, float, float, int] | None = None  # (when, process cpu, model cpu, requests)
        self.backlog = lambda: 0.0  # ms of model time queued now (the server sets it: its batchers' drain)
        self.correction = 1.0  # how much more (or less) the core holds than the costs predict (`correct`)
        self._lock = threading.Lock()  # the model thread observes, the event loop chooses

    # -- what the model thread and the endpoint report ----------------------------------------------------------------
    def observe(self, encoder: str, layer: int, texts: int, tokens: int, cpu_seconds: float, ms: float) -> None:
        """A model call ran `texts` texts of `tokens` tokens at (encoder, layer) in `ms`, using `cpu_seconds` of the
        model thread's CPU; its encoder's cost model follows the machine's present speed from it."""
        cost = self.costs.get(encoder)
        if cost is not None and layer in cost.layers:
            cost.observe(layer, tokens, ms)
        with self._lock:
            self._model_cpu += cpu_seconds
            if texts:
                self.tokens_per_text += REFRESH * (tokens / texts - self.tokens_per_text)
            for rung in self.rungs:
                if rung.encoder == encoder and rung.layer == layer:
                    rung.texts_per_call += REFRESH * (texts - rung.texts_per_call)

    def request(self) -> None:
        """One request reached the endpoint (any layer): the stack's time is per request."""
        self._requests += 1

    def fixed(self, now: float, cost, layer: int, texts: int, tokens: int) -> None:
        """A request of a fixed layer (documents, a named layer or encoder): its model time comes off the budget."""
        if cost is None or layer not in cost.layers:
            return
        ms = texts * cost.predict(layer, tokens / max(1, texts))
        self._fixed.append((now, ms))
        self._fixed_ms += ms

    # -- the choice -----------------------------------------------------------------------------------------------
    def rung_ms(self, rung: Rung) -> float:
        """Model ms per text at `rung`, in calls of the size it has been running (one text at rest)."""
        if rung.cost is None:
            return 0.0
        per_call = max(1.0, rung.texts_per_call)
        return rung.cost.predict(rung.layer, per_call * self.tokens_per_text) / per_call

    def _read_stack(self, now: float) -> None:
        """Every STACK_PERIOD: the stack's CPU time per request, and how busy the core was (the correction)."""
        if self._last_read is not None and now - self._last_read[0] < STACK_PERIOD:
            return
        cpu = time.process_time()
        with self._lock:
            model = self._model_cpu
        if self._last_read is not None:
            when0, cpu0, model0, requests0 = self._last_read
            requests = self._requests - requests0
            if requests > 0:
                per_request = 1000 * max(0.0, (cpu - cpu0) - (model - model0)) / requests
                self.stack_ms += (1.0 if self.stack_ms == 0 else 0.3) * (per_request - self.stack_ms)
            wall = now - when0
            if wall > 0:
                busy = (cpu - cpu0) / (wall * self.cores)
                if self.cores >= 2:  # the model thread is the one that fills up
                    busy = max(busy, (model - model0) / wall)
                self.correct(busy)
        self._last_read = (now, cpu, model, self._requests)

    def correct(self, busy: float) -> None:
        """Move the correction towards the utilisation the mix is meant to fill, from the share of the core the
        process used in the last period (`busy`). The costs predict the time a mix takes; what the process then
        uses shows how far off they are (a call of one query costs less inside a loaded server than at start, the
        static cell less than its measured line): in an open loop at twice the full depth's capacity the model
        alone kept a quarter of the requests at full depth where the linear program over measured capacities kept
        two fifths. Only while the mix sheds (or the core is fuller than meant): at rest every request gets the full
        depth, and the correction returns to 1."""
        if self.shares[0] < 1.0 or busy > UTILISATION:
            step = math.exp(CORRECTION_GAIN * (UTILISATION - busy))
            self.correction = min(CORRECTION_RANGE[1], max(CORRECTION_RANGE[0], self.correction * step))
        else:
            self.correction += 0.3 * (1.0 - self.correction)

    def rate(self, now: float) -> float:
        """Texts of open requests a second, over the last RATE_WINDOW (or since the oldest in it, when sooner)."""
        while self._arrivals and self._arrivals[0][0] < now - RATE_WINDOW:
            self._arrived -= self._arrivals.popleft()[1]
        while self._fixed and self._fixed[0][0] < now - RATE_WINDOW:
            self._fixed_ms -= self._fixed.popleft()[1]
        return self._arrived / self._span(now)

    def _span(self, now: float) -> float:
        """Seconds the window's arrivals came in: the window, or since the oldest of them after a quiet spell (a
        burst after rest is measured at its own rate at once, not diluted by the quiet second before it)."""
        oldest = self._arrivals[0][0] if self._arrivals else now
        return min(RATE_WINDOW, max(now - oldest, 0.05))

    def budget(self, now: float, rate: float) -> float:
        """Model ms per open text that the mix may spend at `rate` texts a second (see the module's docstring)."""
        span = self._span(now)
        second = 1000.0 * UTILISATION
        stack = self.stack_ms * rate  # the open requests' own; the fixed ones' is in their share of the core
        model_room = second * min(1.0, self.cores)
        if self.cores < 2:  # the event loop runs on the model's core
            model_room = min(model_room, second * self.cores - stack)
        backlog = self.backlog()
        drain = max(0.0, backlog - self.target_ms / 4) / DRAIN_SECONDS
        room = self.correction * model_room - self._fixed_ms / span - drain
        return room / max(rate, 1e-9)

    def choose(self, now: float, texts: int = 1, idle: bool = False) -> Rung:
        """The rung for an open request of `texts` texts arriving `now`. `idle`: nothing waits for the model and it
        runs nothing, so this request delays nobody: the full depth. (One client that sends its next request as
        soon as it has an answer keeps the core busy at full depth, and its rate alone would read as overload; an
        open loop past capacity finds the model busy at most arrivals, and the correction pays for the rest.)"""
        if self._first is None:
            self._first = now
        self._arrivals.append((now, texts))
        self._arrived += texts
        self._read_stack(now)
        if idle:
            return self.rungs[0]
        if self.backlog() >= self.target_ms:  # the backlog alone is the target: the cheapest until it drains
            cheapest = min(range(len(self.rungs)), key=lambda i: self.rung_ms(self.rungs[i]))
            return self.rungs[cheapest]
        rate = self.rate(now)
        costs = [self.rung_ms(r) for r in self.rungs]
        self.shares = best_mix(costs, [r.quality for r in self.rungs], self.budget(now, rate))
        for i, share in enumerate(self.shares):
            self.credits[i] = min(self.credits[i] + share * texts, 2.0 * texts + 1.0)  # no windup past a request
        pick = max(range(len(self.rungs)), key=lambda i: (self.credits[i], self.shares[i]))
        self.credits[pick] -= texts
        return self.rungs[pick]

    def describe(self) -> dict:
        now = time.monotonic()
        rate = self.rate(now) if self._first is not None else 0.0
        return {
            "target_ms": self.target_ms,
            "utilisation": UTILISATION,
            "cores": self.cores,
            "arrival_rate_per_s": round(rate, 1),
            "stack_ms_per_request": round(self.stack_ms, 3),
            "correction": round(self.correction, 3),
            "rungs": [
                {
                    "encoder": r.encoder,
                    "layer": r.layer,
                    "quality": round(r.quality, 4),
                    "ms_per_text": round(self.rung_ms(r), 3),
                    "share": round(s, 3),
                }
                for r, s in zip(self.rungs, self.shares, strict=True)
            ],
        }


# ---- start-up: the rungs' quality -----------------------------------------------------------------------------------
def rung_quality(full: np.ndarray, rung: np.ndarray) -> float:
    """Mean cosine between a rung's vectors and the full depth's of the same texts."""
    full = full / np.maximum(np.linalg.norm(full, axis=1, keepdims=True), 1e-12)
    rung = rung / np.maximum(np.linalg.norm(rung, axis=1, keepdims=True), 1e-12)
    return float(np.mean(np.sum(full * rung, axis=1)))


def calibration_texts(files: Sequence[str] | None, records: Sequence[dict], tokenizer) -> tuple[list[str], str]:
    """Up to CALIBRATION_TEXTS texts the rungs' quality is measured on, and where they came from: the operator's
    files, else the query-like files the distill records name (their sentence files; a BEIR corpus only when a
    record names nothing else, cut into claim-sized passages), else the short queries pick times."""
    from matryoshka2d.beir import find_corpus
    from matryoshka2d.training.texts import read_texts

    def first(sources, **cut) -> list[str]:
        texts = []
        for text in read_texts(sources, **cut):
            texts.append(text)
            if len(texts) >= 8 * CALIBRATION_TEXTS:
                break
        step = max(1, len(texts) // CALIBRATION_TEXTS)  # spread over the first ones, not the first few pairs
        return texts[::step][:CALIBRATION_TEXTS]

    if files:
        try:
            texts = first(files)
        except (OSError, ValueError) as exc:  # no such file, a file of no sentences: named as the option's
            raise ValueError(f"--calibration-texts: {exc}") from None
        if not texts:
            raise ValueError(f"--calibration-texts {' '.join(files)}: no text in them")
        return texts, "--calibration-texts"
    named = [d for record in records for d in record.get("data") or [] if isinstance(d, str)]
    existing = [d for d in dict.fromkeys(named) if os.path.exists(d)]
    sentences = [d for d in existing if find_corpus(Path(d)) is None]
    if sentences:
        return first(sentences), "the distill records' sentence files"
    if existing:
        return first(existing, tokenizer=tokenizer, max_tokens=48), "the distill records' corpus, as passages"
    from matryoshka2d.serve.timing import QUERY_TEXTS

    return list(QUERY_TEXTS), "pick's timing queries (give --calibration-texts for a better measure)"


def measure_qualities(
    rungs: list[tuple[Rung, Backend]], full_backend: Backend, full_layer: int, texts: list[str]
) -> None:
    """Each rung's quality on `texts` against the full depth's vectors (set in place); `rungs`: (rung, the backend
    that runs it). A rung whose vectors are not of the full depth's width is not in its space: refused."""
    full = np.asarray(full_backend.pooled(texts, full_layer), dtype=np.float32)
    for rung, backend in rungs:
        vectors = np.asarray(backend.pooled(texts, rung.layer), dtype=np.float32)
        if vectors.shape != full.shape:
            raise ValueError(
                f"--adaptive-depth: the rung {rung.name} gives vectors of {vectors.shape[-1]} numbers, the full "
                f"depth {full.shape[-1]}: it is not in the model's space, so one index cannot answer both"
            )
        rung.quality = rung_quality(full, vectors)
        if not math.isfinite(rung.quality):
            raise ValueError(f"--adaptive-depth: the rung {rung.name} gives vectors that are not finite")


def build_ladder(
    model_id: str,
    backend: Backend,
    layers: list[int],
    queries: dict[str, tuple[Backend, int]],
    target_ms: float,
    texts: list[str],
) -> Ladder:
    """The ladder of a server: the model's `layers` (aligned exits and its full depth, the deepest last) on
    `backend`, and each query encoder (name -> (its backend, its layer)); every rung's cost measured on its backend
    (depth.LayerCost), its quality on `texts` against the full depth."""
    full = max(layers)
    main_cost = LayerCost.measure(backend, layers)
    rungs = [(Rung(model_id, n, 1.0, cost=main_cost), backend) for n in layers]
    for name, (query_backend, layer) in queries.items():
        rungs.append((Rung(name, layer, 0.0, cost=LayerCost.measure(query_backend, [layer])), query_backend))
    measure_qualities(
        [(r, b) for r, b in rungs if not (r.encoder == model_id and r.layer == full)], backend, full, texts
    )
    return Ladder([r for r, _ in rungs], target_ms)
