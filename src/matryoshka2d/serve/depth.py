"""The cost of each exit as served, and which exits of a model answer in its last layer's space.

`LayerCost` is pick's cost model (pick/cost.py: one query per call, and a batch per call, measured on the
backend that serves) turned into a line per layer, ms = fixed + per-token x tokens, times one factor for the
machine's present speed, refreshed from every model call the server makes, so it follows what the machine
delivers under the load it has now, contention with the event loop included. The ladder of adaptive depth
(serve/ladder.py) costs its rungs with it.

Only exits aligned to the model's last layer may answer in place of the full depth, since their answers must stay
comparable with vectors the full depth made (an index): exit heads (closed form, `heads fit`) or a `distill --mode
shared` model, whose every exit layer has a head into the last layer's space (`aligned_layers`).
"""

from __future__ import annotations

import math
import threading

# How much each model call moves the estimate of the machine's present speed (an exponential average).
REFRESH = 0.05


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
    layer 5 timed as slow as layer 6), and the ladder then never chooses that layer while the server runs,
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
    change in the machine's load touches them all alike: pick/cost.py; then put on one line in the depth:
    along_depth). What a running server observes then moves
    one factor, the machine's present speed against that measurement, from every call at any layer: a layer the
    ladder seldom chooses never keeps a stale cost (a start under load made every layer look slow, and a
    per-layer refit left the layers not chosen since as slow as they looked then)."""

    def __init__(self, lines: dict[int, list[tuple[float, float]]]):
        """`lines`: layer -> measured (tokens, ms) points, at least two of different sizes per layer."""
        self._lines = {layer: _Line(points) for layer, points in lines.items()}
        self.scale = 1.0
        self._lock = threading.Lock()  # observed on the model thread, read on the event loop

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
        """Measured on `backend` as pick measures (pick/cost.py): one query per call, and `batch` texts per call."""
        from matryoshka2d.serve.timing import QUERY_TEXTS, measure_batched, measure_latency

        one = along_depth(measure_latency(backend, layers))
        per_text = along_depth(measure_batched(backend, layers, batch))
        tokens = sum(len(ids) for ids in backend.tokenizer(QUERY_TEXTS)["input_ids"]) / len(QUERY_TEXTS)
        return cls({n: [(tokens, one[n]), (tokens * batch, per_text[n] * batch)] for n in layers})


def aligned_layers(encoder) -> list[int]:
    """The layers of `encoder` whose vectors live in its last layer's space: the last, and every exit with a head."""
    heads = encoder.exit_heads
    shallow = [n for n in range(1, encoder.num_layers) if heads is not None and heads.has(n)]
    static = [0] if getattr(encoder, "static_cell", None) is not None else []  # its head maps into the last layer's
    return [*static, *shallow, encoder.num_layers]


def check_aligned(encoder, floor: int | None, served: list[int], query_encoders: int = 0) -> list[int]:
    """The layers of the model itself that adaptive depth may answer at (aligned, served, at least the floor); a
    ValueError saying why when the ladder would have one rung only (no aligned exit and no query encoder beside the
    model), or the floor is not an aligned layer."""
    aligned = aligned_layers(encoder)
    if len(aligned) == 1 and not query_encoders:
        raise ValueError(
            f"--adaptive-depth: the exits of {encoder.name} are not aligned to its last layer (it has no exit heads), "
            "and no --query-model is served beside it, so nothing but the full depth answers in its space. "
            "Serve a model whose exits are (`matryoshka2d heads fit`, `matryoshka2d distill --mode shared`), or "
            "query encoders distilled from it (`matryoshka2d distill --mode query|static`, then --query-model)"
        )
    usable = [n for n in aligned if n in served]
    floor = floor if floor is not None else usable[0]
    if floor not in usable:
        raise ValueError(
            f"--min-layer {floor}: adaptive depth answers at aligned layers this server runs: "
            f"{', '.join(map(str, usable))}"
        )
    return [n for n in usable if n >= floor]
