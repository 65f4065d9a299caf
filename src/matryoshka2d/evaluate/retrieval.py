"""Retrieval in the BEIR layout: exact inner-product search on unit vectors, nDCG@10, MRR@10 and Recall@100.

A dataset folder holds `corpus.jsonl` (or `corpus.jsonl.gz`) with `_id, title, text`, `queries.jsonl` with
`_id, text`, and `qrels/<split>.tsv` with `query-id, corpus-id, score`, read by matryoshka2d.beir. As in BEIR and
sentence-transformers, a document is embedded as `title + " " + text` (stripped), truncated to the encoder's
max_length tokens (256 for minilm-l6, 384 for mpnet-base: longer abstracts are cut, as they are in BEIR's own
numbers); only queries with at least one relevant document (score > 0) are evaluated, and a document whose id
equals the query's id is never returned (BEIR's ignore_identical_ids). Corpus and queries are embedded once for
all cells; search is an exact matrix product per cell, in chunks of queries.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from matryoshka2d.beir import load_beir
from matryoshka2d.cells import unit_rows
from matryoshka2d.evaluate.grid import CellEmbedder, embed_distinct
from matryoshka2d.evaluate.results import GridResult, grid_result, model_record, provenance

METRICS = ("ndcg@10", "mrr@10", "recall@100")
DEPTH = 100  # the deepest rank any metric looks at


def search(queries: np.ndarray, docs: np.ndarray, k: int, exclude: np.ndarray | None = None, chunk: int = 512):
    """Indices of the k highest inner products per query, best first (ties: lower document index first).

    `exclude[i]` is a document index query i must not get back, or -1. Ranks that only an excluded document
    could fill (a corpus smaller than k) hold -1.
    """
    n_docs = docs.shape[0]
    k = min(k, n_docs)
    out = np.empty((queries.shape[0], k), dtype=np.int64)
    for start in range(0, queries.shape[0], chunk):
        scores = queries[start : start + chunk] @ docs.T
        if exclude is not None:
            rows = np.nonzero(exclude[start : start + chunk] >= 0)[0]
            scores[rows, exclude[start : start + chunk][rows]] = -np.inf
        if k < n_docs:
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        else:
            top = np.broadcast_to(np.arange(n_docs), scores.shape)
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.lexsort((top, -top_scores), axis=1)
        ranked = np.take_along_axis(top, order, axis=1)
        ranked[np.take_along_axis(top_scores, order, axis=1) == -np.inf] = -1
        out[start : start + chunk] = ranked
    return out


def rank_metrics(ranking: np.ndarray, qrels: list[dict[int, int]]) -> dict[str, float]:
    """Mean nDCG@10 (graded gain, log2 discount, as trec_eval), MRR@10 and Recall@100, x 100."""
    discount = 1.0 / np.log2(np.arange(2, 12))
    ndcg, mrr, recall = [], [], []
    for ranked, rel in zip(ranking, qrels, strict=True):
        gains = np.array([rel.get(int(d), 0) for d in ranked[:DEPTH]], dtype=np.float64)
        ideal = np.sort(np.fromiter(rel.values(), dtype=np.float64))[::-1][:10]
        top = gains[:10]
        ndcg.append(float(top @ discount[: len(top)]) / float(ideal @ discount[: len(ideal)]))
        hits = np.nonzero(top > 0)[0]
        mrr.append(1.0 / (hits[0] + 1) if hits.size else 0.0)
        recall.append(float(np.count_nonzero(gains > 0)) / len(rel))
    return {
        "ndcg@10": 100 * float(np.mean(ndcg)),
        "mrr@10": 100 * float(np.mean(mrr)),
        "recall@100": 100 * float(np.mean(recall)),
    }


def evaluate_retrieval(
    embedder: CellEmbedder,
    directories: Sequence[str | Path],
    split: str = "test",
    log: Callable[[str], None] | None = None,
) -> GridResult:
    """Evaluate every cell of `embedder` on each BEIR folder."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    sets = [load_beir(d, split) for d in directories]  # read and check everything before encoding
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"two dataset folders share a name: {names}")
    started, start = provenance(), time.perf_counter()  # the load average is the one at the start
    encode_seconds, scores, described = 0.0, [], {}
    for ds in sets:
        t0 = time.perf_counter()
        doc_cells, doc_rows = embed_distinct(embedder, ds.doc_texts)
        query_cells, query_rows = embed_distinct(embedder, ds.query_texts)
        encode_seconds += time.perf_counter() - t0
        log(
            f"{ds.name}: {len(ds.doc_ids)} documents, {len(ds.query_ids)} queries embedded in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        doc_of = np.array([doc_rows[t] for t in ds.doc_texts])
        query_of = np.array([query_rows[t] for t in ds.query_texts])
        position = {d: i for i, d in enumerate(ds.doc_ids)}
        exclude = np.array([position.get(q, -1) for q in ds.query_ids])
        for cell in doc_cells:
            docs = unit_rows(doc_cells[cell])[doc_of]
            queries = unit_rows(query_cells[cell])[query_of]
            row = rank_metrics(search(queries, docs, DEPTH, exclude), ds.qrels)
            scores.append({"dataset": ds.name, "layer": cell[0], "dim": cell[1], **row})
        described[ds.name] = {
            "directory": str(ds.directory.resolve()),
            "split": split,
            "documents": len(ds.doc_ids),
            "queries": len(ds.query_ids),
            "qrels_unknown_documents": ds.unknown_docs,
        }
        if ds.unknown_docs:
            log(f"{ds.name}: warning: {ds.unknown_docs} qrels rows name documents missing from the corpus")
    settings = {
        "split": split,
        "search": "exact inner product on L2-normalised vectors (cosine), numpy",
        "document_text": 'title + " " + text, truncated to the model max_length tokens',
        "datasets": described,
    }
    seconds = {"total": time.perf_counter() - start, "encode": encode_seconds}
    return grid_result(
        "retrieval", METRICS, names, scores, embedder.cells(), model_record(embedder), settings, seconds, started
    )
