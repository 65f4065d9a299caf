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

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import AdaptiveLayerLoss, MatryoshkaLoss
from torch import Tensor, nn

from matryoshka2d.losses import TASK_LOSSES, EmbeddedBatch, make_task_loss
from matryoshka2d.methods import Method
from matryoshka2d.st_losses.layer_states import normalizes, unwrap

KINDS = ("triplets", "pairs", "scored", "nli")


def batch_kind(columns: int, labels: Tensor | None, given: str | None = None, owner: str = "") -> str:
    """Which of our data shapes (`losses.batch`) a sentence-transformers batch is: three columns and no labels
    are triplets, two are pairs; two with float labels are scored pairs, with integer labels NLI pairs."""
    if given is not None:
        return given
    said = f"{owner}: " if owner else ""
    if labels is None or labels.numel() == 0:
        if columns == 3:
            return "triplets"
        if columns == 2:
            return "pairs"
        raise ValueError(f"{said}a batch of {columns} columns without labels is neither triplets nor pairs")
    if columns != 2:
        raise ValueError(
            f"{said}a batch of {columns} columns with labels: labelled data has two columns (sentence pairs)"
        )
    return "scored" if labels.is_floating_point() else "nli"


def checked_batch(sentence_features: Iterable[dict[str, Tensor]], owner: str) -> list[dict[str, Tensor]]:
    """The batch's columns, refused with the loss's name when there is nothing to embed: no column, or a column of
    no texts (a loss over no rows is NaN or a raw error deep in the transformer)."""
    columns = list(sentence_features)
    if not columns:
        raise ValueError(
            f"{owner}: a batch without text columns; the dataset needs its text columns (e.g. anchor, positive, "
            "negative) besides any label or score"
        )
    for number, features in enumerate(columns, start=1):
        rows = next((value.shape[0] for value in features.values() if isinstance(value, Tensor)), 0)
        if rows == 0:
            raise ValueError(
                f"{owner}: an empty batch (column {number} holds no texts); every batch needs at least one row: "
                "a dataset with rows and a batch size of 1 or more"
            )
    return columns


class TaskLoss(nn.Module):
    """One of our task losses (`matryoshka2d.losses`) as a sentence-transformers loss: alone, as `matryoshka2d train
    --loss NAME` trains the full model, or as the loss that `ESELoss`, `StarbucksLoss` and `TwoDMSELoss` put on
    each (layer, dim) view.

    Args:
        model: the SentenceTransformer being trained.
        name: which loss. `angle` (AnglE, weighted per kind of data as angle-emb 0.6.1 weights it; the default of
            `matryoshka2d train` for triplets, NLI pairs and scored pairs), `cosent` (CoSENT, scale 20), `infonce`
            (in-batch negatives, scale 20; the only one that trains on pairs without negatives), `softmax` (SBERT's
            NLI classifier over (u, v, |u - v|)) or `simcse` (unsupervised SimCSE on a sentence given twice).
            Default: `angle`.
        kind: the shape of the data, `triplets`, `pairs`, `scored` or `nli`. Default: None, read from each batch
            (three text columns: triplets; two: pairs; two with a float score: scored; with an integer label: nli).
        **options: the chosen loss's own options, as `train --loss-option KEY=VALUE` takes them (e.g.
            `scale=20.0` for cosent and infonce, `temperature=0.05` for simcse, `num_labels=3` for softmax); an
            option the loss does not take is an error naming it and the options it does take.

    Inputs:
        | Texts | Labels |
        |---|---|
        | (anchor, positive, negative) triplets | none |
        | (anchor, positive) pairs | none |
        | (sentence1, sentence2) pairs | a float similarity score |
        | (premise, hypothesis) pairs | an integer NLI label (0 entailment, 1 neutral, 2 contradiction) |

    Example:
        ```python
        from datasets import Dataset
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from matryoshka2d.st_losses import TaskLoss

        model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
        triplets = Dataset.from_dict({
            "anchor": ["A man is playing a guitar."],
            "positive": ["Someone plays music."],
            "negative": ["A cat sleeps."],
        })
        loss = TaskLoss(model, "angle")
        SentenceTransformerTrainer(model=model, train_dataset=triplets, loss=loss).train()
        ```

    References:
        - AnglE: Li and Li, "AnglE-optimized Text Embeddings", arXiv 2309.12871; the authors' code, angle-emb
          (https://github.com/SeanLee97/AnglE), whose 0.6.1 `AngleLoss` weights our `angle` reproduces.
        - CoSENT: Su, "CoSENT" (https://kexue.fm/archives/8847), as sentence-transformers' CoSENTLoss.
        - SimCSE: Gao et al., "SimCSE: Simple Contrastive Learning of Sentence Embeddings", arXiv 2104.08821.
    """

    def __init__(self, model: nn.Module, name: str = "angle", kind: str | None = None, **options: Any) -> None:
        super().__init__()
        if name not in TASK_LOSSES:
            raise ValueError(f"TaskLoss: unknown loss '{name}'; choose one of {', '.join(TASK_LOSSES)}")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"TaskLoss: kind must be one of {', '.join(KINDS)}, got '{kind}'")
        _check_options(name, options)
        self.model, self.name, self.kind, self.options = model, name, kind, dict(options)
        self.objective = make_task_loss(name, **options)

    def batch(self, embeddings: list[Tensor], labels: Tensor | None) -> EmbeddedBatch:
        return EmbeddedBatch(list(embeddings), batch_kind(len(embeddings), labels, self.kind, "TaskLoss"), labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        return self.objective(self.batch(embeddings, labels))

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        columns = checked_batch(sentence_features, "TaskLoss")
        embeddings = [self.model(features)["sentence_embedding"] for features in columns]
        return self.compute_loss_from_embeddings(embeddings, labels)

    def get_config_dict(self) -> dict[str, Any]:
        return {"name": self.name, **({"kind": self.kind} if self.kind else {}), **self.options}


def _check_options(name: str, options: dict) -> None:
    """Each option is one the named loss takes (its constructor's parameters), so a typo names TaskLoss, the loss
    and the option, not the inner class."""
    parameters = inspect.signature(TASK_LOSSES[name]).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    if unknown := [key for key in options if key not in parameters]:
        takes = ", ".join(parameters) or "no options"
        raise TypeError(f"TaskLoss('{name}'): unknown option {', '.join(map(repr, unknown))}; {name} takes {takes}")


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
    """The wrapped loss is called once per view on embeddings the wrapper computed, so it must embed nothing itself
    and pick no widths or layers of its own."""
    if not isinstance(loss, nn.Module):
        raise TypeError(
            f"{owner}: loss must be a loss module, e.g. MultipleNegativesRankingLoss(model) or TaskLoss(model, "
            f"'angle'), got {type(loss).__name__} {loss!r:.60}"
        )
    if getattr(loss, "cache", None) is not None or type(loss).__name__.startswith("Cached"):
        raise ValueError(
            f"{owner} calls its loss once per view on embeddings it computed; {type(loss).__name__} embeds and "
            "back-propagates by itself (gradient caching), so it cannot be wrapped: use its uncached version"
        )
    if _picks_views(loss):
        inner = loss
        while _picks_views(inner) and isinstance(getattr(inner, "loss", None), nn.Module):
            inner = inner.loss  # Matryoshka2dLoss wraps a MatryoshkaLoss, which wraps the loss to name
        example = "MultipleNegativesRankingLoss" if _picks_views(inner) else type(inner).__name__
        raise ValueError(
            f"{owner} picks the layer and width of each view itself; {type(loss).__name__} picks widths or layers "
            f"too (it wraps a loss of its own and cuts the embeddings again), so the two do not nest: wrap the inner "
            f"loss instead, e.g. {owner}(model, {example}(model))"
        )


def _picks_views(loss: nn.Module) -> bool:
    """sentence-transformers' Matryoshka and layer losses, and ours: each cuts widths or picks layers itself."""
    return isinstance(loss, MatryoshkaLoss | AdaptiveLayerLoss) or isinstance(getattr(loss, "method", None), Method)


def labels_or_none(labels: Tensor | None) -> Tensor | None:
    return None if labels is None or (isinstance(labels, Tensor) and labels.numel() == 0) else labels
