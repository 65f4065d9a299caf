"""AnglE: cosine (CoSENT) + in-batch negatives + angle difference in complex space.

Li & Li (2023), "AnglE-optimized Text Embeddings", sec. 3: L = w1 * L_cos + w2 * L_ibn + w3 * L_angle. Each
embedding is read as a complex vector (first half real, second half imaginary); the angle term ranks pairs
by the normalised complex quotient u / v, which is 1 + 0i (angle 0) for identical directions and so does not
saturate the way cosine does near +-1. Defaults are the paper's: w1 = w2 = w3 = 1, temperatures 20, 20
and 1 (scales of the cosine, in-batch and angle terms). In-batch negatives need positives: they apply to
triplets and NLI pairs; for scored pairs that term is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.losses.cosent import ranking_loss
from matryoshka2d.losses.infonce import in_batch_cross_entropy


def angle_scores(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """|sum of the components of (u / v) * |v| / |u||, with u, v read as complex vectors: 1 for equal directions."""
    half = u.shape[-1] // 2
    a, b = u[:, :half], u[:, half : 2 * half]
    c, d = v[:, :half], v[:, half : 2 * half]
    denom = (c**2 + d**2).sum(-1, keepdim=True).clamp_min(1e-12)
    re, im = (a * c + b * d) / denom, (b * c - a * d) / denom
    norm_ratio = ((a**2 + b**2).sum(-1, keepdim=True) / denom).sqrt().clamp_min(1e-12)
    return ((re + im) / norm_ratio).sum(-1).abs()


class AnglELoss(nn.Module):
    def __init__(
        self,
        cosine_weight: float = 1.0,
        ibn_weight: float = 1.0,
        angle_weight: float = 1.0,
        cosine_scale: float = 20.0,
        ibn_scale: float = 20.0,
        angle_scale: float = 1.0,
    ):
        super().__init__()
        self.cosine_weight, self.ibn_weight, self.angle_weight = cosine_weight, ibn_weight, angle_weight
        self.cosine_scale, self.ibn_scale, self.angle_scale = cosine_scale, ibn_scale, angle_scale

    def forward(self, batch: EmbeddedBatch) -> torch.Tensor:
        u, v, labels = batch.scored_pairs()
        total = u.new_zeros(())
        if self.cosine_weight:
            total = total + self.cosine_weight * ranking_loss(F.cosine_similarity(u, v, -1) * self.cosine_scale, labels)
        if self.ibn_weight:
            triple = batch.positives_and_candidates()
            if triple is not None:
                total = total + self.ibn_weight * in_batch_cross_entropy(*triple, scale=self.ibn_scale)
        if self.angle_weight and u.shape[-1] >= 2:
            total = total + self.angle_weight * ranking_loss(angle_scores(u, v) * self.angle_scale, labels)
        return total
