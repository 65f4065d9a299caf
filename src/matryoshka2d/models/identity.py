"""What identifies a model: one checksum of its weights, computed the same way wherever two artefacts meet (an index
and the model its queries are encoded with, result files and the model `pick` times); the record a model folder
keeps of itself (matryoshka2d.json); and what the vectors of an index's cells depend on.

The checksum covers every tensor of the module's state_dict (names and values, as float32 on the CPU, in name
order), so it does not depend on the device or on the dtype the weights were loaded in, and it changes with any
weight, the pooler head included. Index manifests have recorded it as `weights_sha256` since the first index
format; this is the same computation, moved here so that every caller agrees.

A query encoder's record is checked in models.query_record, a query/document pair's in models.pair_check.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.files import read_json


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 of the module's named tensors (float32 bytes, sorted by name)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def backbone_sha256(encoder) -> str:
    """sha256 of the backbone's weights (the transformer and any pooler head, not the exit heads), in a form that
    is the same for a model in memory and for the folder it was saved to."""
    digest = hashlib.sha256()
    modules = {"model": encoder.model}
    if encoder.head is not None:
        modules["pooler"] = encoder.head
    with torch.no_grad():
        for prefix, module in modules.items():
            for name, tensor in sorted(module.state_dict().items()):
                digest.update(f"{prefix}.{name}".encode())
                digest.update(tensor.detach().to(torch.float32).cpu().numpy().tobytes())
    return digest.hexdigest()


def short(checksum) -> str:
    """The first 12 hex digits, enough to tell two models apart in a message; what a record holds in a checksum's
    place that is no checksum (a number, a list: a hand edit) is said to be one, never sliced."""
    if not checksum:
        return "not recorded"
    if not isinstance(checksum, str):
        return f"{str(checksum)[:20]!r}, which is not a checksum"
    return checksum[:12]


class IdentityError(ValueError):
    """A model and the vectors it is asked to meet were made by different models; the message says what differs."""


# ---- the record of a model folder: matryoshka2d.json, beside sentence-transformers' files --------------------

PAIR_KEY = "pair"  # matryoshka2d.json of a query/document pair folder: what each route holds (export.pair)
RECORD_FILE = "matryoshka2d.json"


def confined_folder(folder) -> ConfinedFolder:
    """The one reader of a model folder (confined.ConfinedFolder): one given is used as it is (its links were checked
    when it was made); a path is checked now, before anything in it is opened."""
    return folder if isinstance(folder, ConfinedFolder) else ConfinedFolder(folder, "model")


def read_meta(folder, error: type[Exception]) -> tuple[Path, dict | None]:
    """(the folder's matryoshka2d.json, what it holds, or None when there is no such file), read through the
    folder's confined reader: a matryoshka2d.json that is a link out of the folder is refused, not read."""
    confined = confined_folder(folder)
    meta = confined.path(RECORD_FILE, confined.folder, "the record of matryoshka2d")  # OutsideFolderError
    if not meta.is_file():
        return meta, None
    return meta, read_json(meta, error)  # names the file, line and field of what is not JSON or not text


def folder_record(folder, key: str, error: type[Exception]) -> dict | None:
    """The `key` record of a model folder's matryoshka2d.json (exit heads, a static cell), or None when the folder
    has no such file or record; a file that is not JSON is an `error` naming it."""
    if not folder:
        return None
    meta, content = read_meta(folder, error)
    if content is None:
        return None
    if not isinstance(content, dict):
        raise error(f"{meta}: not a valid matryoshka2d.json (a JSON object is expected)")
    return content.get(key) or None


# ---- what an index's vectors depend on (issue 32, case 13) -----------------------------------------------------
#
# A whole-model checksum says two models are the same; it does not say they give the same vectors at a cell. The
# vectors at layer l are the pooled layer l of the backbone (the transformer and any pooler head), mapped by the
# exit head of layer l if the model has one there: a model with exit heads fitted on minilm-l6 gives minilm-l6's
# own vectors at the last layer (no head there). An index records the backbone checksum and the checksum of the
# head of each layer it holds (None: no head); a query model that matches both at those layers may query it, with
# its own heads at any other layer (--query-layer).


def head_sha256(encoder, layer: int) -> str | None:
    """sha256 of the exit head that maps layer `layer`'s pooled vectors (what it reads and its tensors, as float32),
    or None when the model has no head there."""
    heads = getattr(encoder, "exit_heads", None)
    if heads is None or not heads.has(layer):
        return None
    digest = hashlib.sha256(f"{heads.kind}|reads {heads.reads(layer)}".encode())
    with torch.no_grad():
        for name, tensor in sorted(heads.heads[str(layer)].state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def vectors_identity(encoder, layers) -> dict:
    """What the vectors of `layers` depend on: the backbone's weights and the exit head of each layer."""
    return {
        "backbone_sha256": backbone_sha256(encoder),
        "exit_heads_sha256": {str(n): head_sha256(encoder, n) for n in sorted({int(n) for n in layers})},
    }


def vectors_difference(model: dict, vectors: dict | None, encoder, layers) -> str | None:
    """None when `encoder` gives the vectors at `layers` that the recorded model gave (`model`: its identity with
    `weights_sha256`; `vectors`: vectors_identity at build time, None for an index built before it was recorded),
    else what differs, as the end of a sentence that begins with the index's place and model."""
    mine = weights_sha256(encoder)
    if not model.get("weights_sha256") or model["weights_sha256"] == mine:
        return None  # the same model, heads and all
    name, layers = encoder.name, sorted({int(n) for n in layers})
    leave = "search with the index's model (leave out --model) or build an index with this one"
    if isinstance(vectors, dict) and vectors.get("backbone_sha256"):
        backbone = backbone_sha256(encoder)
        if backbone != vectors["backbone_sha256"]:
            return (
                f"backbone weights sha256 {short(vectors['backbone_sha256'])}, but the query model {name} has other "
                f"weights (backbone sha256 {short(backbone)}); {leave}"
            )
        recorded = vectors.get("exit_heads_sha256") or {}
        for n in layers:
            want, have = recorded.get(str(n)), head_sha256(encoder, n)
            if want == have:
                continue
            if want is None:
                return (
                    f"its vectors at layer {n} were made without an exit head, but the query model {name} (the same "
                    "backbone) applies one there: pass --no-heads, or build an index with this model"
                )
            if have is None:
                off = "; its exit heads are left off (--no-heads): leave that flag out" if _heads_off(encoder) else ""
                return (
                    f"its vectors at layer {n} were made with an exit head (sha256 {short(want)}), but the query model "
                    f"{name} (the same backbone) has none there{off}; or build an index with this model"
                )
            return (
                f"its vectors at layer {n} were made with another exit head (sha256 {short(want)}) than the query "
                f"model {name} applies there (sha256 {short(have)}; the same backbone); {leave}"
            )
        return None
    # An index from before the vectors' identity was recorded: its model's checksum covers any exit heads it had.
    heads = getattr(encoder, "exit_heads", None)
    if heads is not None:
        encoder.set_exit_heads(None)
        try:
            without = weights_sha256(encoder)
        finally:
            encoder.set_exit_heads(heads)
        if without == model["weights_sha256"]:
            at = [n for n in layers if heads.has(n)]
            if not at:
                return None  # this model's backbone without heads built it, and no head acts at its layers
            return (
                f"its vectors at layer {at[0]} were made by this backbone without exit heads, but the query model "
                f"{name} applies one there: pass --no-heads, or build an index with this model"
            )
    hint = "; this model's exit heads are left off (--no-heads): the index may have been built with them"
    return (
        f"weights sha256 {short(model['weights_sha256'])}, but the query model {name} has other weights (sha256 "
        f"{short(mine)}); {leave}{hint if _heads_off(encoder) else ''}"
    )


def _heads_off(encoder) -> bool:
    return getattr(encoder, "exit_heads", None) is None and getattr(encoder, "folder_has_heads", False)
