"""A query/document pair folder, checked as one model when it loads (export.pair writes it).

`export --query-model/--query-cell` records in the pair's matryoshka2d.json (`pair`) the module folders of each
route, the checksum of each route's weights as ElasticEncoder loads it (`route_sha256`), its layers and width, the
checksum of the model the documents come from, and the query side's own `distill` record. A pair whose routes were
swapped or changed, whose document or query weights were replaced, or whose query side was distilled from another
model than its documents' is refused when it loads, naming the folder and what differs.
"""

from __future__ import annotations

from matryoshka2d.models.identity import (
    PAIR_KEY,
    RECORD_FILE,
    IdentityError,
    confined_folder,
    folder_record,
    short,
    weights_sha256,
)
from matryoshka2d.models.query_record import DISTILL_KEY, QUERY_MODES, check_query_encoder
from matryoshka2d.models.st_folder import PAIR_ROUTES

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
