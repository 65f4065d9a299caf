"""`matryoshka2d index build`: encode a corpus once and index several cells, as faiss files or one Qdrant
collection (retrieval/index.py)."""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.cli.args import command, command_group, grid_cells, positive_int, reads_and_writes, token_length
from matryoshka2d.cli.results import log


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
    from matryoshka2d.retrieval.index import IndexBuildError, build_index

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
        args.cells,
        args.output,
        kind=args.index or "flat",
        storage=args.storage,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        limit=args.limit,
        overwrite=args.overwrite,
        keep_shards=args.keep_shards,
        log=log,
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
    b.add_argument("--cells", required=True, type=grid_cells, help="cells to index as layer:dim, e.g. 2:128,6:384")
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
    b.add_argument("--shard-size", type=positive_int, default=2048, help="documents per resumable shard")
    b.add_argument(
        "--max-length", type=token_length, help="truncate documents to this many tokens (default: the model's)"
    )
    b.add_argument("--limit", type=positive_int, help="index only the first N documents")
    b.add_argument("--overwrite", action="store_true", help="replace a different build in --output")
    b.add_argument("--keep-shards", action="store_true", help="keep the per-shard vectors after the build")
    reads_and_writes(b, ("--model", "--corpus"), caches=("--path",))
