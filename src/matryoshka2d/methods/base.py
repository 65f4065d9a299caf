"""What a method is: which views get the task loss at this step, with what weights, plus extra terms.

A method never touches tokenization, batching or the optimizer. The trainer asks `plan(rng)` for this step's
views, runs the backbone once up to the deepest layer the plan needs, and hands the pooled full-width states
per layer to `loss(plan, states, task_loss)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from matryoshka2d.losses.batch import EmbeddedBatch


@dataclass(frozen=True)
class View:
    """A cell that gets the task loss at this step, with its weight: pool the state after `layer` layers, keep the
    first `dim` numbers (matryoshka2d.cells.Cell, weighted)."""

    layer: int
    dim: int
    weight: float = 1.0

    def __str__(self) -> str:
        return f"({self.layer},{self.dim})" + ("" if self.weight == 1.0 else f"x{self.weight:.3g}")


States = dict[int, EmbeddedBatch]  # layer -> full-width pooled embeddings of every column of the batch
TaskLoss = Callable[[EmbeddedBatch], torch.Tensor]


def recorded_settings(owner, settings: str) -> dict:
    """`{"method": owner.name}` and each setting named in `settings` (space-separated attribute names;
    `key=attribute` records an attribute under another key), as the trained model's record holds them (JSON:
    tuples become lists)."""
    record = {"method": owner.name}
    for entry in settings.split():
        key, _, attribute = entry.partition("=")
        record[key] = _as_json(getattr(owner, attribute or key))
    return record


def _as_json(value):
    return [_as_json(v) for v in value] if isinstance(value, (list, tuple)) else value


def check_normalize(method: str, value) -> bool | str:
    """`kl_normalize` of the methods with a feature KL: compare L2-normalised vectors (true), the raw pooled ones
    (false), or do what the backbone's own pipeline does ("auto": normalised when it ends in a Normalize
    module, as sentence-transformers' losses see `sentence_embedding`, the output after every module)."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"{method}: kl_normalize must be true, false or auto, got {value!r}")
    return value


def kl_features(batch: EmbeddedBatch, width: int, normalize: bool | str) -> torch.Tensor:
    """The features KL's input: every text's vector (rows: all columns), unit length if `normalize` is True,
    cut to `width`."""
    x = torch.cat(batch.columns)
    return (F.normalize(x, dim=-1) if normalize is True else x)[:, :width]


@dataclass
class Plan:
    views: list[View]  # views that get the task loss
    extra_layers: set[int] = field(default_factory=set)  # layers needed only by alignment terms
    info: dict = field(default_factory=dict)  # what was sampled this step (for logs and the loss)

    @property
    def layers(self) -> list[int]:
        return sorted({v.layer for v in self.views} | self.extra_layers)


class Method(nn.Module):
    """Base class; subclasses set `name`, `summary` and implement `plan` (and `extra_loss` if any)."""

    name = "base"
    summary = ""
    settings = ""  # the attributes config() records: see recorded_settings

    def __init__(self, num_layers: int, hidden_size: int):
        super().__init__()
        self.num_layers, self.hidden_size = num_layers, hidden_size

    def plan(self, rng: np.random.Generator) -> Plan:
        raise NotImplementedError

    def generator(self, seed: int, step: int):
        """What `plan` draws step `step`'s layers and widths from: by default a generator of its own per step, so
        a resumed run draws what the uninterrupted one drew."""
        return np.random.default_rng([seed, step, 1])

    def loss(self, plan: Plan, states: States, task_loss: TaskLoss) -> tuple[torch.Tensor, dict[str, float]]:
        parts: dict[str, float] = {}
        total = None
        for view in plan.views:
            value = task_loss(states[view.layer].sliced(view.dim))
            parts[f"task{view}"] = value.detach()
            total = view.weight * value if total is None else total + view.weight * value
        extra, extra_parts = self.extra_loss(plan, states)
        parts.update(extra_parts)
        return (total + extra if extra is not None else total), parts

    def extra_loss(self, plan: Plan, states: States) -> tuple[torch.Tensor | None, dict[str, float]]:
        return None, {}

    def adapt_to_backbone(self, pooling: str, normalizes: bool) -> list[str]:
        """Called by the trainer with what the backbone's own pipeline does: its pooling, and whether it ends in
        a Normalize module. Options set to "auto" follow it here; returns warnings for the run to print."""
        return []

    def widths(self) -> set[int]:
        """Every width a view of this method can have (losses with per-width parameters create them upfront)."""
        return {v.dim for v in self.plan(np.random.default_rng(0)).views}

    def config(self) -> dict:
        """The method's settings, recorded with the trained model."""
        return recorded_settings(self, self.settings)
