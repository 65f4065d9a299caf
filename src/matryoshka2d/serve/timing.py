"""How long a backend takes to encode at each layer, on this machine, now: one query per call, or a batch per call.

The measuring behind pick's cost (pick/cost.py, which caches it per model and backend) and the ladder's cost model
(serve/depth.py, which measures the backend that serves). Per text the fastest of a few runs (other processes only
ever add time), then the median over texts; layers take turns round by round, so a change in machine load touches
them all alike.
"""

from __future__ import annotations

import statistics
import time

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


def _fastest_in_turns(backend, calls: list[tuple[list[str], int]], repeats: int) -> list[float]:
    """ms of each (texts, layer) call at its fastest of `repeats`, the calls made in turns, round by round, so that
    a change in the machine's load touches every layer alike; each layer is warmed up first (an onnx session loads
    at its first call)."""
    for layer in sorted({n for _, n in calls}):
        backend.pooled(calls[0][0], layer)
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, (texts, layer) in enumerate(calls):
            start = time.perf_counter()
            backend.pooled(texts, layer)
            best[i] = min(best[i], 1000 * (time.perf_counter() - start))
    return best


def measure_latency(backend, layers: list[int], repeats: int = 3) -> dict[int, float]:
    """ms to encode one short query, one text per call, at each layer (see the module's docstring)."""
    layers = sorted(layers)
    calls = [([t], n) for t in QUERY_TEXTS for n in layers]
    best = dict(zip(((n, t[0]) for t, n in calls), _fastest_in_turns(backend, calls, repeats), strict=True))
    return {n: statistics.median(best[(n, t)] for t in QUERY_TEXTS) for n in layers}


def measure_batched(backend, layers: list[int], batch: int, repeats: int = 3) -> dict[int, float]:
    """ms per text when `batch` query texts go in one call at each layer: the fastest of `repeats` calls, the layers
    measured in turns as measure_latency's."""
    texts = [f"{QUERY_TEXTS[i % len(QUERY_TEXTS)]} ({i})" for i in range(batch)]
    layers = sorted(layers)
    best = _fastest_in_turns(backend, [(texts, n) for n in layers], repeats)
    return {n: ms / batch for n, ms in zip(layers, best, strict=True)}
