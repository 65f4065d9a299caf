"""Cascade search against flat full-cell search at scale, measured side by side in one run.

Index: the SciFact corpus plus distinct texts of the shared data as distractors (every `sentence`,
`sentence1/2`, `anchor/positive/negative`, `premise/hypothesis` of the TSV files outside sts/senteval_tok,
which repeats sts/raw lowercased), built with `matryoshka2d index build`'s code (one encoder pass for every
cell, resumable: re-run the same command after a kill). Queries: the SciFact queries with relevance
judgements. For each small cell, a cascade (shortlist from the small cell, rerank with the full cell's stored
vectors) is compared with flat search at the full cell: the share of flat's top 10 the cascade finds, search
time per query (one query per call, best of --repeats passes over all queries), and SciFact nDCG@10 of both.

    OMP_NUM_THREADS=1 python benchmarks/retrieval_cascade.py --model runs/2dmse --small 6:64 6:128 \
        --work runs/bench/cascade [--max-distractors 20000] [--max-length 128]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_DATA, header
from matryoshka2d.evaluate.retrieval import load_beir, rank_metrics
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.retrieval.cascade import overlap_at
from matryoshka2d.retrieval.index import build_index, parse_cell_list
from matryoshka2d.retrieval.search import CellIndex, cascade_search, flat_search, query_vectors

TEXT_COLUMNS = {"sentence", "sentence1", "sentence2", "anchor", "positive", "negative", "premise", "hypothesis"}


def distractors(data: Path, limit: int | None) -> list[str]:
    seen: dict[str, None] = {}
    for path in sorted(data.rglob("*.tsv")):
        if "senteval_tok" in path.parts:
            continue
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            head = [h.strip() for h in next(reader, [])]
            columns = [i for i, h in enumerate(head) if h in TEXT_COLUMNS]
            for row in reader:
                for i in columns:
                    if i < len(row) and row[i].strip():
                        seen.setdefault(row[i].strip())
    texts = list(seen)
    return texts[:limit] if limit is not None else texts


def timed(search_one, n: int, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = np.concatenate([search_one(i) for i in range(n)])
        best = min(best, time.perf_counter() - start)
    return out, 1000 * best / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a 2D-trained model (or minilm-l6 for RAW)")
    parser.add_argument("--full", default="6:384", help="the full cell (6:384)")
    parser.add_argument("--small", nargs="+", default=["6:64", "6:128"], help="small cells to shortlist with")
    parser.add_argument("--shortlist", type=int, default=100)
    parser.add_argument("--max-distractors", type=int, help="at most this many distractor texts (default: all)")
    parser.add_argument("--max-length", type=int, default=256, help="document truncation in tokens (256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, required=True, help="where the corpus file and the index go")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    print(header())
    full = parse_cell_list(args.full, "--full")[0]
    smalls = [parse_cell_list(s, "--small")[0] for s in args.small]
    scifact = load_beir(args.data_dir / "retrieval" / "scifact", "train")
    extra = distractors(args.data_dir, args.max_distractors)
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.jsonl"
    if not corpus.is_file():
        with corpus.open("w", encoding="utf-8") as f:
            for doc_id, text in zip(scifact.doc_ids, scifact.doc_texts, strict=True):
                f.write(json.dumps({"_id": doc_id, "text": text}) + "\n")
            for i, text in enumerate(extra):
                f.write(json.dumps({"_id": f"distractor-{i}", "text": text}) + "\n")
    encoder = ElasticEncoder(args.model, max_length=args.max_length, device="cpu")
    t0 = time.perf_counter()
    build_index(encoder, corpus, [*smalls, full], args.work / "index", shard_size=4096, log=print)
    print(f"index ready in {time.perf_counter() - t0:.0f} s (0 if it was already built)")
    index = CellIndex(args.work / "index")
    n_docs = len(index.ids)
    position = {d: i for i, d in enumerate(index.ids)}
    qrels = [{position[scifact.doc_ids[d]]: r for d, r in rel.items()} for rel in scifact.qrels]
    exclude = np.array([position.get(q, -1) for q in scifact.query_ids])
    t0 = time.perf_counter()
    vectors = query_vectors(encoder, scifact.query_texts, [*smalls, full])
    encode_ms = 1000 * (time.perf_counter() - t0) / len(scifact.query_texts)
    n = len(scifact.query_texts)
    print(
        f"\n{n_docs} documents ({len(scifact.doc_ids)} SciFact + {len(extra)} distractors), {n} queries, "
        f"model {encoder.name}, documents truncated to {args.max_length} tokens; query encoding {encode_ms:.1f} "
        f"ms/query (all cells, one pass)"
    )
    flat_index = index.index(full)
    flat, flat_ms = timed(
        lambda i: flat_search(flat_index, vectors[full][i : i + 1], 10, exclude[i : i + 1])[0], n, args.repeats
    )
    flat_ndcg = rank_metrics(flat, qrels)["ndcg@10"]
    print("| search | top-10 overlap with flat | ms/query | speed-up | SciFact nDCG@10 |")
    print("|---|---:|---:|---:|---:|")
    print(f"| flat ({full[0]},{full[1]}) | 100.0% | {flat_ms:.3f} | 1.00x | {flat_ndcg:.2f} |")
    for small in smalls:
        small_index = index.index(small)
        ranking, ms = timed(
            lambda i, s=small, si=small_index: cascade_search(
                si,
                flat_index,
                vectors[s][i : i + 1],
                vectors[full][i : i + 1],
                args.shortlist,
                10,
                exclude[i : i + 1],
            )[0],
            n,
            args.repeats,
        )
        print(
            f"| cascade ({small[0]},{small[1]}) top {args.shortlist} -> ({full[0]},{full[1]}) | "
            f"{overlap_at(ranking, flat, 10):.1f}% | {ms:.3f} | {flat_ms / ms:.2f}x | "
            f"{rank_metrics(ranking, qrels)['ndcg@10']:.2f} |"
        )


if __name__ == "__main__":
    main()
