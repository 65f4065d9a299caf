"""`matryoshka2d search`: search an index built by `index build`, flat, as a cascade or with shallow queries
(retrieval/search.py; a Qdrant collection through retrieval/qdrant_store.py)."""

from __future__ import annotations

import json
from pathlib import Path

from matryoshka2d.cli.args import (
    at_least_one,
    cascade_cells,
    command,
    load_encoder,
    one_cell,
    positive_int,
    reads_and_writes,
)
from matryoshka2d.cli.results import log
from matryoshka2d.outputs import open_for_writing


def read_queries(path: str) -> tuple[list[str], list[str]]:
    """(ids, texts): one query per line of a text file (its id: the line number), or the `_id` and `text` of each
    line of a JSON-lines file (BEIR queries; a line without `_id` gets its line number)."""
    from matryoshka2d.files import read_jsonl

    if path.endswith((".jsonl", ".jsonl.gz")):
        ids, out = [], []
        for line, obj in read_jsonl(path):
            if not isinstance(obj.get("text"), str):
                raise ValueError(f"{path} line {line}: no 'text' string field")
            ids.append(str(obj.get("_id", line)))
            out.append(obj["text"])
        return ids, out
    from matryoshka2d.files import read_lines

    numbered = [(str(n), q) for n, q in enumerate(read_lines(path), start=1) if q.strip()]
    return [n for n, _ in numbered], [q for _, q in numbered]


def open_index(args):
    """A faiss build directory, a qdrant build's directory (its collection, at --url/--path if given), or a
    collection named by --url/--path and --collection alone."""
    from matryoshka2d.retrieval.index import IndexBuildError, read_manifest
    from matryoshka2d.retrieval.search import CellIndex

    if args.index is None:
        if not (args.url or args.path) or not args.collection:
            raise IndexBuildError("give --index DIR, or a Qdrant collection as --url URL (or --path DIR) --collection")
        from matryoshka2d.retrieval.qdrant_store import QdrantIndex, QdrantTarget

        target = QdrantTarget(url=args.url, path=args.path, collection=args.collection)
        return QdrantIndex(target, args.ef_search, args.oversampling)
    manifest = read_manifest(args.index)
    if manifest.get("backend") == "qdrant":
        from matryoshka2d.retrieval.qdrant_store import QdrantIndex, QdrantTarget

        target = QdrantTarget.from_manifest(manifest["qdrant"], url=args.url, path=args.path)
        return QdrantIndex(target, args.ef_search, args.oversampling)
    if args.url or args.path or args.collection or args.oversampling:
        raise IndexBuildError(
            f"{args.index}: a faiss index; --url, --path, --collection and --oversampling are for Qdrant"
        )
    return CellIndex(args.index, nprobe=args.nprobe, ef_search=args.ef_search)


def cmd_search(args) -> int:
    if (args.query is None) == (args.queries is None):
        raise ValueError("give either --query TEXT or --queries FILE")
    if args.query_model and args.pooling:
        raise ValueError(
            f"--pooling {args.pooling} with --query-model: a query encoder pools as it was distilled (as its teacher "
            "pooled the documents); leave --pooling out"
        )
    query_ids, texts = (["1"], [args.query]) if args.query is not None else read_queries(args.queries)
    if not texts:
        raise ValueError(f"--queries {args.queries}: no queries in the file")
    index = open_index(args)
    try:
        recorded = index.manifest["model"]
        # The folder the build loaded, if this machine has it (a collection may have been built elsewhere).
        location = recorded["location"]
        if location and not Path(location).exists() and args.index and (Path(args.index) / location).exists():
            location = str(Path(args.index) / location)  # a relative location, as builds before issue 32 wrote it
        here = location and Path(location).exists()
        model = args.model or (location if here else recorded["model"])
        if args.query_model:  # a student distilled for the index's model: its own pooling, checked against it
            if args.model:
                raise ValueError("give --model (the index's model) or --query-model (a query encoder), not both")
            encoder = load_encoder(args, model=args.query_model)
            encoder = encoder.query_encoder or encoder  # a pair folder (export --query-model): its query route
        else:
            # The documents' pooling unless told otherwise (a plain Hugging Face folder has none of its own).
            encoder = load_encoder(args, model=model, pooling=args.pooling or recorded.get("pooling"))
        hits = index.search(
            encoder,
            texts,
            cell=args.cell,
            cascade=args.cascade,
            shortlist=args.shortlist,
            top_k=args.top_k,
            query_layer=args.query_layer,
        )
    finally:
        if hasattr(index, "close"):
            index.close()  # a local-mode Qdrant folder stays locked while its client is open
    rows = zip(query_ids, texts, hits.ids, hits.scores, strict=True)
    if args.output:  # through the one writer: a temporary file beside it, renamed into place when whole
        with open_for_writing(args.output, "w", "--output") as out:
            for query_id, text, ids, scores in rows:
                row = {"query_id": query_id, "query": text, "ids": ids, "scores": scores}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif len(texts) <= 20:
        for _, text, ids, scores in rows:
            print(f"query: {text}")
            for rank, (doc, score) in enumerate(zip(ids, scores, strict=True), start=1):
                print(f"  {rank:>3}. {doc}  {score:.4f}")
    n = len(texts)
    log(
        f"{hits.description}: {n} queries, encoding {1000 * hits.encode_seconds / n:.2f} ms/query, "
        f"search {1000 * hits.search_seconds / n:.3f} ms/query" + (f" -> {args.output}" if args.output else "")
    )
    return 0


def register(sub, model_args) -> None:
    p = command(
        sub,
        "search",
        cmd_search,
        help="search an index: flat, cascade (--cascade) or shallow queries (--query-layer)",
        description="Queries are encoded once, up to the deepest cell needed. Results print as rank, id, score.",
    )
    p.add_argument("--index", help="directory written by `matryoshka2d index build` (faiss or qdrant)")
    p.add_argument("--url", help="qdrant: search this server instead of the one the build recorded")
    p.add_argument("--path", help="qdrant: this local-mode folder instead of the one the build recorded")
    p.add_argument("--collection", help="qdrant: with --url/--path and no --index, the collection to search")
    model_args(p, default=None, model_help="query model (default: the index's model)", device_help=None)
    p.add_argument("--query", help="one query text")
    p.add_argument("--queries", help="a file with one query per line, or a queries.jsonl")
    p.add_argument(
        "--cell", type=one_cell, help="flat search at this cell, layer:dim (default: the index's largest cell)"
    )
    p.add_argument(
        "--cascade",
        type=cascade_cells,
        help="small:full cells, e.g. 2:128,6:384: shortlist with the first, rerank with the second",
    )
    p.add_argument("--shortlist", type=positive_int, default=100, help="candidates taken from the small cell")
    p.add_argument("--top-k", type=positive_int, default=10)
    p.add_argument(
        "--query-layer", type=positive_int, help="encode queries with only this many layers (asymmetric search)"
    )
    p.add_argument(
        "--query-model",
        help="encode queries with a query encoder distilled from the index's model (`distill --mode query`); "
        "it is accepted only against documents of its teacher",
    )
    p.add_argument("--nprobe", type=positive_int, default=16, help="IVF lists visited per query (ivf indexes)")
    p.add_argument(
        "--ef-search", type=positive_int, default=64, help="HNSW search breadth (hnsw indexes; qdrant's hnsw_ef)"
    )
    p.add_argument(
        "--oversampling",
        type=at_least_one,
        help="qdrant, quantised small cells: shortlist this many times --shortlist by quantised scores, then rescore "
        "them with the original vectors",
    )
    p.add_argument("--output", help="write one JSON line per query (query, ids, scores) instead of printing")
    reads_and_writes(p, ("--index", "--queries", "--model", "--query-model"), files=("",))
