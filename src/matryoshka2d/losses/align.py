"""Alignment terms that pull a smaller view towards a larger one.

Two shapes of distribution are compared in the references, and both are here:
- `similarity_kl`: each anchor's in-batch similarity distribution (the 2DMSE paper's eq. 6 and Starbucks'
  eq. 5 read as distributions over the batch; our first reading);
- `feature_kl`: a softmax over each embedding's own components, as the code of both references computes it
  (sentence-transformers' AdaptiveLayerLoss / Matryoshka2dLoss, ielab/Starbucks `sts/starbucks_loss.py`).
The factor on a KL at temperature T differs too: T^2 in Hinton et al.'s distillation (which keeps gradients
the same size as T changes), T in both references' code. `factor` takes "T2", "T" or "1".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from matryoshka2d.losses.batch import EmbeddedBatch

FACTORS = ("T2", "T", "1")


def temperature_factor(temperature: float, factor: str) -> float:
    if factor not in FACTORS:
        raise ValueError(f"KL factor must be one of {', '.join(FACTORS)}, got '{factor}'")
    return {"T2": temperature**2, "T": temperature, "1": 1.0}[factor]


def similarity_kl(
    student: EmbeddedBatch, teacher: EmbeddedBatch, temperature: float, factor: str = "T2", detach: bool = True
) -> torch.Tensor:
    """KL(teacher || student) between in-batch similarity distributions at temperature T."""
    s = student.similarity_logits() / temperature
    t = teacher.similarity_logits() / temperature
    if detach:
        t = t.detach()
    kl = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), log_target=True, reduction="batchmean")
    return kl * temperature_factor(temperature, factor)


def feature_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    temperature: float,
    factor: str = "T",
    detach: bool = True,
    scale_logits: bool = True,
) -> torch.Tensor:
    """KL(teacher || student) between softmaxes over each vector's components (rows: every text of the batch).

    sentence-transformers 6.2 divides the features by T and detaches the teacher (since its PR #3757);
    ielab/Starbucks applies the softmax to the raw features (`scale_logits=False`) and keeps the teacher's
    gradient (`detach=False`). Both multiply by T.
    """
    if scale_logits:
        student, teacher = student / temperature, teacher / temperature
    if detach:
        teacher = teacher.detach()
    log_student, log_teacher = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    kl = F.kl_div(log_student, log_teacher, log_target=True, reduction="batchmean")
    return kl * temperature_factor(temperature, factor)


def mse_kl(student: torch.Tensor, target: torch.Tensor, temperature: float = 1.0, factor: str = "T2") -> torch.Tensor:
    """ESE's align(x, y) = MSE(x, y) + KLDiv(x, y), the KL over each vector's components (softmax over dims).

    angle-emb's `compute_distillation_loss` multiplies the KL by T (factor "T"); the default "T2" is Hinton et
    al.'s; both are the same at ESE's T = 1.
    """
    target = target.detach()
    mse = F.mse_loss(student, target)
    kl = F.kl_div(
        F.log_softmax(student / temperature, dim=-1),
        F.log_softmax(target / temperature, dim=-1),
        log_target=True,
        reduction="batchmean",
    )
    return mse + kl * temperature_factor(temperature, factor)
