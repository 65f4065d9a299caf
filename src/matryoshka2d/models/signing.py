"""The key this machine signs its caches with (docs/reliability.md, rule 3): the teacher targets of a distillation run
and the documents' pooled states of `eval retrieval --doc-cache` are read back only when their signature
(cache_keys.signature: an HMAC over the cache key, the record and the content) holds under it.

A checksum guards against accidents only: whoever edits a cached row can compute the file's sha256 again and write
it into the record. The signature needs this secret, 32 random bytes kept in matryoshka2d's cache folder
($MATRYOSHKA2D_CACHE, else ~/.cache/matryoshka2d) readable by its owner alone, made on first use. A cache signed under
another key (another machine, another $MATRYOSHKA2D_CACHE, the key deleted) is not trusted: teacher targets are
refused (`--overwrite` computes them again; a run moved to another machine takes the key file with it), a document
cache file is a miss.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from matryoshka2d import cache_keys, outputs
from matryoshka2d.models.backbones import cache_dir

KEY_FILE = "cache-signing-key"
KEY_BYTES = 32  # HMAC-SHA256's own strength: a key of its 256-bit output


class SigningError(ValueError):
    """The signing key cannot be read or made; the message names its file and how to choose another place."""


def key_path() -> Path:
    """Where this machine's signing key is kept."""
    return cache_dir() / KEY_FILE


def _read_key(path: Path) -> bytes | None:
    try:
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | getattr(os, "O_NOFOLLOW", 0))) as f:
            data = f.read(KEY_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SigningError(
            f"{path}: the key matryoshka2d signs its caches with cannot be read ({exc.strerror or exc}); "
            "set MATRYOSHKA2D_CACHE to a folder of your own"
        ) from None
    return data if len(data) == KEY_BYTES else None


def signing_key() -> bytes:
    """This machine's signing key, made (through the one writer, readable by its owner only) on first use. A key
    file of another length (damaged) is replaced: what it signed is then refused or missed, never trusted."""
    path = key_path()
    key = _read_key(path)
    if key is not None:
        return key
    try:
        with outputs.writing(path, "MATRYOSHKA2D_CACHE") as tmp:
            os.chmod(tmp, 0o600)
            tmp.write_bytes(secrets.token_bytes(KEY_BYTES))
    except OSError as exc:
        raise SigningError(
            f"{path}: the key matryoshka2d signs its caches with cannot be written ({exc.strerror or exc}); "
            "set MATRYOSHKA2D_CACHE to a folder you can write"
        ) from None
    key = _read_key(path)  # what is there now: another process that made one at the same moment may have won
    if key is None:
        raise SigningError(f"{path}: the signing key just written cannot be read back; remove the file and retry")
    return key


def sign(key: str, content: Iterable[bytes]) -> str:
    """The signature of cache key `key` and `content` under this machine's key (cache_keys.signature)."""
    return cache_keys.signature(signing_key(), key, content)


def signature_holds(key: str, content: Iterable[bytes], recorded) -> bool:
    """Whether `recorded` is this machine's signature of `key` and `content` (compared in constant time)."""
    return cache_keys.signature_holds(signing_key(), key, content, recorded)
