"""`matryoshka2d index build`, `matryoshka2d search` and `matryoshka2d pick`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matryoshka2d.cli.args import (
    at_least_one,
    command,
    command_group,
    load_encoder,
    number,
    positive_float,
    positive_int,
    reads_and_writes,
    token_length,
)
from matryoshka2d.outputs import open_for_writing


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def parse_cascade(text: str | None):
    from matryoshka2d.retrieval.index import IndexBuildError, parse_cell_list

    if text is None:
        return None
    cells = parse_cell_list(text, "--cascade")
    if len(cells) != 2:
        raise IndexBuildError(f"--cascade {text!r}: give exactly two cells, small then full (e.g. 2:128,6:384)")
    return cells[0], cells[1]


def qdrant_target(args, collection: str | None):
    from matryoshka2d.retrieval.qdrant_store import QdrantTarget

    return QdrantTarget(
        url=args.url,
        path=args.path,
        collection=collection or Path(args.output).resolve().name,
        shards=args.qdrant_shards,
        replicas=args.qdrant_replicas,
    )


def cmd_index_build(args) -> int:
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.retrieval.index import IndexBuildError, build_index, parse_cell_list

    cells = parse_cell_list(args.cells)
    qdrant_flags = (args.url, args.path, args.collection, args.quantization, args.qdrant_shards, args.qdrant_replicas)
    if args.backend == "faiss" and any(v is not None for v in qdrant_flags):
        raise IndexBuildError(
            "--url, --path, --collection, --quantization, --qdrant-shards and --qdrant-replicas are for "
            "--backend qdrant"
        )
    if args.engine == "local" and (args.address or args.workers):
        raise IndexBuildError("--address and --workers are for --engine ray")
    if args.workers is not None and args.workers < 1:
        raise IndexBuildError(f"--workers must be at least 1, got {args.workers}")
    target = qdrant_target(args, args.collection) if args.backend == "qdrant" else None
    if args.engine == "ray" and args.address:
        from matryoshka2d.retrieval.ray_engine import check_address

        check_address(args.address)  # before loading the model: a cluster that does not answer fails fast
    encoder = load_encoder(args, max_length=args.max_length)
    manifest = build_index(
        encoder,
        args.corpus,
        cells,
        args.output,
        kind=args.index or "flat",
        storage=args.storage,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        limit=args.limit,
        overwrite=args.overwrite,
        keep_shards=args.keep_shards,
        log=_log,
        backend=args.backend,
        qdrant=target,
        quantization=args.quantization or "none",
        engine=args.engine,
        ray_address=args.address,
        workers=args.workers,
    )
    shown = ", ".join(f"({n},{d})" for n, d in manifest["cells"])
    if args.backend == "qdrant":
        where = f"collection '{target.collection}' at {target.where} (manifest in {args.output})"
        print(f"index of {manifest['documents']} documents, cells {shown}, qdrant -> {where}")
    else:
        print(
            f"index of {manifest['documents']} documents, cells {shown}, {manifest['index']} {manifest['storage']} "
            f"-> {args.output}"
        )
    return 0


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
    from matryoshka2d.retrieval.index import parse_cell_list

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
        cell = parse_cell_list(args.cell, "--cell")[0] if args.cell else None
        hits = index.search(
            encoder,
            texts,
            cell=cell,
            cascade=parse_cascade(args.cascade),
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
    _log(
        f"{hits.description}: {n} queries, encoding {1000 * hits.encode_seconds / n:.2f} ms/query, "
        f"search {1000 * hits.search_seconds / n:.3f} ms/query" + (f" -> {args.output}" if args.output else "")
    )
    return 0


def pick_output(args) -> Path:
    """Where pick writes without --output: beside the first results."""
    first = Path(args.results[0])
    return first if first.is_dir() else first.parent


def cmd_pick(args) -> int:
    from matryoshka2d.deploy.pick import run_pick

    return run_pick(args)


def register(sub, model_args) -> None:
    isub = command_group(
        sub, "index", help="faiss indexes or a Qdrant collection of (layer, dim) cells of a corpus", dest="action"
    )
    b = command(
        isub,
        "build",
        cmd_index_build,
        help="encode a corpus once and index several cells",
        description="One encoder pass over the corpus (to the deepest requested layer) fills one faiss index per "
        "cell, or one Qdrant collection with a named vector per cell (--backend qdrant). The pass runs here or on a "
        "Ray cluster (--engine ray). Run the same command again to resume a killed build.",
    )
    model_args(b)
    b.add_argument("--corpus", required=True, help="JSON lines (.jsonl or .jsonl.gz) with _id, text, optional title")
    b.add_argument("--cells", required=True, help="cells to index as layer:dim, e.g. 2:128,6:384")
    b.add_argument("--output", required=True, help="directory for manifest.json, ids.txt and cell-*.faiss")
    b.add_argument("--index", choices=["flat", "hnsw", "ivf"], help="faiss index kind (flat)")
    b.add_argument(
        "--storage",
        choices=["float32", "float16", "int8", "int8-direct", "binary"],
        default="float32",
        help="numbers stored; binary: sign bits searched by Hamming distance, the shortlist rescored with float16 "
        "vectors from disk; int8-direct: int8 under one scale (HNSW walks faster than int8), the shortlist "
        "rescored the same way",
    )
    b.add_argument("--backend", choices=["faiss", "qdrant"], default="faiss", help="faiss files or a Qdrant collection")
    b.add_argument("--url", help="qdrant: a server or cluster, e.g. http://localhost:6333 (API key: $QDRANT_API_KEY)")
    b.add_argument("--path", help="qdrant: a folder for qdrant-client's local mode (exact search; tests, small data)")
    b.add_argument("--collection", help="qdrant: the collection (default: the --output folder's name)")
    b.add_argument(
        "--quantization", choices=["none", "scalar", "binary"], help="qdrant: quantise the small cells (none)"
    )
    b.add_argument("--qdrant-shards", type=positive_int, help="qdrant: shards of a new collection on a cluster")
    b.add_argument("--qdrant-replicas", type=positive_int, help="qdrant: replicas of each shard of a new collection")
    b.add_argument("--engine", choices=["local", "ray"], default="local", help="run the encoder pass here or on Ray")
    b.add_argument(
        "--address", help="ray: the cluster to join, host:port or ray://host:10001 (default: start one here)"
    )
    b.add_argument(
        "--workers", type=positive_int, help="ray: encoder actors, one model each (default: the cluster's CPUs)"
    )
    b.add_argument("--batch-size", type=positive_int, default=64)
    b.add_argument("--shard-size", type=positive_int, default=2048, help="documents per resumable shard (2048)")
    b.add_argument(
        "--max-length", type=token_length, help="truncate documents to this many tokens (default: the model's)"
    )
    b.add_argument("--limit", type=positive_int, help="index only the first N documents")
    b.add_argument("--overwrite", action="store_true", help="replace a different build in --output")
    b.add_argument("--keep-shards", action="store_true", help="keep the per-shard vectors after the build")
    reads_and_writes(b, ("--model", "--corpus"), caches=("--path",))

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
    p.add_argument("--cell", help="flat search at this cell, layer:dim (default: the index's largest cell)")
    p.add_argument(
        "--cascade", help="small:full cells, e.g. 2:128,6:384: shortlist with the first, rerank with the second"
    )
    p.add_argument("--shortlist", type=positive_int, default=100, help="candidates taken from the small cell (100)")
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

    p = command(
        sub,
        "pick",
        cmd_pick,
        help="the quality/cost Pareto frontier over (cell, backend) and the option that fits a budget",
        description="Quality from the files `eval` writes (results.json of sts, classification, retrieval grids, "
        "scored by torch or by the onnx / onnx-int8 graphs; cascade.json of `eval retrieval --cascade / --query-layer "
        "/ --query-model`); cost from the encode time per layer measured with each backend on this machine (cached) "
        "and bytes per vector. Writes pick.md, pick.json and pick.png.",
    )
    p.add_argument(
        "--results", nargs="+", required=True, help="result folders or their results.json / cascade.json files"
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-latency-ms", type=positive_float, help="encode time per query at most this (ms)")
    budget.add_argument(
        "--max-latency-ratio",
        type=positive_float,
        help="encode time per query at most this share of the full model's on the reference backend (torch when "
        "timed), e.g. 0.5",
    )
    budget.add_argument("--max-bytes", type=positive_float, help="bytes per stored vector at most this")
    budget.add_argument("--min-score", type=number, help="the cheapest cell scoring at least this")
    p.add_argument(
        "--backend",
        nargs="+",
        choices=["torch", "onnx", "onnx-int8"],
        help="backends to time, each with results scored on it (default: the backends the results were scored with)",
    )
    p.add_argument(
        "--batch", type=positive_int, help="also time calls of this many texts (ms per text, offline throughput)"
    )
    p.add_argument(
        "--threads", type=positive_int, help="threads for torch and onnxruntime while timing (default: torch's)"
    )
    p.add_argument("--storage", choices=["float32", "float16", "int8"], default="float32", help="for bytes/vector")
    p.add_argument("--model", help="model to time (default: the one named in the results)")
    p.add_argument("--remeasure", action="store_true", help="time the layers again instead of using the cache")
    p.add_argument("--output", help="directory for pick.md/.json/.png (default: the first results directory)")
    reads_and_writes(p, ("--results", "--model"), files=("pick.md", "pick.json", "pick.png"), default=pick_output)
