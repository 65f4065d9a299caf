"""Padding-free training steps: a step's texts run in length groups, not padded column by column.

A batch of triplets is three columns of texts (anchors, positives, negatives). Padding each column to its own
longest text, as sentence-transformers does, still computes about 2.5 token positions per real token on the
shared NLI triplets (docs/benchmarks.md). Here every text of every column is sorted by length and cut into groups
(matryoshka2d.models.batching.length_groups), each padded only to its own longest; the pooled vectors are put
back in batch order, so the columns, the in-batch negatives and every loss see exactly the batch they saw before.
Only the padding goes, and with it the work on padded positions. Attention masks keep padding out of every real
token's state and out of the pooling, so a padded and a padding-free step give the same loss up to float
rounding (tests/test_padding_free.py).

How many groups: each forward pass has a fixed cost that does not depend on its tokens (most of it in the
backward pass: a full-size gradient added to each weight and a dense gradient of the token-embedding table per
call). `TRAINING_CALL_OVERHEAD_TOKENS` states it in token positions, measured on the CPU (benchmarks/call_overhead.py);
on other devices it was not measured, so they keep the per-column padding unless the run asks
for padding-free steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from matryoshka2d.models.batching import length_groups

# The fixed cost of one forward and backward pass, in token positions of minilm-l6, fp32 on a CPU: 55 ms per
# call against 0.64 ms per token position (3 exits, one thread, CPU time); whole steps were cheapest, and
# equally so, for any value from 40 to 150 (benchmarks/call_overhead.py, docs/benchmarks.md).
TRAINING_CALL_OVERHEAD_TOKENS = {"cpu": 86.0}


def call_overhead(device: torch.device, padding_free: bool | None) -> float | None:
    """The per-call cost to group with, or None for per-column padding. padding_free None: on where the cost
    was measured (the CPU), off elsewhere; True on a device without a measurement uses the CPU's figure."""
    if padding_free is None:
        padding_free = device.type in TRAINING_CALL_OVERHEAD_TOKENS
    if not padding_free:
        return None
    return TRAINING_CALL_OVERHEAD_TOKENS.get(device.type, TRAINING_CALL_OVERHEAD_TOKENS["cpu"])


@dataclass
class ColumnBatch:
    """A step's columns, tokenized in groups: `groups[g]` holds the tensors of one forward pass; row k of the
    concatenated outputs of all groups is text `order[k]` of the flattened columns (column after column)."""

    groups: list[dict[str, torch.Tensor]]
    order: np.ndarray
    rows: list[int]  # texts per column

    def column_ids(self, column: int) -> list[list[int]]:
        """The token ids of one column's texts, in batch order and without padding (for checks and tests)."""
        ids: list[list[int] | None] = [None] * len(self.order)
        k = 0
        for group in self.groups:
            for row, mask in zip(group["input_ids"].tolist(), group["attention_mask"].tolist(), strict=True):
                ids[self.order[k]] = [t for t, m in zip(row, mask, strict=True) if m]
                k += 1
        start = sum(self.rows[:column])
        return ids[start : start + self.rows[column]]


def tokenize_columns(
    tokenizer,
    columns: Sequence[Sequence[str]],
    max_length: int,
    input_names: Sequence[str],
    overhead: float | None,
    pin: bool = False,
) -> ColumnBatch:
    """Tokenize every column; `overhead` None pads each column to its own longest text (one forward pass per
    column), a number groups all texts by length with that fixed cost per call (length_groups)."""
    texts = [t for column in columns for t in column]
    rows = [len(column) for column in columns]
    encoded = tokenizer(texts, truncation=True, max_length=max_length)
    if overhead is None:
        bounds = np.cumsum([0, *rows])
        groups = [np.arange(bounds[c], bounds[c + 1]) for c in range(len(rows)) if rows[c]]
    else:
        groups = length_groups([len(ids) for ids in encoded["input_ids"]], overhead)
    names = [k for k in input_names if k in encoded]
    tensors = []
    for group in groups:
        padded = tokenizer.pad([{k: encoded[k][i] for k in names} for i in group], return_tensors="pt")
        padded = {k: v for k, v in padded.items() if k in input_names}
        tensors.append({k: v.pin_memory() for k, v in padded.items()} if pin else padded)
    order = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    return ColumnBatch(tensors, order, rows)


def encode_columns(encoder, batch: ColumnBatch, layers: Sequence[int]) -> list[dict[int, torch.Tensor]]:
    """Pooled vectors per column and layer, {layer: (rows, hidden)} per column, in batch order: one forward pass
    per group, the rows put back where their texts were."""
    device = encoder.device
    outputs = [encoder({k: v.to(device, non_blocking=True) for k, v in f.items()}, layers) for f in batch.groups]
    inverse = None
    if not np.array_equal(batch.order, np.arange(len(batch.order))):
        inverse = torch.as_tensor(np.argsort(batch.order), device=device)
    per_layer = {}
    for n in layers:
        stacked = torch.cat([out[n] for out in outputs]) if len(outputs) > 1 else outputs[0][n]
        per_layer[n] = stacked.index_select(0, inverse) if inverse is not None else stacked
    split = {n: torch.split(v, batch.rows) for n, v in per_layer.items()}
    return [{n: split[n][c] for n in layers} for c in range(len(batch.rows))]
