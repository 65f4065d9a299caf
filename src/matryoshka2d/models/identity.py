"""What identifies a model's weights: one checksum, computed the same way wherever two artefacts meet (an index
and the model its queries are encoded with, result files and the model `pick` times).

The checksum covers every tensor of the module's state_dict (names and values, as float32 on the CPU, in name
order), so it does not depend on the device or on the dtype the weights were loaded in, and it changes with any
weight, the pooler head included. Index manifests have recorded it as `weights_sha256` since the first index
format; this is the same computation, moved here so that every caller agrees.
"""

from __future__ import annotations

import hashlib

import torch


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


def short(checksum: str | None) -> str:
    """The first 12 hex digits, enough to tell two models apart in a message."""
    return checksum[:12] if checksum else "not recorded"


# ---- query encoders distilled for a teacher's index (matryoshka2d.training.distill, --mode query) -------------

DISTILL_KEY = "distill"  # the record `matryoshka2d distill` writes into the student's matryoshka2d.json


class IdentityError(ValueError):
    """A model and the vectors it is asked to meet were made by different models; the message says what differs."""


QUERY_MODES = ("query", "static")  # distill modes whose folder encodes queries for its teacher's documents


def query_encoder_record(encoder) -> dict | None:
    """The `distill` record of a query encoder's folder (a student trained with --mode query to land on its
    teacher's vectors, or a static cell trained with --mode static), or None for any other model."""
    location = getattr(encoder, "location", None)
    return query_encoder_record_at(location, getattr(encoder, "route", None)) if location else None


PAIR_KEY = "pair"  # matryoshka2d.json of a query/document pair folder: what each route holds (deploy.pair)


def folder_record(folder, key: str, error: type[Exception]) -> dict | None:
    """The `key` record of a model folder's matryoshka2d.json (exit heads, a static cell), or None when the folder
    has no such file or record; a file that is not JSON is an `error` naming it."""
    import json
    from pathlib import Path

    if not folder:
        return None
    meta = Path(folder) / "matryoshka2d.json"
    if not meta.is_file():
        return None
    try:
        record = json.loads(meta.read_text(encoding="utf-8")).get(key)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise error(f"{meta}: not a valid matryoshka2d.json ({exc})") from None
    return record or None


def query_encoder_record_at(folder, route: str | None = None) -> dict | None:
    """query_encoder_record of a model folder, read before the model is loaded; of a pair folder's query route
    with `route="query"` (the student's record, kept under `pair`)."""
    import json
    from pathlib import Path

    path = Path(folder) / "matryoshka2d.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return None
    if route == "query" and isinstance(meta, dict):
        meta = (meta.get(PAIR_KEY) or {}).get("query") or {}
    record = meta.get(DISTILL_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) and record.get("mode") in QUERY_MODES else None


def query_encoder_layer(record: dict, encoder) -> int:
    """The layer a query encoder's queries are encoded at: its static cell (0) for --mode static, else all of its
    own layers."""
    return 0 if record.get("mode") == "static" else encoder.num_layers


def documents_identity(encoder) -> dict:
    """What a query encoder is checked against when `encoder` encodes the documents (an index manifest records
    the same fields): its name, weights checksum, pooling, layers and width."""
    return {
        "model": encoder.name,
        "weights_sha256": weights_sha256(encoder),
        "pooling": encoder.pooling,
        "layers": encoder.num_layers,
        "hidden_size": encoder.hidden_size,
    }


def _record_place(folder) -> str:
    from pathlib import Path

    return f"{Path(folder) / 'matryoshka2d.json'} ({DISTILL_KEY})"


OWN_IDENTITY = ("weights_sha256", "width")  # what a query encoder's record says of its own folder


def without_own_identity(metadata: dict | None) -> dict | None:
    """`metadata` for another folder: a query encoder's record loses what it says of its own folder (its weights
    checksum and width), which the folder written from it does not share unless it is stated again for it
    (record_own_identity): an exported cell, or the student with heads fitted, has other weights."""
    record = metadata.get(DISTILL_KEY) if isinstance(metadata, dict) else None
    if not isinstance(record, dict) or record.get("mode") != "query":
        return metadata
    return {**metadata, DISTILL_KEY: {k: v for k, v in record.items() if k not in OWN_IDENTITY}}


def record_own_identity(folder, encoder) -> None:
    """State in the query encoder record of `folder` the checksum and width of `encoder`, the folder as loaded
    (distill --mode query, and an export of a query encoder's cell, write it after saving)."""
    import json
    from pathlib import Path

    path = Path(folder) / "matryoshka2d.json"
    meta = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    record = meta.get(DISTILL_KEY) if isinstance(meta, dict) else None
    if not isinstance(record, dict) or record.get("mode") not in QUERY_MODES:
        return
    record.update(weights_sha256=weights_sha256(encoder), width=encoder.hidden_size)
    path.write_text(json.dumps(meta, indent=2, default=str), encoding="utf-8")


def check_own_weights(encoder) -> None:
    """A query encoder's record vouches for the folder it is in: the checksum of the folder's own weights and the
    width of its vectors (written by `distill --mode query`) must be the loaded model's, so that another
    student's weights under an intact record, or a record copied or edited to fit an index, are refused when the
    folder loads (every command loads through ElasticEncoder). A record with neither (written before they were
    recorded, or by `distill` while it completes it) is refused where the encoder meets documents
    (check_query_encoder)."""
    record = query_encoder_record(encoder)
    if record is None:
        return
    own, width = record.get("weights_sha256"), record.get("width")
    if own is None and width is None:
        return
    where, folder = _record_place(encoder.location), encoder.location
    again = "the record is not this folder's: distill the query encoder again (`matryoshka2d distill --mode query`)"
    if isinstance(width, bool) or width != encoder.hidden_size:
        raise IdentityError(
            f"{where}: records vectors of {width!r} numbers, but the weights in {folder} give {encoder.hidden_size}; "
            f"{again}"
        )
    actual = weights_sha256(encoder)
    if own != actual:
        raise IdentityError(
            f"{where}: records the query encoder's own weights sha256 {short(own if isinstance(own, str) else None)}, "
            f"but the weights in {folder} have {short(actual)} (another model's weights, or changed since); {again}"
        )


def check_query_encoder(record: dict, student: str, documents: dict, where: str) -> None:
    """A query encoder may search documents of its teacher only, of its own width: `documents` describes the model
    that encoded them (weights_sha256, pooling, layers, hidden_size, model), as an index manifest records it (or
    documents_identity). Its record must hold the checksum of its own weights and its width, which
    check_own_weights compared with the folder when it loaded."""
    teacher = record.get("teacher_weights_sha256")
    built = documents.get("model") or "another model"
    if not teacher or teacher != documents.get("weights_sha256"):
        raise IdentityError(
            f"{where}: the documents were encoded by {built} (weights sha256 "
            f"{short(documents.get('weights_sha256'))}), "
            f"but the query encoder {student} was distilled from {record.get('teacher')} (weights sha256 "
            f"{short(teacher)}): its vectors live in its teacher's space only. Use a query encoder distilled from "
            f"{built} (`matryoshka2d distill --mode query --teacher ...`), or search with {built} itself"
        )
    if documents.get("pooling") and record.get("teacher_pooling") not in (None, documents["pooling"]):
        raise IdentityError(
            f"{where}: the documents were pooled with {documents['pooling']}, the query encoder {student}'s teacher "
            f"with {record.get('teacher_pooling')}"
        )
    width = record.get("width")
    if not isinstance(record.get("weights_sha256"), str) or isinstance(width, bool) or not isinstance(width, int):
        raise IdentityError(
            f"{where}: the query encoder {student}'s record ({DISTILL_KEY} in its matryoshka2d.json) holds no checksum "
            "of its own weights or no width (written by an earlier matryoshka2d, or changed), so nothing says the "
            "weights in its folder are the ones distilled: distill it again (`matryoshka2d distill --mode query`)"
        )
    if documents.get("hidden_size") is not None and width != documents["hidden_size"]:
        raise IdentityError(
            f"{where}: the documents' vectors have {documents['hidden_size']} numbers, but the query encoder "
            f"{student} gives {width}: a query must have the documents' width. Use a query encoder distilled from "
            f"{built}"
        )


def refuse_query_encoder_for_documents(encoder, where: str) -> None:
    """A query encoder encodes queries against its teacher's documents; documents encoded by it match nothing (every
    search checks a query model against the documents' teacher). Refused before any document is encoded."""
    record = query_encoder_record(encoder)
    if record is not None:
        raise IdentityError(
            f"{where}: {encoder.name} is a query encoder distilled from {record.get('teacher')} (`distill --mode "
            "query`): its vectors are made for queries against documents its teacher encoded, and an index of its "
            f"own could not be searched. Build the index with the teacher (--model {record.get('teacher')}) and "
            f"search it with --query-model {encoder.name}"
        )


def check_query_cells(record: dict, student: str, cells, where: str) -> None:
    """A query encoder lands on its teacher's last-layer vectors: it can search cells at that layer only."""
    top = record.get("teacher_layers")
    if bad := [c for c in cells if top is not None and c[0] != top]:
        raise IdentityError(
            f"{where}: cells {', '.join(f'{n}:{d}' for n, d in bad)} hold documents at a shallow layer, but the query "
            f"encoder {student} was trained towards its teacher's layer {top}: search cells at layer {top}"
        )


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
