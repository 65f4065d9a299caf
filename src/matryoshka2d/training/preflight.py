"""What a run checks once its model, data and heads are in place and before its first step, so that nothing it
would refuse, or silently not do, is found only after the work:

- the save: a run whose model is saved cut to n layers (distill --mode query, train --method separate) keeps the
  exit head of layer n as a Dense module, and `models.st_save.cut_head` (the check the save runs) refuses one that
  a folder cannot hold (a head reading several layers, a non-affine head). The same function, called here, refuses
  it before the teacher's targets and the steps, not at the save after them.
- a batch of one row: a term that compares each row with the other rows of its batch (in-batch negatives, CoSENT's
  pairs, the relational distillation) is 0 on a batch of one row and trains nothing. Whether a term does is not
  listed per loss: each term a step trains by is computed on one row of random vectors (one row of each label the
  data holds) and its gradient looked at, so a loss added later is covered as it is.
- a static cell (layer 0) the save will drop: one aligned to a transformer that the run trains (or a model saved
  cut to fewer layers) is not carried over (models.st_save); the run says so at its start, as it does for exit
  heads it drops (training.exit_heads), instead of the cell going missing from the folder unsaid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from matryoshka2d.models.heads import HeadsError
from matryoshka2d.models.st_save import cut_head

PROBE_SEED = 0  # the random vectors a term is tried on; any vectors do: a term without a gradient has none at all
PROBED_LABELS = 8  # a term is tried on one row of each of the data's first distinct labels (NLI: its three)


class PreflightError(ValueError):
    """A run refused before its first step; the message names the options and what they would have done."""


@dataclass
class Term:
    """One term a step trains by: the option that chose it (`--loss infonce`), how many vectors a row gives it
    (the data's columns) and of what width, and its value on a batch of those vectors (one row each)."""

    option: str
    columns: int
    width: int
    value: Callable[[list[torch.Tensor], int], torch.Tensor]  # (vectors, row of the data) -> loss


def check(trainer) -> None:
    """The checks of this module on a Trainer whose model, data and heads are in place."""
    check_the_save(trainer)
    check_a_batch_of_one_row(trainer)
    say_what_becomes_of_the_static_cell(trainer)


def check_the_save(trainer) -> None:
    """The save's own refusal of the model cut to `keep_layers`, before the first step instead of after the last."""
    keep = getattr(trainer.method, "keep_layers", None)
    if not keep:
        return
    try:
        cut_head(trainer.encoder, keep)
    except HeadsError as exc:
        raise PreflightError(
            f"{trainer.cut_options()}: refused before the first step, since the save at the end of the run would "
            f"refuse it: the model is saved cut to {keep} layers with the exit head of layer {keep} as a Dense "
            f"module, and {exc} (in a run: --exit-heads fit or identity with --exit-heads-inputs exit)"
        ) from None


def check_a_batch_of_one_row(trainer) -> None:
    """Refuse, naming the option, a term that trains nothing when every batch is one row (--batch-size 1, or data
    of one row)."""
    rows = min(trainer.config.batch_size, len(trainer.data))
    if rows >= 2:
        return
    probed = probe_rows(trainer.data.labels)
    for term in trainer.one_row_terms():
        if any(has_gradient(term, row, trainer.encoder.device) for row in probed):
            continue
        why = (
            f"--batch-size {trainer.config.batch_size}"
            if trainer.config.batch_size < 2
            else f"--data {' '.join(trainer.data.sources)} holds {len(trainer.data)} row, so every batch is that row"
        )
        raise PreflightError(
            f"{why}, and {term.option} compares each row with the other rows of its batch: on a batch of one row it "
            "is 0 and trains nothing. Use --batch-size 2 or more (and data of two rows or more)"
        )


def probe_rows(labels) -> list[int]:
    """The rows a term is tried on: the first row of each of the first distinct labels (row 0 without labels)."""
    if labels is None or len(labels) == 0:
        return [0]
    _, first = np.unique(np.asarray(labels), return_index=True)
    return sorted(int(i) for i in first)[:PROBED_LABELS]


def has_gradient(term: Term, row: int, device) -> bool:
    """Whether `term` on one row of random vectors has a gradient other than zero."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    vectors = [torch.randn(1, term.width, generator=generator).to(device).requires_grad_() for _ in range(term.columns)]
    loss = term.value(vectors, row)
    if not loss.requires_grad:
        return False
    grads = torch.autograd.grad(loss, vectors, allow_unused=True)
    return any(g is not None and bool(torch.count_nonzero(g)) for g in grads)


def say_what_becomes_of_the_static_cell(trainer, log=print) -> None:
    """A line, at the start, when the model's static cell will not be in the saved folder: the run trains the
    transformer (or pooler head) the cell was aligned to, or saves the model cut to fewer layers."""
    encoder = trainer.encoder
    if getattr(encoder, "static_cell", None) is None or not trainer.processes.main:
        return
    backbone = [encoder.model, *([encoder.head] if encoder.head is not None else [])]
    trained = any(p.requires_grad for module in backbone for p in module.parameters())
    keep = getattr(trainer.method, "keep_layers", None)
    if keep:
        why = f"the model is saved cut to {keep} layers, without layer 0"
    elif trained:
        why = "training changes the transformer it was aligned to, and its vectors would land in the old one's space"
    else:
        return
    log(
        f"{encoder.name}: its static cell (layer 0) is not kept: {why}; distill a new one from the result with "
        "`matryoshka2d distill --mode static --teacher OUTPUT`"
    )
