"""Depth on demand: under load, answer a batch at a shallower exit instead of queueing it or refusing it.

`serve --adaptive-depth --target-ms T --min-layer F`: before each batch of adaptive requests (those that name no
layer, or `layer: "auto"`), the model thread's batcher asks `DepthController.choose` for a layer. Two things bound
the depth of a batch:

- The rate of arrivals (the sustained load). From the texts that arrived in the last seconds and each layer's
  cost, the controller finds the mix of two adjacent layers whose mean time per text fits the core's time per
  arriving text (the event loop's own share per text taken off first), and gives each batch the deeper or the
  shallower of the two so that the texts answered follow that mix. This is the best any choice of layers can do at
  that load (benchmarks/serve_overload.py's bound is the same linear program over measured capacities: its optimum
  mixes at most two layers, and a layer's share of quality rises with depth). Without it, a controller that only
  looks at the queue keeps the full depth until the queue misses the target, then answers the whole queue at the
  shallowest layer to catch up: at 1.5x the full depth's capacity it answered 40% at layer 1 and 16% at layer 6
  (87.6% of flat nDCG@10, where a steady mix of layers 3 and 4 keeps up to 93.5%; 2026-11-26).
- The queue now (a burst). How long the texts waiting now would take at that layer: the batch itself, any
  fixed-layer groups that run with it, then the backlog behind it (assumed to run at the same layer). The deepest
  layer, at most the rate's, at which both the batch's oldest request and the backlog's oldest would be answered
  within the target is chosen; when none is, the floor.

With nothing arriving and nothing waiting that is always the full depth: nothing is shed when nothing needs to be.

Only a model whose exits are aligned to its last layer may shed depth, since its answers must stay comparable
with vectors the full depth made (an index): exit heads (closed form, `heads fit`) or a `distill --mode shared`
model, whose every exit layer has a head into the last layer's space. `check_aligned` refuses anything else.

`LayerCost` is pick's cost model (deploy/cost.py: one query per call, and a batch per call, measured on the
backend that serves) turned into a line per layer, ms = fixed + per-token x tokens, times one factor for the
machine's present speed, refreshed from every model call the server makes, so it follows what the machine
delivers under the load it has now, contention with the event loop included.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

# How much each model call moves the estimate of the machine's present speed (an exponential average).
REFRESH = 0.05

# The sustained load is what arrived in this many seconds: long enough that a Poisson process's count is steady
# (at 300 texts a second, 600 arrivals: about 4% noise), short enough to follow a change of load within seconds.
RATE_WINDOW = 2.0  # seconds

# The share of the core the rate's mix of layers may plan to use. A queue fed at a rate near its service rate grows
# without bound in its bursts (an M/D/1 queue waits rho / (2 (1 - rho)) services on average: 4.5 at 0.9, 9.5 at
# 0.95); the headroom left here is what absorbs them, and what the queue's check then sheds is the rest.
UTILIZATION = 0.9


@dataclass(frozen=True)
class Work:
    """Texts waiting for the model: how many, their tokens, and how long the oldest has waited (ms)."""

    texts: int = 0
    tokens: int = 0
    waited_ms: float = 0.0


class _Line:
    """ms = a + b x tokens through two measured points (calls of a few and of many tokens)."""

    def __init__(self, points: list[tuple[float, float]]):
        (x0, y0), (x1, y1) = sorted(points)[0], sorted(points)[-1]
        self.b = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
        self.a = max(0.0, y0 - self.b * x0)

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


def along_depth(ms: dict[int, float]) -> dict[int, float]:
    """The measured times of the transformer's exits (layer -> ms), put on one line in the depth.

    Every layer of a transformer costs the same, so a call's time grows in a line with the exit's depth. A
    measurement taken while the machine is busy can put one layer off that line (at a start beside a training run,
    layer 5 timed as slow as layer 6), and the controller then never chooses that layer while the server runs,
    since the running server only rescales all layers alike. The robust line through the layers' times (Theil-Sen:
    the median of the slopes between pairs of layers, which one layer off the line does not move) replaces them.
    Layer 0, the static cell, runs no transformer layer and keeps its own time; fewer than three exits, or a line
    that does not rise with depth, keep what was measured."""
    from scipy.stats import theilslopes

    deep = sorted(n for n in ms if n >= 1)
    if len(deep) < 3:
        return dict(ms)
    slope, intercept, *_ = theilslopes([ms[n] for n in deep], deep)
    if not slope > 0:
        return dict(ms)
    return {n: ms[n] if n == 0 else intercept + slope * n for n in ms}


class LayerCost:
    """Model time (ms) of one call at each layer, from the number of tokens it runs.

    The measurement at start gives each layer's line (its layers measured in turns, round by round, so that a
    change in the machine's load touches them all alike: deploy/cost.py; then put on one line in the depth:
    along_depth). What a running server observes then moves
    one factor, the machine's present speed against that measurement, from every call at any layer: a layer the
    controller seldom chooses never keeps a stale cost (a start under load made every layer look slow, and a
    per-layer refit left the layers not chosen since as slow as they looked then)."""

    def __init__(self, lines: dict[int, list[tuple[float, float]]]):
        """`lines`: layer -> measured (tokens, ms) points, at least two of different sizes per layer."""
        self._lines = {layer: _Line(points) for layer, points in lines.items()}
        self.scale = 1.0
        self._lock = threading.Lock()  # observed on the model thread, read on the batcher's

    @property
    def layers(self) -> list[int]:
        return sorted(self._lines)

    def predict(self, layer: int, tokens: float) -> float:
        with self._lock:
            return self.scale * self._lines[layer](tokens)

    def observe(self, layer: int, tokens: float, ms: float) -> None:
        line = self._lines.get(layer)
        expected = line(tokens) if line is not None else 0.0
        if expected > 0 and math.isfinite(ms):
            with self._lock:
                self.scale = (1 - REFRESH) * self.scale + REFRESH * (ms / expected)

    def describe(self) -> dict:
        with self._lock:
            lines = {
                str(n): {"fixed_ms": round(self.scale * line.a, 3), "ms_per_token": round(self.scale * line.b, 5)}
                for n, line in sorted(self._lines.items())
            }
            return {"speed_against_the_start": round(1 / self.scale, 3), **lines}

    @classmethod
    def measure(cls, backend, layers: list[int], batch: int = 32) -> LayerCost:
        """Measured on `backend` as pick measures (deploy/cost.py): one query per call, and `batch` texts per call."""
        from matryoshka2d.deploy.cost import QUERY_TEXTS, measure_batched, measure_latency

        one = along_depth(measure_latency(backend, layers))
        per_text = along_depth(measure_batched(backend, layers, batch))
        tokens = sum(len(ids) for ids in backend.tokenizer(QUERY_TEXTS)["input_ids"]) / len(QUERY_TEXTS)
        return cls({n: [(tokens, one[n]), (tokens * batch, per_text[n] * batch)] for n in layers})


@dataclass(frozen=True)
class _Arrival:
    at: float  # time.monotonic()
    texts: int
    tokens: int  # of adaptive texts (0 for fixed-layer ones)
    fixed_ms: float  # the model time fixed-layer texts ask for (0 for adaptive ones)
    adaptive: bool


class Arrivals:
    """Texts that arrived in the last `window` seconds: how many in all, how many were adaptive (and their tokens),
    and how many ms of the model's time the fixed-layer ones ask for (predicted as they arrive). Running sums, so a
    batch's question costs no walk over the window. A window of 0 s keeps nothing (the controller then plans from
    the queue alone)."""

    def __init__(self, window: float = RATE_WINDOW):
        self.window = window
        self._seen: deque[_Arrival] = deque()
        self.texts = self.adaptive_texts = self.adaptive_tokens = 0
        self.fixed_ms = 0.0
        self._lock = threading.Lock()  # added on the event loop, read on the batcher's side

    def add(self, now: float, texts: int, tokens: int, fixed_ms: float | None) -> None:
        """`fixed_ms` None: adaptive texts; else the model time the texts ask for at the layer they named."""
        if self.window <= 0:
            return
        adaptive = fixed_ms is None
        arrival = _Arrival(now, texts, tokens if adaptive else 0, 0.0 if adaptive else fixed_ms, adaptive)
        with self._lock:
            self._seen.append(arrival)
            self._count(arrival, +1)
            self._expire(now)

    def per_second(self, now: float) -> tuple[float, float, float, float]:
        """(texts, adaptive texts, their tokens, fixed-layer model ms) per second over the window."""
        if self.window <= 0:
            return 0.0, 0.0, 0.0, 0.0
        with self._lock:
            self._expire(now)
            w = self.window
            return self.texts / w, self.adaptive_texts / w, self.adaptive_tokens / w, self.fixed_ms / w

    def _count(self, arrival: _Arrival, sign: int) -> None:
        self.texts += sign * arrival.texts
        if arrival.adaptive:
            self.adaptive_texts += sign * arrival.texts
            self.adaptive_tokens += sign * arrival.tokens
        self.fixed_ms = max(0.0, self.fixed_ms + sign * arrival.fixed_ms)

    def _expire(self, now: float) -> None:
        while self._seen and self._seen[0].at <= now - self.window:
            self._count(self._seen.popleft(), -1)


class DepthController:
    """The layer each batch of adaptive requests is answered at (see the module's docstring)."""

    def __init__(
        self,
        layers: list[int],
        floor: int,
        target_ms: float,
        cost: LayerCost,
        utilization: float = UTILIZATION,
        window: float = RATE_WINDOW,
    ):
        if target_ms <= 0:
            raise ValueError(f"--target-ms must be positive, got {target_ms}")
        if floor not in layers:
            raise ValueError(f"--min-layer {floor}: the layers that may answer are {', '.join(map(str, layers))}")
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization is a share of the core, in (0, 1]; got {utilization}")
        if not (math.isfinite(window) and window >= 0):
            raise ValueError(f"--rate-window must be a number of seconds, 0 or more; got {window}")
        self.layers = sorted(n for n in layers if n >= floor)  # deepest last
        self.floor, self.target_ms, self.cost = floor, target_ms, cost
        self.utilization = utilization
        self.arrivals = Arrivals(window)
        # The event loop's time per text on the core the model shares (reading, tokenizing, answering), measured
        # by the batcher while the queue drains; until then nothing is taken for it.
        self.loop_ms_per_text = 0.0
        self._owed = 0.0  # texts the rate's mix owes its deeper layer (what the batches so far gave the shallower)

    # -- what the server tells it
    def arrived(self, texts: int, tokens: int, layer: int | None, now: float | None = None) -> None:
        """A request joined the queue: `layer` None for adaptive texts, else the layer they named."""
        now = time.monotonic() if now is None else now
        fixed = None
        if layer is not None:  # a layer the controller did not measure costs as the next one up that it did
            measured = self.cost.layers
            fixed = self.cost.predict(min((n for n in measured if n >= layer), default=measured[-1]), tokens)
        self.arrivals.add(now, texts, tokens, fixed)

    def observe_loop(self, ms_per_text: float) -> None:
        """The event loop's time per text, from a call made while the queue drained (wall time less model time)."""
        if math.isfinite(ms_per_text):
            self.loop_ms_per_text = max(0.0, (1 - REFRESH) * self.loop_ms_per_text + REFRESH * ms_per_text)

    # -- the choice
    def sustainable(self, batch_texts: int = 1, now: float | None = None) -> tuple[int, int, float]:
        """The mix of layers the arrival rate allows: (shallower, deeper, share of texts for the deeper). The full
        depth alone (share 1) when it keeps up; the floor alone when even the floor does not."""
        now = time.monotonic() if now is None else now
        texts, adaptive, tokens, fixed_ms = self.arrivals.per_second(now)
        top = self.layers[-1]
        if adaptive <= 0:
            return top, top, 1.0
        # ms of the core each adaptive text may take: the planned share of the core, less the event loop's time for
        # every text and the model's for the fixed-layer ones, over the adaptive texts arriving per second
        budget = (self.utilization * 1000 - self.loop_ms_per_text * texts - fixed_ms) / adaptive
        # a text's model time at each layer in calls of the present batch's size (a call's fixed cost is shared)
        calls = max(1, batch_texts)
        each = {n: self.cost.predict(n, calls * tokens / adaptive) / calls for n in self.layers}
        if each[top] <= budget:
            return top, top, 1.0
        fits = [n for n in self.layers if each[n] <= budget]
        if not fits:
            return self.floor, self.floor, 1.0
        shallow = fits[-1]
        deep = self.layers[self.layers.index(shallow) + 1]
        return shallow, deep, (budget - each[shallow]) / (each[deep] - each[shallow])

    def planned_layer(self, now: float | None = None) -> float:
        """The mean layer of the rate's mix (for /metrics): the full depth when it keeps up."""
        shallow, deep, share = self.sustainable(1, now)
        return shallow + share * (deep - shallow)

    def choose(self, batch: Work, backlog: Work = Work(), fixed_ms: float = 0.0, now: float | None = None) -> int:
        """The layer for `batch`: at most what the arrival rate allows (`sustainable`, the batches following its mix),
        and of those the deepest at which `batch` (after `fixed_ms` of other groups in its call round) and then
        `backlog` would be answered within the target; the floor when no layer would."""
        shallow, deep, share = self.sustainable(batch.texts + backlog.texts, now)
        ceiling = shallow
        if deep != shallow:  # the batches follow the mix: the deeper layer while it is owed texts
            self._owed = min(max(self._owed + share * batch.texts, -batch.texts), 2.0 * batch.texts)
            if self._owed >= batch.texts / 2:
                ceiling, self._owed = deep, self._owed - batch.texts
        else:
            self._owed = 0.0
        for layer in reversed(self.layers):
            if layer > ceiling:
                continue
            done = fixed_ms + self.cost.predict(layer, batch.tokens)
            worst = batch.waited_ms + done
            if backlog.texts:
                worst = max(worst, backlog.waited_ms + done + self.cost.predict(layer, backlog.tokens))
            if worst <= self.target_ms:
                return layer
        return self.floor

    def describe(self) -> dict:
        return {
            "target_ms": self.target_ms,
            "min_layer": self.floor,
            "layers": self.layers,
            "utilization": self.utilization,
            "rate_window_s": self.arrivals.window,
            "event_loop_ms_per_text": round(self.loop_ms_per_text, 4),
            "cost": self.cost.describe(),
        }


def aligned_layers(encoder) -> list[int]:
    """The layers of `encoder` whose vectors live in its last layer's space: the last, and every exit with a head."""
    heads = encoder.exit_heads
    shallow = [n for n in range(1, encoder.num_layers) if heads is not None and heads.has(n)]
    static = [0] if getattr(encoder, "static_cell", None) is not None else []  # its head maps into the last layer's
    return [*static, *shallow, encoder.num_layers]


def check_aligned(encoder, floor: int | None, served: list[int]) -> list[int]:
    """The layers adaptive depth may answer at (aligned, served, at least the floor); a ValueError saying why when the
    model has no aligned exit or the floor is not one."""
    aligned = aligned_layers(encoder)
    if len(aligned) == 1:
        raise ValueError(
            f"--adaptive-depth: the exits of {encoder.name} are not aligned to its last layer (it has no exit heads), "
            "so a shallower answer would not be comparable with the full depth's vectors. "
            "Serve a model whose exits are: `matryoshka2d heads fit` (closed-form heads) or "
            "`matryoshka2d distill --mode shared`"
        )
    usable = [n for n in aligned if n in served]
    floor = floor if floor is not None else usable[0]
    if floor not in usable:
        raise ValueError(
            f"--min-layer {floor}: adaptive depth answers at aligned layers this server runs: "
            f"{', '.join(map(str, usable))}"
        )
    return [n for n in usable if n >= floor]
