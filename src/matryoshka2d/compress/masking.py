"""SMAE's masking (Starbucks sec. 3.2, eq. 6), apart from its objective (matryoshka2d.compress.smae): a batch of
sentences tokenized once and masked twice, by whole words, with BERT's 80/10/10 replacement: alpha_e of the
words for the encoder input, alpha_d for the decoder input, the encoder's masked words a subset of the
decoder's (as the authors' MaeDataCollatorForWholeWordMask). Budgets are round(ratio x real tokens), at least
one, where real tokens exclude [CLS]/[SEP]/padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100  # label of positions that are not predicted (torch's cross_entropy ignore_index)


@dataclass
class MaskedBatch:
    encoder_ids: torch.Tensor  # (B, T) encoder input with alpha_e of the words masked
    encoder_labels: torch.Tensor  # (B, T) original ids at encoder-masked positions, IGNORE elsewhere
    decoder_ids: torch.Tensor
    decoder_labels: torch.Tensor
    attention_mask: torch.Tensor
    extra: dict  # other model inputs (token_type_ids)

    def to(self, device) -> MaskedBatch:
        move = {k: v.to(device) for k, v in self.extra.items()}
        return MaskedBatch(
            self.encoder_ids.to(device),
            self.encoder_labels.to(device),
            self.decoder_ids.to(device),
            self.decoder_labels.to(device),
            self.attention_mask.to(device),
            move,
        )


def word_groups(word_ids: list[int | None], special: list[int]) -> list[list[int]]:
    """Token positions grouped by the word they belong to; special tokens and padding belong to none."""
    groups: dict[int, list[int]] = {}
    for position, (word, is_special) in enumerate(zip(word_ids, special, strict=True)):
        if is_special or word is None:
            continue
        groups.setdefault(word, []).append(position)
    return list(groups.values())


def choose_masked(
    groups: list[list[int]], encoder_ratio: float, decoder_ratio: float, rng: np.random.Generator
) -> tuple[list[int], list[int]]:
    """Whole-word masks: (encoder positions, decoder positions), encoder's a subset of decoder's (as the
    authors' MaeDataCollatorForWholeWordMask). Budgets: round(ratio x tokens), at least 1 token."""
    tokens = sum(len(g) for g in groups)
    if tokens == 0:
        return [], []
    budget_e = max(1, round(tokens * encoder_ratio))
    budget_d = max(1, round(tokens * decoder_ratio))
    encoder, decoder = [], []
    for index in rng.permutation(len(groups)):
        group = groups[index]
        if len(decoder) + len(group) <= budget_d:
            decoder.extend(group)
            if len(encoder) + len(group) <= budget_e:
                encoder.extend(group)
        if len(decoder) >= budget_d:
            break
    return sorted(encoder), sorted(decoder)


def corrupt(ids: torch.Tensor, positions: list[list[int]], mask_id: int, vocab_size: int, rng: np.random.Generator):
    """BERT's replacement at the chosen positions: 80 % [MASK], 10 % a random token, 10 % unchanged."""
    inputs, labels = ids.clone(), torch.full_like(ids, IGNORE)
    for row, chosen in enumerate(positions):
        for position in chosen:
            labels[row, position] = ids[row, position]
            draw = rng.random()
            if draw < 0.8:
                inputs[row, position] = mask_id
            elif draw < 0.9:
                inputs[row, position] = int(rng.integers(vocab_size))
    return inputs, labels


def mask_batch(
    tokenizer,
    texts: list[str],
    max_length: int,
    encoder_ratio: float,
    decoder_ratio: float,
    rng: np.random.Generator,
    input_names: list[str] | None = None,
) -> MaskedBatch:
    """Tokenize a batch and mask it twice (eq. 6): alpha_e of the words for the encoder, alpha_d for the decoder."""
    encoded = tokenizer(
        list(texts),
        padding=True,
        truncation=True,
        max_length=max_length,
        return_special_tokens_mask=True,
        return_tensors="pt",
    )
    ids, special = encoded["input_ids"], encoded["special_tokens_mask"].tolist()
    pad = encoded["attention_mask"].eq(0).tolist()
    encoder_rows, decoder_rows = [], []
    for row in range(len(texts)):
        if getattr(encoded, "is_fast", False) or getattr(tokenizer, "is_fast", False):
            words = encoded.word_ids(row)
        else:  # slow tokenizers have no word ids: every token is its own word
            words = list(range(ids.shape[1]))
        flags = [int(s or p) for s, p in zip(special[row], pad[row], strict=True)]
        enc, dec = choose_masked(word_groups(words, flags), encoder_ratio, decoder_ratio, rng)
        encoder_rows.append(enc)
        decoder_rows.append(dec)
    vocab = len(tokenizer)
    encoder_ids, encoder_labels = corrupt(ids, encoder_rows, tokenizer.mask_token_id, vocab, rng)
    decoder_ids, decoder_labels = corrupt(ids, decoder_rows, tokenizer.mask_token_id, vocab, rng)
    names = input_names or list(encoded.keys())
    extra = {k: encoded[k] for k in names if k not in ("input_ids", "attention_mask") and k in encoded}
    extra.pop("special_tokens_mask", None)
    return MaskedBatch(encoder_ids, encoder_labels, decoder_ids, decoder_labels, encoded["attention_mask"], extra)
