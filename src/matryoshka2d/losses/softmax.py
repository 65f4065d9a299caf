"""Sentence-BERT's softmax classifier on (u, v, |u - v|) for labelled NLI pairs.

Reimers & Gurevych (2019), sec. 3: o = softmax(W [u; v; |u - v|]), W of shape (3d, k), cross-entropy. The
classifier is trained with the encoder and dropped afterwards. Multi-view methods see several widths d, so
there is one W per width, created on first use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matryoshka2d.losses.batch import EmbeddedBatch


class SoftmaxLoss(nn.Module):
    def __init__(self, num_labels: int = 3):
        super().__init__()
        self.num_labels = num_labels
        self.heads = nn.ModuleDict()

    def head(self, dim: int, like: torch.Tensor) -> nn.Linear:
        key = str(dim)
        if key not in self.heads:
            generator = torch.Generator().manual_seed(dim)  # same init whatever the order views appear in
            layer = nn.Linear(3 * dim, self.num_labels)
            bound = 1 / (3 * dim) ** 0.5
            with torch.no_grad():
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
            self.heads[key] = layer.to(like.device)
        return self.heads[key]

    def forward(self, batch: EmbeddedBatch) -> torch.Tensor:
        if batch.kind != "nli":
            raise ValueError(f"the softmax loss needs labelled NLI pairs, got {batch.kind} data")
        u, v = batch.columns
        features = torch.cat([u, v, (u - v).abs()], dim=-1)
        return F.cross_entropy(self.head(u.shape[-1], u)(features), batch.labels)
