"""The distillation term: how a student's vectors are compared with its teacher's, shared by `matryoshka2d distill`
(matryoshka2d.training.distill, targets cached once) and `train --distill-from T` (a frozen teacher run on every
step's own texts, its term added to the method's loss with --distill-weight).

Per trained view, averaged over nested prefixes of `widths` (the widths the cells use):
- "cos": 1 - cos(student[:w], teacher[:w]);
- "mse": the squared distance between the student's prefix and the prefix of the teacher's unit vector;
- "relational": KL(teacher || student) between the in-batch cosine-similarity distributions at temperature T, the
  alignment 2DMSE and Starbucks put between a shallow view and the last layer (losses.align.similarity_kl).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from matryoshka2d.losses.align import similarity_kl
from matryoshka2d.losses.batch import EmbeddedBatch

LOSSES = ("cos", "mse", "relational")
TEMPERATURE = 0.05  # relational: cosine / 0.05, the scale of in-batch contrastive losses (InfoNCE's 20)


def default_widths(width: int, trained: Iterable[int] | None = None) -> list[int]:
    """The nested prefixes the term covers: the widths a model was trained for (its folder's record), else the
    powers of two from 64 below its width, and the width itself (64/128/256/384 for minilm-l6)."""
    chosen = {int(w) for w in trained or () if 1 <= int(w) <= width}
    if not chosen:
        chosen = {2**k for k in range(6, int(math.log2(width)) + 1) if 2**k < width}
    return sorted(chosen | {width})


def distill_term(
    student: torch.Tensor, teacher: torch.Tensor, widths: Sequence[int], loss: str = "cos", temperature=TEMPERATURE
) -> torch.Tensor:
    """The mean over `widths` of the chosen comparison of student rows with teacher rows (teacher: unit length)."""
    if loss not in LOSSES:
        raise ValueError(f"distillation loss '{loss}': choose one of {', '.join(LOSSES)}")
    terms = []
    for w in widths:
        s, t = student[:, :w], teacher[:, :w]
        if loss == "cos":
            terms.append(1 - F.cosine_similarity(s, t, dim=-1).mean())
        elif loss == "mse":
            terms.append((s - t).pow(2).sum(-1).mean())
        else:  # each row's cosine distribution over the batch (the diagonal included), the teacher's detached
            terms.append(
                similarity_kl(EmbeddedBatch([s, s], "sentences"), EmbeddedBatch([t, t], "sentences"), temperature)
            )
    return torch.stack(terms).mean()


class TeacherTerm:
    """`train --distill-from T`: a frozen teacher encodes each step's texts (the same tokens as the student's, one
    pass to its last layer, no gradient); every view the method trains is pulled towards the teacher's unit vector
    of the same text by `distill_term`, and `weight` times its mean over views joins the loss."""

    def __init__(self, teacher, student, weight: float, loss: str, widths: Sequence[int]):
        if teacher.tokenizer.get_vocab() != student.tokenizer.get_vocab():
            raise ValueError(
                f"--distill-from {teacher.name}: its tokenizer differs from {student.name}'s; the teacher reads the "
                "student's tokens, so both must share one vocabulary"
            )
        if teacher.hidden_size != student.hidden_size:
            raise ValueError(
                f"--distill-from {teacher.name}: its vectors have {teacher.hidden_size} numbers, {student.name}'s "
                f"{student.hidden_size}; a teacher for the same space is needed"
            )
        if not (isinstance(weight, (int, float)) and weight > 0):
            raise ValueError(f"--distill-weight must be a number above 0, got {weight!r}")
        if loss not in LOSSES:
            raise ValueError(f"--distill-loss {loss}: choose one of {', '.join(LOSSES)}")
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.teacher, self.weight, self.loss, self.widths = teacher, float(weight), loss, sorted(set(widths))

    def __call__(self, features, per_column: list[dict], layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight x the term, the term) for the step's columns (features: the student's ColumnBatch)."""
        from matryoshka2d.training.packing import encode_columns

        top = self.teacher.num_layers
        with torch.no_grad():
            targets = encode_columns(self.teacher, features, [top])
        teacher = torch.cat([F.normalize(column[top].float(), dim=-1) for column in targets])
        terms = [
            distill_term(torch.cat([column[n].float() for column in per_column]), teacher, self.widths, self.loss)
            for n in layers
        ]
        term = torch.stack(terms).mean()
        return self.weight * term, term.detach()


def teacher_term(trainer) -> TeacherTerm | None:
    """train --distill-from T: the frozen teacher and its term for a Trainer, or None; the term covers the widths
    the method trains and the full width."""
    cfg = trainer.config
    if cfg.distill_from is None:
        return None
    if trainer.processes.active:
        raise ValueError("--distill-from runs in one process; start it without --processes or torchrun")
    from matryoshka2d.models.encoder import ElasticEncoder

    teacher = ElasticEncoder(cfg.distill_from, pooling=cfg.pooling, max_length=cfg.max_length, device=cfg.device)
    widths = sorted(set(trainer.method.widths()) | {trainer.encoder.hidden_size})
    return TeacherTerm(teacher, trainer.encoder, cfg.distill_weight, cfg.distill_loss, widths)
