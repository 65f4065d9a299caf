"""A query encoder's record: `matryoshka2d distill --mode query` (or `--mode static`) writes into the student's
matryoshka2d.json which teacher it was distilled from (its weights checksum, pooling and layers) and, once saved,
the checksum and width of its own weights. Every command that loads the folder checks its own part
(check_own_weights); every place where a query encoder meets documents (search, eval retrieval, serve, mteb, a pair)
checks the teacher's part against the model that encoded them (check_query_encoder).
"""

from __future__ import annotations

import json
from pathlib import Path

from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.models.identity import PAIR_KEY, RECORD_FILE, IdentityError, read_meta, short, weights_sha256
from matryoshka2d.outputs import write_text

DISTILL_KEY = "distill"  # the record `matryoshka2d distill` writes into the student's matryoshka2d.json
QUERY_MODES = ("query", "static")  # distill modes whose folder encodes queries for its teacher's documents


def query_encoder_record(encoder) -> dict | None:
    """The `distill` record of a query encoder's folder (a student trained with --mode query to land on its
    teacher's vectors, or a static cell trained with --mode static), or None for any other model."""
    location = getattr(encoder, "confined_folder", None) or getattr(encoder, "location", None)
    return query_encoder_record_at(location, getattr(encoder, "route", None)) if location else None


def query_encoder_record_at(folder, route: str | None = None) -> dict | None:
    """query_encoder_record of a model folder, read before the model is loaded (through the folder's confined
    reader: its links are checked first); of a pair folder's query route with `route="query"` (the student's
    record, kept under `pair`)."""
    try:
        meta = read_meta(folder, IdentityError)[1] or {}
    except (OSError, IdentityError):  # not JSON: not a query encoder's record (a link out is refused, above)
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
    folder = folder.folder if isinstance(folder, ConfinedFolder) else folder
    return f"{Path(folder) / RECORD_FILE} ({DISTILL_KEY})"


OWN_IDENTITY = ("weights_sha256", "width")  # what a query encoder's record says of its own folder


def without_own_identity(metadata: dict | None) -> dict | None:
    """`metadata` for another folder: a query encoder's record (--mode query or static) loses what it says of its own
    folder (its weights checksum and width), which the folder written from it does not share unless it is stated
    again for it (record_own_identity): an exported cell, or an average of students (merge), has other weights."""
    record = metadata.get(DISTILL_KEY) if isinstance(metadata, dict) else None
    if not isinstance(record, dict) or record.get("mode") not in QUERY_MODES:
        return metadata
    return {**metadata, DISTILL_KEY: {k: v for k, v in record.items() if k not in OWN_IDENTITY}}


def record_own_identity(folder, encoder) -> None:
    """State in the query encoder record of `folder` the checksum and width of `encoder`, the folder as loaded
    (distill --mode query, and an export of a query encoder's cell, write it after saving)."""
    meta_file, meta = read_meta(folder, IdentityError)
    record = meta.get(DISTILL_KEY) if isinstance(meta, dict) else None
    if not isinstance(record, dict) or record.get("mode") not in QUERY_MODES:
        return
    record.update(weights_sha256=weights_sha256(encoder), width=encoder.hidden_size)
    write_text(meta_file, json.dumps(meta, indent=2, default=str))


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
