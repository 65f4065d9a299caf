"""Unsupervised SimCSE: a sentence predicts itself among the batch, dropout being the only noise.

Gao, Yao & Chen (2021), "SimCSE: Simple Contrastive Learning of Sentence Embeddings", sec. 3, eq. 1-2: each
sentence x_i is encoded twice with independently sampled dropout masks, giving h_i and h_i+; the loss is
    -log  exp(sim(h_i, h_i+) / tau) / sum_j exp(sim(h_i, h_j+) / tau),
sim the cosine, over a batch of N sentences, tau = 0.05 (the paper's default, sec. 3 and Table D.1).

How the two passes happen here: data of kind "sentences" (matryoshka2d.training.data) has two identical columns, so the
trainer encodes every sentence twice in one forward pass in training mode; dropout masks are drawn per element,
so the two copies get different ones, exactly as the SimCSE reference code does by duplicating the batch.

The dimensionality paper (Wang et al., sec. 3) trains its pooler-compressed models with this objective on one
million Wikipedia sentences; SimCSE's other settings for BERT-base are batch 64, lr 3e-5, max length 32, one
epoch (RoBERTa-base: batch 512, lr 1e-5). Set them on the training command; they are not defaults here.
Unlike SimCSE's "MLP only during training" variant, no extra MLP is added: with a pooler head (--pooler-dim)
the head is trained and kept, as in the dimensionality paper.
"""

from __future__ import annotations

import torch
from torch import nn

from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.losses.infonce import in_batch_cross_entropy


class SimCSELoss(nn.Module):
    needs_sentences = True  # the trainer reads every training file as plain sentences for this loss

    def __init__(self, temperature: float = 0.05):
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"simcse: temperature must be positive, got {temperature}")
        self.temperature = temperature

    def forward(self, batch: EmbeddedBatch) -> torch.Tensor:
        if batch.kind != "sentences" or len(batch.columns) != 2:
            raise ValueError(
                f"the simcse loss needs plain sentences encoded twice (data kind 'sentences'), got {batch.kind} data"
            )
        first, second = batch.columns
        target = torch.arange(len(first), device=first.device)
        return in_batch_cross_entropy(first, second, target, scale=1.0 / self.temperature)
