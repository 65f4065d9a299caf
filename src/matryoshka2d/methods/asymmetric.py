"""asymmetric: shallow queries against deep documents ("asymmetric exits" for retrieval).

In retrieval the documents are encoded once, offline, at full depth N; the query is encoded online, on every
request. Running queries through only n < N layers cuts the online cost, but a plain or 2D-trained model's
layer-n space differs from its layer-N space, so a layer-n query is not comparable with a layer-N document.

Each step samples a query layer n (uniformly from `query_layers`, default 1..N-1) and puts the task loss on:

- the symmetric full view (N, D): queries and documents at the last layer, weight `full_weight`;
- the mixed batch (query at layer n, documents at layer N): the first column of the batch (anchor / sentence1 /
  premise: the query side) is taken at layer n, every other column at layer N, weight `asymmetric_weight`;
- optionally the same mixed batch at one width d sampled from `dims` (widths below D), so shallow queries
  also work with a small cell of the document index (the cascade's shortlist cell).

An alignment term, weight `align_weight`, pulls the layer-n query vector towards the same query's layer-N
vector (1 - cosine, the layer-N vector detached as a teacher): the direct statement of "live in the last
layer's space". Without it the task loss alone only aligns the query with its positives and negatives.
"""

from __future__ import annotations

import numpy as np
import torch

from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods.base import Method, Plan, States, TaskLoss, View


class Asymmetric(Method):
    name = "asymmetric"
    summary = "task loss on (query at a shallow layer n, documents at the last layer) pairs, plus (N, D)"
    settings = "query_layers dims full_weight asymmetric_weight align_weight"

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        query_layers: list[int] | None = None,
        dims: list[int] | None = None,
        full_weight: float = 1.0,
        asymmetric_weight: float = 1.0,
        align_weight: float = 1.0,
    ):
        super().__init__(num_layers, hidden_size)
        if num_layers < 2:
            raise ValueError("asymmetric needs a backbone with at least 2 layers (queries exit below the last)")
        layers = sorted({int(n) for n in (query_layers or range(1, num_layers))})
        bad = [n for n in layers if not 1 <= n < num_layers]
        if bad:
            raise ValueError(f"asymmetric: query_layers {bad} out of range: choose from 1..{num_layers - 1}")
        self.query_layers = layers
        self.dims = sorted({int(d) for d in (dims or [])})
        bad = [d for d in self.dims if not 1 <= d < hidden_size]
        if bad:
            raise ValueError(f"asymmetric: dims {bad} out of range: choose widths below {hidden_size}")
        self.full_weight, self.asymmetric_weight, self.align_weight = full_weight, asymmetric_weight, align_weight

    def plan(self, rng: np.random.Generator) -> Plan:
        n = int(self.query_layers[rng.integers(len(self.query_layers))])
        d = int(self.dims[rng.integers(len(self.dims))]) if self.dims else None
        # info holds numbers only: the trainer sums it over micro-batches and logs it (no width sampled: no "d")
        info = {"n": n, **({"d": d} if d is not None else {})}
        return Plan([View(self.num_layers, self.hidden_size, self.full_weight)], extra_layers={n}, info=info)

    def widths(self) -> set[int]:
        return {*self.dims, self.hidden_size}

    def loss(self, plan: Plan, states: States, task_loss: TaskLoss) -> tuple[torch.Tensor, dict[str, float]]:
        total, parts = super().loss(plan, states, task_loss)  # the symmetric (N, D) view
        n, d, N = plan.info["n"], plan.info.get("d"), self.num_layers
        deep, shallow = states[N], states[n]
        mixed = EmbeddedBatch([shallow.columns[0], *deep.columns[1:]], deep.kind, deep.labels)
        asym = task_loss(mixed)
        parts[f"task(q{n},d{N})"] = asym.detach()
        total = total + self.asymmetric_weight * asym
        if d is not None:
            small = task_loss(mixed.sliced(d))
            parts[f"task(q{n},d{N},{d})"] = small.detach()
            total = total + self.asymmetric_weight * small
        if self.align_weight:
            cos = torch.nn.functional.cosine_similarity(shallow.columns[0], deep.columns[0].detach(), dim=-1)
            align = (1 - cos).mean()
            parts["align"] = align.detach()
            total = total + self.align_weight * align
        return total, parts
