"""The Qdrant cascade (one Query API request: prefetch on the small cell, rescore on the full one) against the
faiss cascade, on SciFact with the shared train queries.

The corpus is encoded once (`index build --backend qdrant --path ...`, with its shards kept); the faiss indexes
are then built from the same shard files, so both backends hold exactly the same vectors. For each query it
compares the top 10 of `search --cascade SMALL,FULL --shortlist N` through qdrant-client's local mode with the
faiss cascade's. Then the same requests run on qdrant-edge-py (Qdrant's Rust engine, in-process), over the same
vectors with the collection's settings, unquantised and with the small cell's scalar (int8) or binary copy, to
show what local mode (always exact) does not: the quantised shortlist of a real Qdrant.

    OMP_NUM_THREADS=1 python benchmarks/qdrant_cascade.py --model minilm-l6 --cascade 2:128,6:384 \
        --shortlist 100 --work runs/bench/qdrant-scifact
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_DATA, header
from matryoshka2d.beir import load_beir
from matryoshka2d.cells import parse_cells
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.retrieval.index import build_index, finalize
from matryoshka2d.retrieval.qdrant_store import QdrantIndex, QdrantTarget, vector_params
from matryoshka2d.retrieval.search import CellIndex, query_vectors
from matryoshka2d.retrieval.shards import cell_name, load_shards


def same(a: list[list[str]], b: list[list[str]]) -> tuple[float, float, float]:
    """% of queries with the identical top-k list, with the same set of ids, and the mean share of b's ids in a."""
    lists = np.mean([x == y for x, y in zip(a, b, strict=True)])
    sets = np.mean([set(x) == set(y) for x, y in zip(a, b, strict=True)])
    shares = np.mean([len(set(x) & set(y)) / max(len(y), 1) for x, y in zip(a, b, strict=True)])
    return 100 * float(lists), 100 * float(sets), 100 * float(shares)


def edge_answers(
    work: Path, manifest: dict, vectors, small, full, shortlist: int, quantization: str, oversampling: float | None
) -> list[list[str]]:
    """The same prefetch + rescore requests on qdrant-edge-py, segments built by optimize()."""
    import qdrant_edge as edge

    cells = [tuple(c) for c in manifest["cells"]]
    quantized = {
        "none": None,
        "scalar": edge.ScalarQuantizationConfig(type=edge.ScalarType.Int8, quantile=0.99, always_ram=True),
        "binary": edge.BinaryQuantizationConfig(always_ram=True),
    }[quantization]
    config = edge.EdgeConfig(
        vectors={
            name: edge.EdgeVectorParams(
                size=p.size,
                distance=edge.Distance.Cosine,
                on_disk=bool(p.on_disk),
                quantization_config=None if p.on_disk else quantized,
                hnsw_config=edge.HnswIndexConfig(m=p.hnsw_config.m, ef_construct=100, full_scan_threshold=10000)
                if p.hnsw_config
                else None,
            )
            for name, p in vector_params(cells, quantization).items()
        },
        optimizers=edge.EdgeOptimizersConfig(indexing_threshold=1),
    )
    path = work / f"edge-{quantization}"
    shutil.rmtree(path, ignore_errors=True)
    shard = edge.EdgeShard.create(str(path), config)
    try:
        position = 0
        for s in load_shards(work / "qdrant", manifest):
            vecs = {cell_name(c): s[cell_name(c)] for c in cells}
            shard.update(
                edge.UpdateOperation.upsert_points(
                    [
                        edge.Point(position + i, {k: v[i] for k, v in vecs.items()}, {"doc_id": str(d)})
                        for i, d in enumerate(s["ids"])
                    ]
                )
            )
            position += len(s["ids"])
        shard.flush()
        shard.optimize()
        params = (
            edge.SearchParams(quantization=edge.QuantizationSearchParams(rescore=True, oversampling=oversampling))
            if oversampling
            else None
        )
        out = []
        for qs, qf in zip(vectors[small], vectors[full], strict=True):
            prefetch = edge.Prefetch(
                query=edge.Query.Nearest(qs.tolist(), using=cell_name(small)), limit=shortlist, params=params
            )
            hits = shard.query(
                edge.QueryRequest(
                    prefetches=[prefetch],
                    query=edge.Query.Nearest(qf.tolist(), using=cell_name(full)),
                    limit=10,
                    with_payload=True,
                )
            )
            out.append([p.payload["doc_id"] for p in hits])
        return out
    finally:
        shard.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--cascade", default="2:128,6:384")
    parser.add_argument("--shortlist", type=int, default=100)
    parser.add_argument("--split", default="train", help="SciFact queries with judgements (train)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    print(header())
    small, full = parse_cells(args.cascade, "--cascade")
    scifact = load_beir(args.data_dir / "retrieval" / "scifact", args.split)
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.jsonl"
    if not corpus.is_file():
        with corpus.open("w", encoding="utf-8") as f:
            for doc_id, text in zip(scifact.doc_ids, scifact.doc_texts, strict=True):
                f.write(json.dumps({"_id": doc_id, "text": text}) + "\n")
    encoder = ElasticEncoder(args.model, device="cpu")
    target = QdrantTarget(path=str(args.work / "local"), collection="scifact")
    t0 = time.perf_counter()
    manifest = build_index(
        encoder, corpus, [small, full], args.work / "qdrant", shard_size=1024, keep_shards=True, backend="qdrant",
        qdrant=target, log=print,
    )  # fmt: skip
    print(f"encoded and uploaded in {time.perf_counter() - t0:.0f} s (0 if it was already built)")
    faiss_dir = args.work / "faiss"
    if not (faiss_dir / "manifest.json").is_file():  # the faiss indexes from the very same shard files
        (faiss_dir / "shards").mkdir(parents=True, exist_ok=True)
        for name in manifest["shards"]:
            link = faiss_dir / "shards" / name
            if not link.exists():
                os.link(args.work / "qdrant" / "shards" / name, link)
        faiss_manifest = {k: v for k, v in manifest.items() if k not in ("qdrant", "quantization", "uploaded")}
        finalize(faiss_dir, {**faiss_manifest, "backend": "faiss", "complete": False}, print)
    texts = scifact.query_texts
    faiss_hits = CellIndex(faiss_dir).search(encoder, texts, cascade=(small, full), shortlist=args.shortlist)
    local = QdrantIndex(target)
    try:
        qdrant_hits = local.search(encoder, texts, cascade=(small, full), shortlist=args.shortlist)
    finally:
        local.close()
    n = len(texts)
    print(
        f"\nSciFact {args.split}: {len(scifact.doc_ids)} documents, {n} queries, model {encoder.name}, cascade "
        f"({small[0]},{small[1]}) shortlist {args.shortlist} -> ({full[0]},{full[1]}), top 10"
    )
    print(
        "| backend | queries with the same top-10 list as faiss | same top-10 set | share of faiss's top 10 "
        "| search ms/query |"
    )
    print("|---|---:|---:|---:|---:|")
    print(f"| faiss cascade (flat indexes) | 100.0% | 100.0% | 100.0% | {1000 * faiss_hits.search_seconds / n:.2f} |")
    lists, sets, share = same(qdrant_hits.ids, faiss_hits.ids)
    ms = 1000 * qdrant_hits.search_seconds / n
    print(f"| qdrant-client local mode, one prefetch query | {lists:.1f}% | {sets:.1f}% | {share:.1f}% | {ms:.2f} |")
    vectors = query_vectors(encoder, texts, [small, full])
    for quantization, oversampling in [("none", None), *((q, o) for q in ("scalar", "binary") for o in (None, 4.0))]:
        t0 = time.perf_counter()
        answers = edge_answers(args.work, manifest, vectors, small, full, args.shortlist, quantization, oversampling)
        ms = 1000 * (time.perf_counter() - t0) / n
        lists, sets, share = same(answers, faiss_hits.ids)
        label = quantization + (f", oversampling {oversampling:g}" if oversampling else "")
        print(
            f"| qdrant-edge (Rust engine), small cell {label} | {lists:.1f}% | {sets:.1f}% | {share:.1f}% | "
            f"{ms:.2f} (with building the shard) |"
        )


if __name__ == "__main__":
    main()
