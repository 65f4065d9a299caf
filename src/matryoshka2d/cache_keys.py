"""The one cache key (docs/reliability.md, rule 3): every cached artefact (a distillation run's teacher targets,
a retrieval evaluation's document cache, the ONNX graph cache) is named by `cache_key` over everything that changes
what it holds, so a cache made under other settings is never read back as this run's.

What changes a cached vector: the weights (`weights_sha256`), the tokenizer as it tokenizes (`tokenizer_sha256`: a
changed vocabulary gives other ids for the same text), how texts are cut (`max_length`), how token states are pooled
(`pooling`), which widths are kept (`widths`) and the texts themselves (`texts_sha256`, hashed with their lengths,
so no separator a text can hold makes two lists of texts one). A cache kind adds what else it depends on as
`extra` (a graph's layer and precision, the teacher's layers); `kind` keeps two kinds of cache apart.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence

KEY_VERSION = 1  # bumped when what goes into a key changes: every older cache is then a miss, never a wrong hit


def texts_sha256(texts: Iterable[str]) -> str:
    """sha256 of a list of texts in order: each text's UTF-8 length (8 bytes) then its bytes, and the count last.
    Unlike texts joined by a separator, no text can make two different lists hash alike."""
    digest = hashlib.sha256(b"matryoshka2d texts v1\n")
    count = 0
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(struct.pack(">Q", len(data)))
        digest.update(data)
        count += 1
    digest.update(struct.pack(">Q", count))
    return digest.hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """The checksum of a tokenizer as it tokenizes, loaded: a fast tokenizer's whole definition (vocabulary, added
    and special tokens, normalizer, pre-tokenizer, post-processor: its tokenizer.json) less the state of its last
    call (`truncation`, `padding`: the max length is keyed on its own, padding is masked), with its class, padding
    side and input names; a slow one's vocabulary and settings. Not the bytes of the folder's files: a saved
    `tokenizer.json` records the truncation of its last call, so every model saved again (heads fit, a distilled
    student) would get another checksum for the same tokenizer, and share no cache."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:
        skip = {"name_or_path", "model_max_length"}
        settings = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in skip}
        state = {"vocab": sorted(tokenizer.get_vocab().items()), "settings": settings}
    described = {
        "class": type(tokenizer).__name__,
        "padding_side": getattr(tokenizer, "padding_side", None),
        "inputs": list(getattr(tokenizer, "model_input_names", None) or []),
        "state": state,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(
    kind: str,
    *,
    weights_sha256: str | None,
    tokenizer_sha256: str | None,
    max_length: int | None,
    pooling: str | None,
    widths: Sequence[int] | None,
    texts_sha256: str | None,
    **extra,
) -> str:
    """The sha256 naming one cached artefact of `kind`, over every keyword (extra ones included). Every keyword
    of the signature is required, so a caller cannot leave one out by forgetting it: None says "does not apply"
    (a graph cache holds no texts), and is part of the key like any value."""
    parts = {
        "version": KEY_VERSION,
        "kind": kind,
        "weights_sha256": weights_sha256,
        "tokenizer_sha256": tokenizer_sha256,
        "max_length": max_length,
        "pooling": pooling,
        "widths": None if widths is None else [int(w) for w in widths],
        "texts_sha256": texts_sha256,
        "extra": extra,
    }
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


__all__ = ["KEY_VERSION", "cache_key", "texts_sha256", "tokenizer_sha256"]
