"""CoSENT: rank pairs by cosine so that every more-similar pair scores above every less-similar one.

Su (2022), "CoSENT"; used as the cosine term of AnglE (Li & Li, 2023, eq. 2). Scale 20 as in both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matryoshka2d.losses.batch import EmbeddedBatch


def ranking_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log(1 + sum over pairs (i, j) with label_i < label_j of exp(score_i - score_j))."""
    diff = scores[:, None] - scores[None, :]  # diff[i, j] = s_i - s_j
    wrong_order = labels[:, None] < labels[None, :]
    diff = diff.masked_fill(~wrong_order, float("-inf"))
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.flatten()]), dim=0)


class CoSENTLoss(nn.Module):
    def __init__(self, scale: float = 20.0):
        super().__init__()
        self.scale = scale

    def forward(self, batch: EmbeddedBatch) -> torch.Tensor:
        u, v, labels = batch.scored_pairs()
        return ranking_loss(F.cosine_similarity(u, v, dim=-1) * self.scale, labels)
