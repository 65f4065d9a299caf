"""A training method of ours (`matryoshka2d.methods`) as a sentence-transformers loss.

The method decides, step by step, which (layer, dim) views get the wrapped loss and with what weights, and adds
its own terms (ESE's compression, the KL towards the last layer or the full size): the same `Method` object our
trainer uses, so `ESELoss` in `SentenceTransformerTrainer` computes what `matryoshka2d train --method ese`
computes on the same batch. What stays the trainer's: the batches, the optimizer, the schedule, dropout.

Steps: a method that draws (2DMSE's layer and width) draws step s from `Method.generator(seed, s)`, s counting
the loss's training calls (a micro-batch of gradient accumulation is a call); the seed, when not given, is drawn
from Python's `random` at the first call, which the trainer's `seed` has set. Evaluation calls (no grad or the
model in eval mode) draw from a generator of their own and do not move the count.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from matryoshka2d.losses import EmbeddedBatch
from matryoshka2d.methods import Method, make_method
from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.exit_heads import check_heads
from matryoshka2d.st_losses.layer_states import (
    as_float,
    check_layout,
    column_states,
    layer_count,
    normalizes,
    pooling_mode,
    unwrap,
)
from matryoshka2d.st_losses.task_loss import TaskLoss, batch_kind, check_wrapped, labels_or_none, view_loss
from matryoshka2d.training import presets


def preset_method_options(preset: str | None, method: str) -> dict:
    """The method options of one of our presets (`matryoshka2d train --preset`), checked to be this method's.
    The preset's loss, weight decay and duplicate filter are the trainer's and the wrapped loss's to set."""
    if preset is None:
        return {}
    options = presets.load(preset)
    if options.get("method") != method:
        raise ValueError(
            f"preset '{preset}' trains method '{options.get('method')}', not '{method}'; presets of {method}: "
            + ", ".join(name for name in presets.available() if presets.load(name).get("method") == method)
        )
    return dict(options.get("method_options", {}))


class MethodLoss(nn.Module):
    """Base of ESELoss, StarbucksLoss and TwoDMSELoss: `method_name` and the method's options."""

    method_name = ""

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None,
        preset: str | None,
        seed: int | None,
        options: dict,
        exit_heads: ExitHeads | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_layout(unwrap(model), owner)
        self.model = model
        self.loss = loss if loss is not None else TaskLoss(model, "angle")
        check_wrapped(self.loss, owner)
        backbone = unwrap(model)
        hidden = backbone.get_embedding_dimension()
        options = {**preset_method_options(preset, self.method_name), **options}
        self.method: Method = make_method(self.method_name, layer_count(backbone), hidden, **options)
        self.preset = preset
        self.warnings = self.method.adapt_to_backbone(pooling_mode(backbone), normalizes(backbone))
        self._prepare_loss_parameters()
        self._view_loss = view_loss(self.loss, model)
        self.seed, self.steps = seed, 0
        self.exit_heads = check_heads(exit_heads, self.method, owner)

    def _prepare_loss_parameters(self) -> None:
        """Our softmax loss holds a classifier per width: made now, so the trainer's optimizer sees them."""
        head = getattr(getattr(self.loss, "objective", None), "head", None)
        if head is None:
            return
        like = next(unwrap(self.model).parameters())
        for width in self.method.widths():
            head(width, like)

    def _generator(self, training: bool):
        if not training:  # an evaluation loss: the same draws every time, the training count untouched
            return self.method.generator(0 if self.seed is None else self.seed, 0)
        if self.seed is None:
            self.seed = random.randrange(2**31)
        rng = self.method.generator(self.seed, self.steps)
        self.steps += 1
        return rng

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        sentence_features = list(sentence_features)
        labels = labels_or_none(labels)
        training = torch.is_grad_enabled() and unwrap(self.model).training
        plan = self.method.plan(self._generator(training))
        per_column = as_float(column_states(unwrap(self.model), sentence_features, plan.layers))
        if self.exit_heads is not None:  # each shallow view through its exit's head, as ElasticEncoder.forward does
            heads = self.exit_heads
            per_column = [{n: heads(n, x) if heads.has(n) else x for n, x in column.items()} for column in per_column]
        kind = batch_kind(len(per_column), labels, getattr(self.loss, "kind", None))
        states = {
            layer: EmbeddedBatch([column[layer] for column in per_column], kind, labels) for layer in plan.layers
        }
        loss, _ = self.method.loss(plan, states, lambda view: self._view_loss(view, sentence_features, labels))
        return loss

    def get_config_dict(self) -> dict[str, Any]:
        loss_name = type(self.loss).__name__
        if isinstance(self.loss, TaskLoss):
            loss_name = f"TaskLoss({self.loss.name})"
        return {"loss": loss_name, **({"preset": self.preset} if self.preset else {}), **self.method.config()}
