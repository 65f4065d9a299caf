"""Batches of texts for the encoder: which texts share one forward pass, so that padding costs little and calls
stay few; padded tensors from pre-tokenized rows; and the encoder's passes over them (`run_passes`).

`inference_batches` gives the passes of `ElasticEncoder.encode` and the serving backends: length groups where the
call overhead was measured, else fixed runs longest first. `length_batches` cuts texts sorted longest first into
batches of at most `batch_size` texts and a token budget (the `encode` command's memory bound, export's checks).
`length_groups` cuts texts where a cut pays, in training steps and inference passes alike:

A forward pass over a padded batch costs about `size x longest` token positions, plus a fixed cost per call
that does not depend on the tokens (in a training step mostly the backward pass: every call adds a full-size
gradient to each weight, and a dense gradient of the token-embedding table). Texts sorted by length and cut into
contiguous runs pad each run only up to its own longest text; `length_groups` picks the cuts that minimise

    sum over groups of (overhead + size x longest)

with `overhead` the fixed cost of a call counted in padded token positions. One group per distinct length is the
padding-free extreme (no padding, many calls); one group is the fully padded one. The partition is exact (a
dynamic programme over the distinct lengths: a cut inside a run of equal lengths never helps, since moving those
texts into the group before it pads nothing and saves nothing), and deterministic, so a seeded run that draws
dropout masks per group draws the same masks when it is repeated or resumed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

# The fixed cost of one inference forward pass in token positions, fp32 on a CPU with one thread: about 5 ms
# at layer 3 and 9.5 ms at layer 6 for a call, against 0.11 and 0.2 ms per token position (minilm-l6, CPU
# time, 1-8 texts of 10-20 tokens: benchmarks/call_overhead.py). Other devices were not measured: fixed
# batches there.
TORCH_CALL_OVERHEAD_TOKENS = {"cpu": 48.0}


def length_groups(
    lengths: Sequence[int], overhead: float, max_size: int | None = None, max_tokens: int | None = None
) -> list[np.ndarray]:
    """Indices into `lengths`, grouped: each group a run of the ascending length order (stable, so equal
    lengths keep their order), the groups shortest first. `max_size` caps the texts per group, `max_tokens` the
    padded positions (texts x the group's longest; a single text longer than that is a group of its own)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return []
    if overhead < 0:
        raise ValueError(f"overhead must be at least 0, got {overhead}")
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order]
    # Ends (exclusive) of the runs of equal length in sorted order: the only places worth cutting.
    ends = np.flatnonzero(np.diff(ordered)) + 1
    ends = np.append(ends, len(ordered)).tolist()
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be at least 1, got {max_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if max_size is not None or max_tokens is not None:

        def piece(length: int) -> int:  # the most texts of this length one group may hold
            cap = max_size if max_size is not None else len(ordered)
            return cap if max_tokens is None else max(1, min(cap, max_tokens // max(1, length)))

        # A run of equal lengths longer than allowed is cut in pieces (nothing pads inside a run).
        ends = [
            e
            for start, stop in zip([0, *ends[:-1]], ends, strict=True)
            for e in [*range(start + piece(int(ordered[start])), stop, piece(int(ordered[start]))), stop]
        ]
    longest = [int(ordered[e - 1]) for e in ends]
    cost = [0.0] + [float("inf")] * len(ends)  # cost[j]: best cost of the first ends[j-1] texts
    cut = [0] * (len(ends) + 1)
    for j in range(1, len(ends) + 1):
        stop = ends[j - 1]
        for i in range(j - 1, -1, -1):
            start = ends[i - 1] if i else 0
            size = stop - start
            if max_size is not None and size > max_size:
                break
            if max_tokens is not None and i < j - 1 and size * longest[j - 1] > max_tokens:
                break
            total = cost[i] + overhead + size * longest[j - 1]
            if total < cost[j]:
                cost[j], cut[j] = total, i
    bounds, j = [], len(ends)
    while j > 0:
        i = cut[j]
        bounds.append((ends[i - 1] if i else 0, ends[j - 1]))
        j = i
    return [order[start:stop] for start, stop in reversed(bounds)]


def padded_positions(lengths: Sequence[int], groups: Sequence[np.ndarray]) -> int:
    """Token positions a forward pass over these groups computes (each group padded to its longest)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(sum(len(g) * lengths[g].max() for g in groups if len(g)))


def length_batches(lengths: Sequence[int], batch_size: int, token_budget: int | None = None) -> Iterator[np.ndarray]:
    """Indices of texts in batches, longest first, so that each batch pads to lengths close to its own: at most
    `batch_size` texts, and with `token_budget`, at most that many tokens (the batch's longest text x its size)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    start = 0
    while start < len(order):
        size = batch_size
        if token_budget is not None:
            size = max(1, min(batch_size, token_budget // max(1, int(lengths[order[start]]))))
        yield order[start : start + size]
        start += size


# What tokenizer.pad fills each input with; other inputs are padded by tokenizer.pad itself.
def _pad_values(tokenizer) -> dict[str, int]:
    return {"input_ids": tokenizer.pad_token_id, "token_type_ids": tokenizer.pad_token_type_id, "attention_mask": 0}


def pad_rows(tokenizer, encoded, idx, input_names) -> dict[str, torch.Tensor]:
    """Rows `idx` of an unpadded tokenizer output as padded int64 tensors, as tokenizer.pad makes them (same
    values, same padding side), without its per-row Python dictionaries: a tenth of its time on short batches."""
    names = [k for k in input_names if k in encoded]
    values = _pad_values(tokenizer)
    if any(k not in values for k in names) or values["input_ids"] is None:
        rows = [{k: encoded[k][i] for k in names} for i in idx]
        return dict(tokenizer.pad(rows, return_tensors="pt"))
    if len(idx) == 1:  # one text (a query): nothing to pad
        return {k: torch.tensor([encoded[k][idx[0]]], dtype=torch.int64) for k in names}
    rows = {k: [encoded[k][i] for i in idx] for k in names}
    longest = max(len(r) for r in rows["input_ids"])
    left = tokenizer.padding_side == "left"
    out = {}
    for k in names:
        array = np.full((len(idx), longest), values[k], dtype=np.int64)
        for r, row in enumerate(rows[k]):
            if left:
                array[r, longest - len(row) :] = row
            else:
                array[r, : len(row)] = row
        out[k] = torch.from_numpy(array)
    return out


def check_texts(texts) -> list[str]:
    if isinstance(texts, str) or (not isinstance(texts, Sequence) and not hasattr(texts, "__iter__")):
        raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] is {type(t).__name__}, not str: {t!r:.60}")
    return texts


def inference_batches(
    lengths: Sequence[int], batch_size: int, overhead: float | None, token_budget: int | None = None
) -> list[np.ndarray]:
    """The batches of an inference pass: length groups of at most `batch_size` texts (and, with `token_budget`,
    at most that many padded positions: what bounds a batch's activations) for a call overhead in token
    positions, or, with `overhead` None (a device where it was not measured), runs of the longest-first order.
    After one long text, a fixed run of 64 pads 63 texts to its length: on 256 random STS sentences (what the
    server collects from 32 clients) fixed runs compute 1.42 positions per token, length groups at an overhead
    of 48 about 1.07 (docs/benchmarks.md, issue 19)."""
    if len(lengths) == 1:  # one text, one pass (a query: keep its fixed cost small)
        return [np.zeros(1, dtype=np.int64)]
    if overhead is not None:
        return length_groups(lengths, overhead, max_size=batch_size, max_tokens=token_budget)
    return list(length_batches(lengths, batch_size, token_budget))


def run_passes(
    encoder,
    encoded,
    layers: list[int],
    out: dict[int, np.ndarray],
    batch_size: int,
    heads: bool | None = None,
    pooled: bool = False,
    token_budget: int | None = None,
    show_progress: bool = False,
    progress=None,
) -> None:
    """Fill `out` (layer -> one row per text) with `encoder.forward`'s vectors of the tokenized texts `encoded` (the
    tokenizer's unpadded output): texts of like length share a pass (inference_batches), each padded to its own
    longest, under inference_mode with the model in eval mode. `progress`, when given, is called with the number of
    texts of each pass once it is done."""
    lengths = [len(x) for x in encoded["input_ids"]]
    device = encoder.device  # a walk over the modules to the first parameter: once per call, not per batch
    overhead = TORCH_CALL_OVERHEAD_TOKENS.get(device.type)
    batches = inference_batches(lengths, batch_size, overhead, token_budget)  # like lengths share a pass
    # Module.train() walks every submodule (about 1 ms for a 6-layer model, most of a one-query call):
    # switch to eval and back only when the model is training.
    was_training = encoder.model.training
    if was_training:
        encoder.model.eval()
    if show_progress:  # a progress bar costs a tenth of a millisecond even when disabled
        batches = tqdm(batches, desc=f"encode {encoder.name}", unit="batch")
    try:
        with torch.inference_mode():
            for idx in batches:
                features = pad_rows(encoder.tokenizer, encoded, idx, encoder._input_names)
                features = {k: v.to(device) for k, v in features.items()}
                for n, vec in encoder.forward(features, layers, heads=heads, pooled=pooled).items():
                    out[n][idx] = vec.float().cpu().numpy()
                if progress is not None:
                    progress(len(idx))
    finally:
        if was_training:
            encoder.model.train()
