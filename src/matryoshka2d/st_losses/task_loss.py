"""The loss a method puts on each view: ours (`TaskLoss`) or any sentence-transformers loss.

`TaskLoss(model, "angle")` is our task loss (`matryoshka2d.losses`: angle, cosent, infonce, softmax, simcse) as a
sentence-transformers loss, usable on its own or inside `ESELoss`, `StarbucksLoss` and `TwoDMSELoss`; those wrap
a sentence-transformers loss (MultipleNegativesRankingLoss, CoSENTLoss, ...) as well, the way MatryoshkaLoss does:
the wrapped loss gets each view's embeddings, through its `compute_loss_from_embeddings` where it has one, else
through the model's forward answering the view's embeddings column by column (MatryoshkaLoss's ForwardDecorator).
A sentence-transformers loss sees what `model(features)["sentence_embedding"]` would give at that view: cut to
the view's width, then unit length where the model ends in Normalize (MatryoshkaLoss's `shrink`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from matryoshka2d.losses import TASK_LOSSES, EmbeddedBatch, make_task_loss
from matryoshka2d.st_losses.layer_states import normalizes, unwrap

KINDS = ("triplets", "pairs", "scored", "nli")


def batch_kind(columns: int, labels: Tensor | None, given: str | None = None) -> str:
    """Which of our data shapes (`losses.batch`) a sentence-transformers batch is: three columns and no labels
    are triplets, two are pairs; two with float labels are scored pairs, with integer labels NLI pairs."""
    if given is not None:
        return given
    if labels is None or labels.numel() == 0:
        if columns == 3:
            return "triplets"
        if columns == 2:
            return "pairs"
        raise ValueError(f"a batch of {columns} columns without labels is neither triplets nor pairs")
    if columns != 2:
        raise ValueError(f"a batch of {columns} columns with labels: labelled data has two columns (sentence pairs)")
    return "scored" if labels.is_floating_point() else "nli"


class TaskLoss(nn.Module):
    def __init__(self, model: nn.Module, name: str = "angle", kind: str | None = None, **options: Any) -> None:
        """One of our task losses (`matryoshka2d.losses`) as a sentence-transformers loss.

        Args:
            model: the SentenceTransformer being trained.
            name: angle (AnglE as angle-emb 0.6.1 weights it per kind of data; the default of `matryoshka2d train`
                for triplets, NLI and scored pairs), cosent, infonce (in-batch negatives, scale 20), softmax
                (SBERT's NLI classifier), simcse.
            kind: triplets, pairs, scored or nli; by default read from the batch (`batch_kind`).
            options: the loss's own options, as `train --loss-option KEY=VALUE` takes them.

        Inputs: (anchor, positive, negative) triplets; (anchor, positive) pairs; sentence pairs with a float
        score or an integer NLI label (0 entailment, 1 neutral, 2 contradiction).
        """
        super().__init__()
        if name not in TASK_LOSSES:
            raise ValueError(f"TaskLoss: unknown loss '{name}'; choose one of {', '.join(TASK_LOSSES)}")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"TaskLoss: kind must be one of {', '.join(KINDS)}, got '{kind}'")
        self.model, self.name, self.kind, self.options = model, name, kind, dict(options)
        self.objective = make_task_loss(name, **options)

    def batch(self, embeddings: list[Tensor], labels: Tensor | None) -> EmbeddedBatch:
        return EmbeddedBatch(list(embeddings), batch_kind(len(embeddings), labels, self.kind), labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        return self.objective(self.batch(embeddings, labels))

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
        return self.compute_loss_from_embeddings(embeddings, labels)

    def get_config_dict(self) -> dict[str, Any]:
        return {"name": self.name, **({"kind": self.kind} if self.kind else {}), **self.options}


class _ViewForward:
    """Stands in for the model's forward while a wrapped loss without `compute_loss_from_embeddings` runs: the
    i-th call returns the view's i-th column (MatryoshkaLoss's ForwardDecorator, matryoshka.py L30-59)."""

    def __init__(self, columns: list[Tensor]):
        self.columns, self.calls = columns, 0

    def __call__(self, features: dict[str, Tensor], *args, **kwargs) -> dict[str, Tensor]:
        column = self.columns[self.calls % len(self.columns)]
        self.calls += 1
        return {**features, "sentence_embedding": column}


def view_loss(loss: nn.Module, model: nn.Module) -> Callable[[EmbeddedBatch, list, Tensor | None], Tensor]:
    """f(view, sentence_features, labels): the wrapped loss on one view's embeddings."""
    if isinstance(loss, TaskLoss):  # ours: the raw pooled vectors, as our trainer gives them
        return lambda view, features, labels: loss.objective(view)
    unit = normalizes(unwrap(model))

    def shaped(view: EmbeddedBatch) -> list[Tensor]:
        return [F.normalize(c, dim=-1) if unit else c for c in view.columns]

    if hasattr(loss, "compute_loss_from_embeddings"):
        return lambda view, features, labels: loss.compute_loss_from_embeddings(shaped(view), labels)

    def through_forward(view: EmbeddedBatch, features, labels) -> Tensor:
        target = unwrap(model)
        original = target.forward
        target.forward = _ViewForward(shaped(view))
        try:
            return loss(features, labels)
        finally:
            target.forward = original

    return through_forward


def check_wrapped(loss: nn.Module, owner: str) -> None:
    """Losses that back-propagate from a hook (the Cached... ones) cannot be called once per view."""
    if getattr(loss, "cache", None) is not None or type(loss).__name__.startswith("Cached"):
        raise ValueError(
            f"{owner} calls its loss once per view on embeddings it computed; {type(loss).__name__} embeds and "
            "back-propagates by itself (gradient caching), so it cannot be wrapped: use its uncached version"
        )


def labels_or_none(labels: Tensor | None) -> Tensor | None:
    return None if labels is None or (isinstance(labels, Tensor) and labels.numel() == 0) else labels


