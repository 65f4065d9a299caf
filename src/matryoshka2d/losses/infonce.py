"""InfoNCE / multiple-negatives ranking: each anchor picks its positive among all in-batch candidates.

van den Oord et al. (2018); Henderson et al. (2017); sentence-transformers' MultipleNegativesRankingLoss.
With triplets the hard negatives join the candidates. Scale 20 (= temperature 0.05, as in SimCSE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matryoshka2d.losses.batch import EmbeddedBatch


def in_batch_cross_entropy(anchors, candidates, target, scale: float) -> torch.Tensor:
    logits = F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T * scale
    return F.cross_entropy(logits, target)


class InfoNCELoss(nn.Module):
    learns_from_pairs = True  # anchor/positive pairs without negatives: the batch supplies them

    def __init__(self, scale: float = 20.0):
        super().__init__()
        self.scale = scale

    def forward(self, batch: EmbeddedBatch) -> torch.Tensor:
        triple = batch.positives_and_candidates()
        if triple is None:
            if batch.kind == "nli":
                return batch.columns[0].sum() * 0.0  # a batch with no entailed pair has nothing to rank
            raise ValueError("the infonce loss needs positive pairs: triplets, pairs or NLI pairs, not scored pairs")
        return in_batch_cross_entropy(*triple, scale=self.scale)
