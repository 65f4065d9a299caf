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

import functools
import inspect
import random
from collections.abc import Callable, Iterable
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
from matryoshka2d.st_losses.task_loss import (
    TaskLoss,
    batch_kind,
    check_wrapped,
    checked_batch,
    labels_or_none,
    view_loss,
)
from matryoshka2d.training import presets

# The arguments every method loss takes besides the method's options.
COMMON = ("self", "model", "loss", "preset", "seed", "exit_heads")


def records_given_arguments(init: Callable) -> Callable:
    """Wraps a method loss's `__init__` to note which arguments the caller gave (by keyword or by position), so a
    preset's option replaces an argument left at its default but never one given. `help()` and `inspect` show the
    wrapped signature (functools.wraps), and an unknown keyword is Python's own error naming the loss's __init__."""
    names = list(inspect.signature(init).parameters)

    @functools.wraps(init)
    def recording(self, *args, **kwargs):
        object.__setattr__(self, "_given_arguments", frozenset(names[1 : 1 + len(args)]) | frozenset(kwargs))
        return init(self, *args, **kwargs)

    return recording


def method_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The method's options among a loss's `__init__` arguments (its `locals()` on entry)."""
    return {key: value for key, value in arguments.items() if key not in COMMON and not key.startswith("__")}


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
    """Base of ESELoss, StarbucksLoss and TwoDMSELoss: one of our training methods (`matryoshka2d.methods`,
    `method_name`) over a wrapped loss, with the method's options as the subclass's keyword arguments."""

    method_name = ""

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None,
        options: dict[str, Any],
        preset: str | None = None,
        seed: int | None = None,
        exit_heads: ExitHeads | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_layout(unwrap(model), owner)
        self.model = model
        self.loss = loss if loss is not None else TaskLoss(model, "angle")
        check_wrapped(self.loss, owner)
        backbone = unwrap(model)
        num_layers, hidden = layer_count(backbone), backbone.get_embedding_dimension()
        options = self.fit_to_model(self._with_preset(options, preset), hidden)
        try:
            self.method: Method = make_method(self.method_name, num_layers, hidden, **options)
        except ValueError as exc:  # the method's message, said by the loss the user called
            raise ValueError(f"{owner}: {str(exc).removeprefix(self.method_name + ': ')}") from None
        self.preset = preset
        self.warnings = self.method.adapt_to_backbone(pooling_mode(backbone), normalizes(backbone))
        self._prepare_loss_parameters()
        self._view_loss = view_loss(self.loss, model)
        self.seed, self.steps = seed, 0
        self.exit_heads = check_heads(exit_heads, self.method, owner)

    def _with_preset(self, options: dict[str, Any], preset: str | None) -> dict[str, Any]:
        """The preset's method options where an argument was left at its default; the arguments given win."""
        given = getattr(self, "_given_arguments", None)
        given = set(options) if given is None else given
        try:
            from_preset = preset_method_options(preset, self.method_name)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        return {**options, **{key: value for key, value in from_preset.items() if key not in given}}

    def fit_to_model(self, options: dict[str, Any], hidden: int) -> dict[str, Any]:
        """Options whose default depends on the model, set from its embedding width (ESELoss's k)."""
        return options

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
        """The method's loss on one batch: every column through the transformer once, each view's loss and the
        method's own terms."""
        owner = type(self).__name__
        sentence_features = checked_batch(sentence_features, owner)
        labels = labels_or_none(labels)
        training = torch.is_grad_enabled() and unwrap(self.model).training
        plan = self.method.plan(self._generator(training))
        per_column = as_float(column_states(unwrap(self.model), sentence_features, plan.layers))
        if self.exit_heads is not None:  # each shallow view through its exit's head, as ElasticEncoder.forward does
            heads = self.exit_heads
            per_column = [{n: heads(n, x) if heads.has(n) else x for n, x in column.items()} for column in per_column]
        kind = batch_kind(len(per_column), labels, getattr(self.loss, "kind", None), owner)
        states = {layer: EmbeddedBatch([column[layer] for column in per_column], kind, labels) for layer in plan.layers}
        loss, _ = self.method.loss(plan, states, lambda view: self._view_loss(view, sentence_features, labels))
        return loss

    def get_config_dict(self) -> dict[str, Any]:
        """What sentence-transformers' model card records of the loss: the wrapped loss, the preset, the method's
        settings."""
        loss_name = type(self.loss).__name__
        if isinstance(self.loss, TaskLoss):
            loss_name = f"TaskLoss({self.loss.name})"
        return {"loss": loss_name, **({"preset": self.preset} if self.preset else {}), **self.method.config()}
