"""Length groups: which texts share one forward pass, so that padding costs little and calls stay few.

A forward pass over a padded batch costs about `size x longest` token positions, plus a fixed cost per call
that does not depend on the tokens (in a training step mostly the backward pass: every call adds a full-size
gradient to each weight, and a dense gradient of the token-embedding table). Texts sorted by length and cut into
contiguous runs pad each run only up to its own longest text; `length_groups` picks the cuts that minimise

    sum over groups of (overhead + size x longest)

with `overhead` the fixed cost of a call counted in padded token positions. One group per distinct length is the
padding-free extreme (no padding, many calls); one group is the fully padded one. The partition is exact (a
dynamic programme over the distinct lengths: a cut inside a run of equal lengths never helps, since moving those
texts into the group before it pads nothing and saves nothing), and deterministic, so a seeded run that draws
dropout masks per group draws the same masks when it is repeated or resumed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def length_groups(lengths: Sequence[int], overhead: float, max_size: int | None = None) -> list[np.ndarray]:
    """Indices into `lengths`, grouped: each group a run of the ascending length order (stable, so equal
    lengths keep their order), the groups shortest first. `max_size` caps the texts per group."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return []
    if overhead < 0:
        raise ValueError(f"overhead must be at least 0, got {overhead}")
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order]
    # Ends (exclusive) of the runs of equal length in sorted order: the only places worth cutting.
    ends = np.flatnonzero(np.diff(ordered)) + 1
    ends = np.append(ends, len(ordered)).tolist()
    if max_size is not None:
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        # A run of equal lengths longer than max_size is cut in pieces of max_size (nothing pads inside a run).
        ends = [
            e
            for start, stop in zip([0, *ends[:-1]], ends, strict=True)
            for e in [*range(start + max_size, stop, max_size), stop]
        ]
    longest = [int(ordered[e - 1]) for e in ends]
    cost = [0.0] + [float("inf")] * len(ends)  # cost[j]: best cost of the first ends[j-1] texts
    cut = [0] * (len(ends) + 1)
    for j in range(1, len(ends) + 1):
        stop = ends[j - 1]
        for i in range(j - 1, -1, -1):
            start = ends[i - 1] if i else 0
            size = stop - start
            if max_size is not None and size > max_size:
                break
            total = cost[i] + overhead + size * longest[j - 1]
            if total < cost[j]:
                cost[j], cut[j] = total, i
    bounds, j = [], len(ends)
    while j > 0:
        i = cut[j]
        bounds.append((ends[i - 1] if i else 0, ends[j - 1]))
        j = i
    return [order[start:stop] for start, stop in reversed(bounds)]


def padded_positions(lengths: Sequence[int], groups: Sequence[np.ndarray]) -> int:
    """Token positions a forward pass over these groups computes (each group padded to its longest)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(sum(len(g) * lengths[g].max() for g in groups if len(g)))


def inference_batches(lengths: Sequence[int], batch_size: int, overhead: float | None) -> list[np.ndarray]:
    """The batches of an inference pass: length groups of at most `batch_size` texts for a call overhead in token
    positions, or, with `overhead` None (a device where it was not measured), runs of `batch_size` texts of the
    longest-first order. After one long text, a fixed run of 64 pads 63 texts to its length: on 256 random
    STS sentences (what the server collects from 32 clients) fixed runs compute 1.42 positions per token, length
    groups at an overhead of 48 about 1.07 (docs/benchmarks.md, issue 19)."""
    if len(lengths) == 1:  # one text, one pass (a query: keep its fixed cost small)
        return [np.zeros(1, dtype=np.int64)]
    if overhead is not None:
        return length_groups(lengths, overhead, max_size=batch_size)
    order = np.argsort([-n for n in lengths], kind="stable")
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
