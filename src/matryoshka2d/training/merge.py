"""Weight-space averages of models fine-tuned from one start: WiSE-FT and model soups.

WiSE-FT (Wortsman et al., 2022, "Robust fine-tuning of zero-shot models") keeps
alpha x fine-tuned + (1 - alpha) x start, every weight alike; a model soup (Wortsman et al., 2022, "Model soups")
averages several fine-tuned runs of one start. Neither costs a training step or looks at data.

Why it belongs to a 2D toolkit: a short run of a 2D recipe lifts the last layer and the mid-depth cells, but its
smallest shallow cells can end below where the run started (exit heads fitted in closed form on the untouched
model, then 150 protocol steps: (1,64) from 69.06 to 68.49), and halfway back keeps most of what training gained
everywhere else (docs/exit-heads.md). Exit heads and a pooler head are averaged with the backbone, so every model
must have the same heads (kind, layers, inputs); the averaged model gets its heads' backbone checksum anew when
it is saved.

A static cell (layer 0, models.static) lives in the space of the transformer it was aligned to. Static students of
one model (`distill --mode static`) share that transformer untouched: their cells are averaged like every weight
and the merge keeps layer 0. Models whose transformers differ average into a new transformer, whose space no cell
was aligned to: the save drops the cells, and `static_cells` says so for the command to print. A merge that could
keep only some models' layer 0 (one transformer, but not every model has a cell) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.identity import backbone_sha256, short


class MergeError(ValueError):
    """Models that cannot be averaged, or weights that do not make an average."""


def merge_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """The weights of `count` models: equal when not given; given ones must be finite, >= 0 and sum to 1."""
    if count < 2:
        raise MergeError(f"merging needs at least two models, got {count}")
    if weights is None:
        return [1.0 / count] * count
    weights = [float(w) for w in weights]
    if len(weights) != count:
        raise MergeError(f"{len(weights)} weights for {count} models: give one weight per model, in their order")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise MergeError(f"weights must be finite and >= 0, got {weights}")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise MergeError(f"weights must sum to 1 (an average), got {weights} (sum {sum(weights):g})")
    return weights


def check_different_folders(models: Sequence[str]) -> None:
    """--models naming one folder twice (as written, through a link, or by another path to it) averages a model with
    itself, which is that model: refused before anything loads."""
    import os

    folders = [Path(m).expanduser() for m in models]
    for i, first in enumerate(folders):
        for second in folders[i + 1 :]:
            if first.exists() and second.exists() and os.path.samefile(first, second):
                raise MergeError(
                    f"--models names one folder twice ({first} and {second}): the average of a model with itself is "
                    "that model; give two or more different models"
                )


def _modules(encoder: ElasticEncoder) -> dict[str, torch.nn.Module]:
    """What is averaged: the transformer, the pooler head and the exit heads, where the model has them."""
    parts = {"transformer": encoder.model, "pooler head": encoder.head, "exit heads": encoder.exit_heads}
    return {name: module for name, module in parts.items() if module is not None}


def _heads_layout(encoder: ElasticEncoder) -> tuple | None:
    heads = encoder.exit_heads
    if heads is None:
        return None
    return heads.kind, tuple(heads.layers), heads.dim_in, heads.dim_out, heads.hidden, heads.inputs


def _label(encoder: ElasticEncoder) -> str:
    return str(encoder.location or encoder.name)


def start_of(encoder: ElasticEncoder) -> str:
    """The model a folder's run started from (its record's training.model), else the model itself: the start that
    WiSE-FT pairs a run with, and that the runs of a soup share. Paths are compared resolved."""
    import json

    start = None
    if encoder.location:
        # The confined reader: a record that is (or lies behind) a link out of the folder is refused, not read.
        meta_path = ConfinedFolder(encoder.location, "model").path("matryoshka2d.json")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
            start = (meta.get("training") or {}).get("model") if isinstance(meta, dict) else None
            if isinstance(meta, dict) and ("heads_fit" in meta or "merge" in meta):
                start = None  # heads fitted or weights averaged after the run: the folder is a start of its own
        except (OSError, ValueError, AttributeError):
            start = None
    start = str(start or encoder.location or encoder.name)
    return str(Path(start).resolve()) if Path(start).exists() else start


def check_finite(encoders: Sequence[ElasticEncoder]) -> None:
    """An average with a NaN or inf weight is NaN there: refused, naming the model and the tensor."""
    for encoder in encoders:
        for part, module in _modules(encoder).items():
            for key, tensor in module.state_dict().items():
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise MergeError(f"{_label(encoder)}: {part} tensor {key} holds NaN or inf; it cannot be averaged")


def check_mergeable(encoders: Sequence[ElasticEncoder], allow_different_starts: bool = False) -> None:
    """Raise MergeError naming the model and the part that differs from the first model's."""
    base = encoders[0]
    base_parts = _modules(base)
    check_finite(encoders)
    for other in encoders[1:]:
        a, b = _label(base), _label(other)
        other_parts = _modules(other)
        if set(other_parts) != set(base_parts):
            raise MergeError(
                f"{b} has {', '.join(sorted(other_parts))} but {a} has {', '.join(sorted(base_parts))}: "
                "only models with the same parts can be averaged (fit or drop exit heads on both first)"
            )
        if _heads_layout(other) != _heads_layout(base):
            raise MergeError(
                f"{b} has exit heads {other.exit_heads.describe()} but {a} has {base.exit_heads.describe()}: "
                "only heads of the same kind, layers and inputs can be averaged"
            )
        if other.tokenizer.get_vocab() != base.tokenizer.get_vocab():
            raise MergeError(f"{b} and {a} have different tokenizer vocabularies: they are not runs of one start")
        if other.pooling != base.pooling:
            raise MergeError(f"{b} pools with {other.pooling} but {a} with {base.pooling}")
        for part, module in base_parts.items():
            mine, theirs = module.state_dict(), other_parts[part].state_dict()
            if missing := sorted(set(mine) ^ set(theirs)):
                raise MergeError(f"{b} and {a} differ in {part} tensors ({', '.join(missing[:3])}, ...)")
            for key, tensor in mine.items():
                if theirs[key].shape != tensor.shape:
                    raise MergeError(
                        f"{part} tensor {key} has shape {tuple(theirs[key].shape)} in {b} but "
                        f"{tuple(tensor.shape)} in {a}: not the same architecture"
                    )
                if not tensor.is_floating_point() and not torch.equal(theirs[key], tensor):
                    raise MergeError(f"{part} tensor {key} (not a weight: {tensor.dtype}) differs between {b} and {a}")
    check_same_start(encoders, allow_different_starts)
    check_query_encoders(encoders)
    static_cells(encoders)


def check_query_encoders(encoders: Sequence[ElasticEncoder]) -> None:
    """Query encoders (`distill --mode query|static`) average into a query encoder of their teacher only when every
    model is one, of one teacher (its weights checksum), mode and layer; the merged folder's record is then stated
    for its own weights (the command does, after the save)."""
    from matryoshka2d.models.query_record import query_encoder_record

    records = [query_encoder_record(e) for e in encoders]
    if all(record is None for record in records):
        return

    def what(record: dict | None) -> tuple:
        return (record or {}).get("teacher_weights_sha256"), (record or {}).get("mode"), (record or {}).get("layer")

    if None in records or len({what(r) for r in records}) > 1:
        named = "; ".join(
            f"{_label(e)}: --mode {r['mode']} of teacher {short(r.get('teacher_weights_sha256'))}"
            if r
            else f"{_label(e)}: no query encoder"
            for e, r in zip(encoders, records, strict=True)
        )
        raise MergeError(
            f"query encoders average into one only when all are query encoders of one teacher, mode and layer ({named})"
        )


STATIC_KEPT = "averaged"  # static_cells: every model's layer 0 is averaged and kept


def static_cells(encoders: Sequence[ElasticEncoder]) -> str | None:
    """What the merge does with the models' static cells (layer 0): None when no model has one; STATIC_KEPT when all
    have one, of one table's shape, aligned to the one transformer every model shares (the average keeps it);
    otherwise (the transformers differ) a line saying which cells the save drops and why. MergeError for models
    of one transformer of which only some have a cell, or whose cells cannot be averaged."""
    cells = [e.static_cell for e in encoders]
    if all(cell is None for cell in cells):
        return None
    backbones = [backbone_sha256(e) for e in encoders]
    with_cells = ", ".join(_label(e) for e, cell in zip(encoders, cells, strict=True) if cell is not None)
    if len(set(backbones)) > 1:
        return (
            f"the static cell (layer 0) of {with_cells} is not kept: a static cell lives in the space of the "
            "transformer it was aligned to, and the average is another transformer; distill one for it with "
            "`matryoshka2d distill --mode static --teacher OUTPUT`"
        )
    base, first = encoders[0], cells[0]
    for encoder, cell in zip(encoders, cells, strict=True):
        if (cell is None) != (first is None):
            without = _label(encoder if cell is None else base)
            raise MergeError(
                f"{with_cells} {'has' if with_cells.count(',') == 0 else 'have'} a static cell (layer 0) and {without} "
                "has none: the average could keep only some models' layer 0, which is no average of it; merge the "
                "models with a cell alone (static students of one model), or none of them"
            )
        if cell is None:
            continue
        if (cell.vocabulary, cell.dim_in, cell.dim_out) != (first.vocabulary, first.dim_in, first.dim_out) or (
            cell.embedding.tokenizer.get_vocab() != first.embedding.tokenizer.get_vocab()
        ):
            raise MergeError(
                f"the static cells of {_label(encoder)} ({cell.describe()}) and {_label(base)} ({first.describe()}) "
                "are not of one table: only cells distilled from one model can be averaged"
            )
        if cell.aligned_to != backbones[0]:
            raise MergeError(f"the static cell of {_label(encoder)} was aligned to another transformer than its own")
    return STATIC_KEPT


def check_same_start(encoders: Sequence[ElasticEncoder], allow_different_starts: bool = False) -> None:
    """WiSE-FT averages a run with the model it started from, a soup runs of one start: models whose records name
    other starts (or unrelated models of one shape) are refused unless allowed. Models built in memory (no
    folder) have no record to compare and are not checked."""
    saved = [e for e in encoders if e.location]
    if allow_different_starts or len(saved) < 2:
        return
    starts = [start_of(e) for e in saved]
    if len(set(starts)) > 1:  # a start itself counts as its own start, so (run, its start) passes
        named = "; ".join(f"{_label(e)} from {s}" for e, s in zip(saved, starts, strict=True))
        raise MergeError(
            f"the models are not runs of one start ({named}): their average is no WiSE-FT or soup of anything; "
            "pass --allow-different-starts to average them anyway"
        )


def merge_encoders(
    encoders: Sequence[ElasticEncoder], weights: Sequence[float] | None = None, allow_different_starts: bool = False
) -> ElasticEncoder:
    """The weighted average of `encoders`, written into the first one (returned); the others are not changed.

    Floating-point tensors are averaged in float32 and stored in their own dtype; integer buffers (position
    ids) must be equal. The first model gives everything that is not a weight: tokenizer, pooling, config.
    """
    weights = merge_weights(weights, len(encoders))
    check_mergeable(encoders, allow_different_starts)
    base = encoders[0]
    cells = static_cells(encoders)
    with torch.no_grad():
        for part, module in _modules(base).items():
            _average_into(module, [_modules(e)[part].state_dict() for e in encoders], weights)
        if cells == STATIC_KEPT:  # layer 0 of one transformer's static students
            _average_into(base.static_cell, [e.static_cell.state_dict() for e in encoders], weights)
    return base


def _average_into(module: torch.nn.Module, states: list[dict], weights: Sequence[float]) -> None:
    """The weighted average of `states` loaded into `module`: float tensors averaged in float32 and stored in their
    own dtype, except where every model holds the same tensor, which is kept as it is (0.3 x + 0.7 x is not always
    x in floating point, and a transformer that every model shares must stay the one its static cells were aligned
    to); other tensors are the first's."""
    averaged = {}
    for key, tensor in states[0].items():
        if not tensor.is_floating_point() or all(torch.equal(state[key], tensor) for state in states[1:]):
            averaged[key] = tensor.clone()
        else:
            total = sum(w * state[key].to(torch.float32) for w, state in zip(weights, states, strict=True))
            averaged[key] = total.to(tensor.dtype)
    module.load_state_dict(averaged)


__all__ = ["MergeError", "check_mergeable", "merge_encoders", "merge_weights"]
