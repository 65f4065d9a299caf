"""The one cache key (docs/reliability.md, rule 3): every cached artefact (a distillation run's teacher targets,
a retrieval evaluation's document cache, the ONNX graph cache) is named by `cache_key` over everything that changes
what it holds, so a cache made under other settings is never read back as this run's.

What changes a cached vector: the weights (`weights_sha256`), how the model computes with them (`config_sha256`:
its whole configuration, `layer_norm_eps` as much as the number of layers, the inputs it is fed and its pooler's
activation), the tokenizer as it tokenizes (`tokenizer_sha256`: a changed vocabulary gives other ids for the same
text, a changed truncation side other tokens for a long one), how texts are cut (`max_length`), how token states are
pooled (`pooling`), which widths are kept (`widths`) and the texts themselves (`texts_sha256`, hashed with their
lengths, so no separator a text can hold makes two lists of texts one). A cache kind adds what else it depends on as
`extra` (a graph's layer and precision, the teacher's layers); `kind` keeps two kinds of cache apart.

Configuration and tokenizer are keyed whole, less the few fields that name rather than compute (`CONFIG_NAMES`,
`TOKENIZER_NAMES`: where the files were, which library wrote them), so a field added later is in the key without
anybody listing it.

A key says which artefact a run may read; `signature` says that the artefact is the one this machine wrote under
that key: an HMAC over the key and the content, under a secret a user's hand edit cannot recompute (a plain
checksum can be, so it only guards against accidents).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Iterable, Mapping, Sequence

KEY_VERSION = 2  # bumped when what goes into a key changes: every older cache is then a miss, never a wrong hit

# Configuration fields that do not change what the model computes: where it was loaded from, which library version
# wrote it, the KV cache an encoder never reuses (turned off when a decoder is prepared, so a saved model records
# False), and matryoshka2d's own record of trained widths. A model saved again (heads fit, a student) changes them
# and must still share its backbone's caches; tests/test_cache_keys.py shows each leaves the vectors as they are.
CONFIG_NAMES = frozenset(
    {"_name_or_path", "transformers_version", "use_cache", "matryoshka_dimensions", "is_matryoshka"}
)

# Tokenizer settings that do not change its tokens: where its files were (any `*_file`), how it was loaded and how
# verbose it is; `model_max_length` is keyed as the max length a run applies (`max_length`).
TOKENIZER_NAMES = frozenset(
    {"name_or_path", "model_max_length", "is_local", "local_files_only", "verbose", "deprecation_warnings"}
)


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


def _described(obj) -> str:
    """A value of a configuration or tokenizer setting as text that is the same on every load (an AddedToken's
    repr holds each of its flags; its str only the token)."""
    return repr(obj)


def tokenizer_settings(tokenizer) -> dict:
    """Every setting a tokenizer was made with or holds now, less TOKENIZER_NAMES and file locations: the
    settings its files gave (`init_kwargs`) updated with the plain values it holds (`truncation_side` set after
    loading counts as much as one in tokenizer_config.json)."""
    held = {
        name: value
        for name, value in vars(tokenizer).items()
        if not name.startswith("_") and (value is None or isinstance(value, (str, int, float, bool)))
    }
    settings = {**(getattr(tokenizer, "init_kwargs", None) or {}), **held}
    return {k: v for k, v in settings.items() if k not in TOKENIZER_NAMES and not k.endswith("_file")}


def tokenizer_sha256(tokenizer) -> str:
    """The checksum of a tokenizer as it tokenizes, loaded: a fast tokenizer's whole definition (vocabulary, added
    and special tokens, normalizer, pre-tokenizer, post-processor: its tokenizer.json) less the state of its last
    call (`truncation`, `padding`: the max length is keyed on its own, padding is masked), a slow one's vocabulary,
    and for both its class, input names and every setting (`tokenizer_settings`: truncation and padding side,
    lower-casing, ...). Not the bytes of the folder's files: a saved `tokenizer.json` records the truncation of its
    last call, so every model saved again (heads fit, a distilled student) would get another checksum for the same
    tokenizer, and share no cache."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:
        state = {"vocab": sorted(tokenizer.get_vocab().items())}
    described = {
        "class": type(tokenizer).__name__,
        "inputs": list(getattr(tokenizer, "model_input_names", None) or []),
        "settings": tokenizer_settings(tokenizer),
        "state": state,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=_described).encode()).hexdigest()


def config_sha256(config: Mapping, inputs: Sequence[str] = (), pooler: str | None = None) -> str:
    """The checksum of how a model computes with its weights: every field of its configuration (`config.to_dict()`)
    less CONFIG_NAMES, the inputs it is fed (`inputs`: a model without token type ids is fed none) and its pooler
    head's activation (`pooler`; None without a head)."""
    described = {
        "config": {k: v for k, v in config.items() if k not in CONFIG_NAMES},
        "inputs": list(inputs),
        "pooler": pooler,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=_described).encode()).hexdigest()


def encoder_config_sha256(encoder) -> str:
    """config_sha256 of an encoder (models.encoder.ElasticEncoder) as loaded."""
    head = getattr(encoder, "head", None)
    return config_sha256(
        encoder.model.config.to_dict(), list(encoder._input_names), getattr(head, "activation_name", None)
    )


def cache_key(
    kind: str,
    *,
    weights_sha256: str | None,
    config_sha256: str | None,
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
        "config_sha256": config_sha256,
        "tokenizer_sha256": tokenizer_sha256,
        "max_length": max_length,
        "pooling": pooling,
        "widths": None if widths is None else [int(w) for w in widths],
        "texts_sha256": texts_sha256,
        "extra": extra,
    }
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def signature(secret: bytes, key: str, content: Iterable[bytes]) -> str:
    """HMAC-SHA256 under `secret` of a cache key and the bytes cached under it (`content`, in order; a caller
    frames parts whose boundaries matter). Anyone can recompute a checksum after editing a file; without the secret
    nobody can recompute this, so a cache whose signature holds is what this machine wrote under this key."""
    mac = hmac.new(secret, b"matryoshka2d cache signature v1\n", hashlib.sha256)
    mac.update(struct.pack(">Q", len(key)) + key.encode("utf-8"))
    for part in content:
        mac.update(part)
    return mac.hexdigest()


def signature_holds(secret: bytes, key: str, content: Iterable[bytes], recorded) -> bool:
    """Whether `recorded` is the signature of `key` and `content` (compared in constant time)."""
    return isinstance(recorded, str) and hmac.compare_digest(signature(secret, key, content), recorded)


__all__ = [
    "CONFIG_NAMES",
    "KEY_VERSION",
    "TOKENIZER_NAMES",
    "cache_key",
    "config_sha256",
    "encoder_config_sha256",
    "signature",
    "signature_holds",
    "texts_sha256",
    "tokenizer_settings",
    "tokenizer_sha256",
]
