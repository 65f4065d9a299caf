"""Alignment terms that pull a smaller view towards a larger one (teacher side always detached)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from matryoshka2d.losses.batch import EmbeddedBatch


def similarity_kl(student: EmbeddedBatch, teacher: EmbeddedBatch, temperature: float) -> torch.Tensor:
    """KL(teacher || student) between in-batch similarity distributions, scaled by T^2 (Hinton et al.)."""
    s = student.similarity_logits() / temperature
    t = teacher.similarity_logits().detach() / temperature
    kl = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), log_target=True, reduction="batchmean")
    return kl * temperature**2


def mse_kl(student: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """ESE's align(x, y) = MSE(x, y) + KLDiv(x, y), the KL over each vector's components (softmax over dims)."""
    target = target.detach()
    mse = F.mse_loss(student, target)
    kl = F.kl_div(
        F.log_softmax(student / temperature, dim=-1),
        F.log_softmax(target / temperature, dim=-1),
        log_target=True,
        reduction="batchmean",
    )
    return mse + kl * temperature**2
