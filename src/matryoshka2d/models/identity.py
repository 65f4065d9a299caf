"""What identifies a model's weights: one checksum, computed the same way wherever two artefacts meet (an index
and the model its queries are encoded with, result files and the model `pick` times).

The checksum covers every tensor of the module's state_dict (names and values, as float32 on the CPU, in name
order), so it does not depend on the device or on the dtype the weights were loaded in, and it changes with any
weight, the pooler head included. Index manifests have recorded it as `weights_sha256` since the first index
format; this is the same computation, moved here so that every caller agrees.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from matryoshka2d.files import ConfinedFolder
from matryoshka2d.outputs import write_text


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
    location = getattr(encoder, "confined_folder", None) or getattr(encoder, "location", None)
    return query_encoder_record_at(location, getattr(encoder, "route", None)) if location else None


PAIR_KEY = "pair"  # matryoshka2d.json of a query/document pair folder: what each route holds (deploy.pair)
RECORD_FILE = "matryoshka2d.json"


def confined_folder(folder) -> ConfinedFolder:
    """The one reader of a model folder (files.ConfinedFolder): one given is used as it is (its links were checked
    when it was made); a path is checked now, before anything in it is opened."""
    return folder if isinstance(folder, ConfinedFolder) else ConfinedFolder(folder, "model")


def read_meta(folder, error: type[Exception]) -> tuple[Path, dict | None]:
    """(the folder's matryoshka2d.json, what it holds, or None when there is no such file), read through the
    folder's confined reader: a matryoshka2d.json that is a link out of the folder is refused, not read."""
    confined = confined_folder(folder)
    meta = confined.path(RECORD_FILE, confined.folder, "the record of matryoshka2d")  # OutsideFolderError
    if not meta.is_file():
        return meta, None
    try:
        return meta, json.loads(meta.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise error(f"{meta}: not a valid matryoshka2d.json ({exc})") from None


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


# ---- a query/document pair folder, checked as one model when it loads (deploy.pair writes it) -----------------
#
# `export --query-model/--query-cell` records in the pair's matryoshka2d.json (`pair`) the module folders of each
# route, the checksum of each route's weights as ElasticEncoder loads it (`route_sha256`), its layers and width, the
# checksum of the model the documents come from, and the query side's own `distill` record. A pair whose routes were
# swapped or changed, whose document or query weights were replaced, or whose query side was distilled from another
# model than its documents' is refused when it loads, naming the folder and what differs.

PAIR_ROUTES = ("query", "document")
EXPORT_PAIR_AGAIN = (
    "export the pair again (`matryoshka2d export --model MODEL --query-model QUERY_ENCODER` or "
    "`--query-cell LAYERxDIM`)"
)


def pair_record(folder) -> tuple[str, dict] | None:
    """(where the record is, for messages; the `pair` record of a pair folder's matryoshka2d.json), or None for a
    Router folder that sentence-transformers wrote on its own (nothing recorded to check it against). A record
    without the checksums of its routes (written by an earlier matryoshka2d) is refused: nothing would say that the
    routes are the ones exported."""
    confined = confined_folder(folder)
    record = folder_record(confined, PAIR_KEY, IdentityError)
    if record is None:
        return None
    where = f"{confined.folder / RECORD_FILE} ({PAIR_KEY})"
    sides = [record.get(route) if isinstance(record, dict) else None for route in PAIR_ROUTES]
    if not all(isinstance(side, dict) for side in sides):
        raise IdentityError(f"{where}: not a pair record (a 'query' and a 'document' object); {EXPORT_PAIR_AGAIN}")
    checksums = all(isinstance(side.get("route_sha256"), str) for side in sides)
    if not checksums or not isinstance(record.get("routes"), dict):
        raise IdentityError(
            f"{where}: holds no checksum of each route's weights or no routes (written by an earlier matryoshka2d), "
            f"so nothing says that the routes in {confined.folder} are the ones exported; {EXPORT_PAIR_AGAIN}"
        )
    return where, record


def check_pair_routes(folder, routes: dict[str, list[tuple[str, str]]]) -> None:
    """The routes of a pair folder's router_config.json (route -> its (type, module folder) list) must be the ones
    its record names: checked before any weights are loaded, so swapped or edited routes are refused by name."""
    found = pair_record(folder)
    if found is None:
        return
    where, record = found
    have = {route: [sub for _, sub in modules] for route, modules in routes.items()}
    want = record["routes"]
    if have != want:
        config = confined_folder(folder).folder / "router_config.json"
        swapped = have.get("query") == want.get("document") and have.get("document") == want.get("query")
        what = "the query and document routes are swapped" if swapped else "the routes were changed"
        raise IdentityError(
            f"{config}: routes {have}, but {where} records {want}: {what} since the export; {EXPORT_PAIR_AGAIN}"
        )


def check_pair_route(encoder) -> None:
    """A route of a pair folder as loaded (`encoder.route`: "query" or "document") against the pair's record: its
    weights' checksum, layers and width. Runs before the query route's own record is checked (check_own_weights),
    so a swap names itself."""
    found = pair_record(getattr(encoder, "confined_folder", None) or encoder.location)
    if found is None:
        return
    where, record = found
    route = encoder.route
    other = "query" if route == "document" else "document"
    side = record[route]
    actual = weights_sha256(encoder)
    if actual != side["route_sha256"]:
        what = (
            f"holds the {other} route's weights (sha256 {short(actual)}): the routes were swapped"
            if actual == record[other]["route_sha256"]
            else f"has weights of sha256 {short(actual)}, not the exported {short(side['route_sha256'])}: they were "
            "replaced or changed since the export"
        )
        raise IdentityError(f"{where}: the {route} route of {encoder.location} {what}; {EXPORT_PAIR_AGAIN}")
    layers, width = side.get("layer"), side.get("dim")
    if layers != encoder.num_layers or width != encoder.hidden_size:
        raise IdentityError(
            f"{where}: records the {route} route with {layers!r} layers and {width!r} numbers, but the route in "
            f"{encoder.location} has {encoder.num_layers} layers and {encoder.hidden_size} numbers; {EXPORT_PAIR_AGAIN}"
        )


def check_pair(document, query) -> None:
    """The two routes of a pair folder together (both checked on their own by check_pair_route): one width; a query
    encoder's `distill` record names the document model's weights as its teacher, its pooling and its layers; a
    query cell is a shallower exit of the document model."""
    found = pair_record(getattr(document, "confined_folder", None) or document.location)
    if found is None:
        return
    where, record = found
    q, d = record["query"], record["document"]
    if q.get("dim") != d.get("dim") or query.hidden_size != document.hidden_size:
        raise IdentityError(
            f"{where}: the query route gives {query.hidden_size} numbers and the document route {document.hidden_size} "
            f"(recorded: {q.get('dim')!r} and {d.get('dim')!r}); a query must have the documents' width; "
            f"{EXPORT_PAIR_AGAIN}"
        )
    distill = q.get(DISTILL_KEY)
    if q.get("kind") == "query encoder" or distill is not None:
        if not isinstance(distill, dict) or distill.get("mode") not in QUERY_MODES:
            raise IdentityError(f"{where}: the query encoder's `{DISTILL_KEY}` record is missing; {EXPORT_PAIR_AGAIN}")
        documents = {
            "model": d.get("from"),
            "weights_sha256": d.get("weights_sha256"),
            "pooling": document.pooling,
            "hidden_size": document.hidden_size,
        }
        check_query_encoder(distill, str(q.get("from")), documents, where)
        if distill.get("teacher_layers") not in (None, d.get("layer")):
            raise IdentityError(
                f"{where}: the query encoder {q.get('from')} was trained towards its teacher's layer "
                f"{distill.get('teacher_layers')}, but the document route is layer {d.get('layer')}; "
                f"{EXPORT_PAIR_AGAIN}"
            )
    elif q.get("kind") == "query cell":
        if q.get("from") != d.get("from") or not (isinstance(q.get("layer"), int) and q["layer"] < d.get("layer", 0)):
            raise IdentityError(
                f"{where}: the query cell (layer {q.get('layer')!r} of {q.get('from')}) is not a shallower exit of the "
                f"document model (layer {d.get('layer')!r} of {d.get('from')}); {EXPORT_PAIR_AGAIN}"
            )
    else:
        raise IdentityError(f"{where}: query side of kind {q.get('kind')!r} is not known; {EXPORT_PAIR_AGAIN}")
