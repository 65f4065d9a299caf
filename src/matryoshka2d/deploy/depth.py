"""Depth on demand: under load, answer a batch at a shallower exit instead of queueing it or refusing it.

`serve --adaptive-depth --target-ms T --min-layer F`: before each batch of adaptive requests (those that name no
layer, or `layer: "auto"`), the model thread's batcher asks `DepthController.choose` for a layer. The controller
predicts, with each layer's cost (`LayerCost`), how long the texts waiting now would take at that layer: the batch
itself, any fixed-layer groups that run with it, then the backlog behind it (assumed to run at the same layer,
which is what a sustained arrival rate asks of every batch). The deepest layer at which both the batch's oldest
request and the backlog's oldest would be answered within the target is chosen; when none is, the floor. With an
empty queue that is always the full depth: nothing is shed when nothing needs to be.

The target is kept strictly only while the arrivals need more of the model than it has at full depth (`Demand`: the
model time the last second's arrivals would take at full depth, per second). Below that the queue drains by itself,
and a burst may take up to `BURST_SLACK` times the target at full depth before depth is shed: at half the full
depth's capacity, Poisson arrivals put the full depth's predicted time over the target for 16% of the texts
(benchmarks/serve_overload.py at 0.5x, the server's decisions logged, 2026-11-27). Such a server is busier than
"half" says: one query a call costs the full depth 8.1 ms inside the server, and the event loop 1.8 ms more,
against 5.8 ms a request when calls of many keep the model busy.

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
from collections import deque
from dataclasses import dataclass

# How much each model call moves the estimate of the machine's present speed (an exponential average).
REFRESH = 0.05

# Below the full depth's capacity (Demand.share < 1), how far past the target a burst may go at full depth before
# depth is shed. At half the capacity (benchmarks/serve_overload.py --model runs/heads-quick --rates 0.5, minilm-l6
# int8 on one core, SciFact queries, target 50 ms, 2026-11-27) the target alone answered 82-84% of the requests at
# full depth, twice it 92-96% (p99 95-97 ms), three times it 98% (p99 129.4 ms, fixed full depth 197.3 in the same
# run): the Poisson bursts of a load the full depth sustains are answered at full depth, with a tail still shorter
# than fixed full depth's.
BURST_SLACK = 3.0

# Seconds of arrivals the demand is measured over: long enough that a burst of a sustainable load does not read as
# overload (a tenth of a second of Poisson arrivals at half the capacity varies by a third), short enough that an
# overload is seen within a fraction of it.
DEMAND_WINDOW = 1.0


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

    def at_start(self, layer: int, tokens: float) -> float:
        """The measured line's ms, without the machine's present speed (a Demand scales its sum once)."""
        return self._lines[layer](tokens)

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


class Demand:
    """The share of the model's time that the last `window` seconds of arrivals would take at full depth (1.0: all
    of it), each text costed as a call of its own at its own tokens (at the full depth of a CPU a text in a call of 5
    costs about as much as alone: minilm-l6 int8 inside the server, SciFact queries, 8.1 ms alone, 7.8 ms a text in
    calls of 5), requests that name a layer at that layer. Arrivals are added and the share is read on the event
    loop."""

    def __init__(self, cost: LayerCost, full: int, window: float = DEMAND_WINDOW):
        self.cost, self.full, self.window = cost, full, window
        self._arrivals: deque[tuple[float, float]] = deque()
        self._ms = 0.0  # the sum over _arrivals, at the measured lines' speed

    def add(self, now: float, texts: int, tokens: int, layer: int | None = None) -> None:
        layer = layer if layer in self.cost.layers else self.full
        ms = texts * self.cost.at_start(layer, tokens / max(1, texts))
        self._arrivals.append((now, ms))
        self._ms += ms

    def share(self, now: float) -> float:
        while self._arrivals and self._arrivals[0][0] < now - self.window:
            self._ms -= self._arrivals.popleft()[1]
        return max(0.0, self.cost.scale * self._ms / (1000 * self.window))


class DepthController:
    """The layer each batch of adaptive requests is answered at (see the module's docstring)."""

    def __init__(self, layers: list[int], floor: int, target_ms: float, cost: LayerCost):
        if target_ms <= 0:
            raise ValueError(f"--target-ms must be positive, got {target_ms}")
        if floor not in layers:
            raise ValueError(f"--min-layer {floor}: the layers that may answer are {', '.join(map(str, layers))}")
        self.layers = sorted(n for n in layers if n >= floor)  # deepest last
        self.floor, self.target_ms, self.cost = floor, target_ms, cost

    def choose(self, batch: Work, backlog: Work = Work(), fixed_ms: float = 0.0, demand: float | None = None) -> int:
        """The deepest layer at which `batch` (after `fixed_ms` of other groups in its call round) and then `backlog`
        would be answered within the target; the floor when no layer would. With `demand` (Demand.share) below 1,
        within BURST_SLACK times the target."""
        target = self.target_ms * (BURST_SLACK if demand is not None and demand < 1.0 else 1.0)
        for layer in reversed(self.layers):
            done = fixed_ms + self.cost.predict(layer, batch.tokens)
            worst = batch.waited_ms + done
            if backlog.texts:
                worst = max(worst, backlog.waited_ms + done + self.cost.predict(layer, backlog.tokens))
            if worst <= target:
                return layer
        return self.floor

    def describe(self) -> dict:
        return {
            "target_ms": self.target_ms,
            "burst_slack_below_capacity": BURST_SLACK,
            "min_layer": self.floor,
            "layers": self.layers,
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
