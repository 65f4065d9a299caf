"""Retrieval in the BEIR layout: exact inner-product search on unit vectors, nDCG@10, MRR@10 and Recall@100.

A dataset folder holds `corpus.jsonl` (or `corpus.jsonl.gz`) with `_id, title, text`, `queries.jsonl` with
`_id, text`, and `qrels/<split>.tsv` with `query-id, corpus-id, score`. As in BEIR and sentence-transformers,
a document is embedded as `title + " " + text` (stripped), truncated to the encoder's max_length tokens
(256 for minilm-l6, 384 for mpnet-base: longer abstracts are cut, as they are in BEIR's own numbers); only
queries with at least one relevant document (score > 0) are evaluated, and a document whose id equals the
query's id is never returned (BEIR's ignore_identical_ids). Corpus and queries are embedded once for all cells;
search is an exact matrix product per cell, in chunks of queries.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from matryoshka2d.evaluate.grid import CellEmbedder, embed_distinct, unit_rows
from matryoshka2d.evaluate.io import DataFormatError, read_jsonl, read_tsv
from matryoshka2d.evaluate.results import finish, provenance

METRICS = ("ndcg@10", "mrr@10", "recall@100")
DEPTH = 100  # the deepest rank any metric looks at


@dataclass
class BeirSet:
    """A corpus, the evaluated queries and their graded relevance judgements (qrels)."""

    name: str
    directory: Path
    split: str
    doc_ids: list[str]
    doc_texts: list[str]
    query_ids: list[str]
    query_texts: list[str]
    qrels: list[dict[int, int]]  # per evaluated query: document index -> relevance (> 0 only)
    unknown_docs: int  # qrels rows naming a document the corpus does not have (never retrievable)


def corpus_file(directory: Path) -> Path:
    for name in ("corpus.jsonl", "corpus.jsonl.gz"):
        if (directory / name).is_file():
            return directory / name
    raise DataFormatError(f"{directory}: no corpus.jsonl or corpus.jsonl.gz")


def _read_records(path: Path, need_title: bool) -> tuple[list[str], list[str]]:
    ids, texts, seen = [], [], {}
    for line, obj in read_jsonl(path):
        if "_id" not in obj:
            raise DataFormatError(f"{path} line {line}: no '_id' field")
        if not isinstance(obj.get("text"), str):
            raise DataFormatError(f"{path} line {line}: no 'text' string field")
        key = str(obj["_id"])
        if key in seen:
            raise DataFormatError(f"{path} line {line}: _id {key!r} already used on line {seen[key]}")
        seen[key] = line
        text = obj["text"]
        if need_title:
            title = obj.get("title") or ""
            text = (f"{title} {text}" if title else text).strip()
        ids.append(key)
        texts.append(text)
    if not ids:
        raise DataFormatError(f"{path}: empty file")
    return ids, texts


def load_beir(directory: str | Path, split: str = "test") -> BeirSet:
    """Read and cross-check a BEIR folder; unknown query ids in the qrels are an error naming the line."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataFormatError(f"{directory}: dataset directory not found")
    doc_ids, doc_texts = _read_records(corpus_file(directory), need_title=True)
    all_qids, all_qtexts = _read_records(directory / "queries.jsonl", need_title=False)
    qrels_path = directory / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        have = sorted(p.stem for p in (directory / "qrels").glob("*.tsv")) if (directory / "qrels").is_dir() else []
        raise DataFormatError(f"{qrels_path}: file not found (splits here: {', '.join(have) or 'none'}; see --split)")
    table = read_tsv(qrels_path, required=("query-id", "corpus-id", "score"))
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    query_index = {q: i for i, q in enumerate(all_qids)}
    judged: dict[int, dict[int, int]] = {}
    unknown_docs = 0
    qi, di, si = table.column("query-id"), table.column("corpus-id"), table.column("score")
    for line, row in table.rows:
        try:
            score = int(row[si])
        except ValueError:
            raise DataFormatError(f"{qrels_path} line {line}: score {row[si]!r} is not an integer") from None
        if row[qi] not in query_index:
            raise DataFormatError(f"{qrels_path} line {line}: query-id {row[qi]!r} is not in queries.jsonl")
        if row[di] not in doc_index:
            unknown_docs += 1
            continue
        if score > 0:
            judged.setdefault(query_index[row[qi]], {})[doc_index[row[di]]] = score
    if not judged:
        raise DataFormatError(f"{qrels_path}: no query has a relevant document (score > 0) in the corpus")
    order = sorted(judged)
    return BeirSet(
        name=directory.name,
        directory=directory,
        split=split,
        doc_ids=doc_ids,
        doc_texts=doc_texts,
        query_ids=[all_qids[i] for i in order],
        query_texts=[all_qtexts[i] for i in order],
        qrels=[judged[i] for i in order],
        unknown_docs=unknown_docs,
    )


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
) -> dict:
    """Evaluate every cell of `embedder` on each BEIR folder; return a result dict (see results.py)."""
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
    cell_list = embedder.cells()
    result = {
        "task": "retrieval",
        "metric": "ndcg@10",
        "metrics": list(METRICS),
        "datasets": names,
        "layers": sorted({n for n, _ in cell_list}),
        "dims": sorted({d for _, d in cell_list}),
        "scores": sorted(scores, key=lambda r: (names.index(r["dataset"]), r["layer"], r["dim"])),
        "model": embedder.info(),
        "settings": {
            "split": split,
            "search": "exact inner product on L2-normalised vectors (cosine), numpy",
            "document_text": 'title + " " + text, truncated to the model max_length tokens',
            "datasets": described,
        },
        "seconds": {"total": time.perf_counter() - start, "encode": encode_seconds},
        "provenance": started,
    }
    return finish(result)


def recall_at(ranking: np.ndarray, qrels: list[dict[int, int]], k: int = 10) -> float:
    """Mean share of each query's relevant documents found in its top k, x 100."""
    return 100 * float(
        np.mean(
            [
                sum(1 for d in ranked[:k] if rel.get(int(d), 0) > 0) / len(rel)
                for ranked, rel in zip(ranking, qrels, strict=True)
            ]
        )
    )


def overlap_at(ranking: np.ndarray, reference: np.ndarray, k: int = 10) -> float:
    """Mean share of the reference's top k that a ranking also has in its top k, x 100."""
    shares = []
    for mine, ref in zip(ranking[:, :k], reference[:, :k], strict=True):
        want = {int(d) for d in ref if d >= 0}
        shares.append(len(want & {int(d) for d in mine}) / max(len(want), 1))
    return 100 * float(np.mean(shares))


def evaluate_cascade(
    encoder,
    directories: Sequence[str | Path],
    split: str,
    cascade: tuple[tuple[int, int], tuple[int, int]] | None,
    shortlist: int = 100,
    query_layer: int | None = None,
    batch_size: int = 64,
    log: Callable[[str], None] | None = None,
    show_progress: bool = True,
) -> dict:
    """Flat search at the full cell next to a cascade (small cell shortlist, full cell rerank) and/or queries
    encoded at a shallow layer against full-depth documents, on faiss flat indexes.

    Each row reports nDCG@10, recall@10, how much of flat full-cell search's top 10 it finds, and per-query
    latency split into query encoding (one query at a time is not what a server does, so the whole query set
    is encoded in batches and divided) and search (one query at a time, as a server would).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    full = cascade[1] if cascade else (encoder.num_layers, encoder.hidden_size)
    for n, d in [*(cascade or ()), full]:
        encoder.check_layer(n), encoder.check_dim(d)
    if query_layer is not None:
        encoder.check_layer(query_layer)
    if cascade and shortlist < 10:
        raise ValueError(f"--shortlist {shortlist} is below the 10 results nDCG@10 needs")
    sets = [load_beir(d, split) for d in directories]
    started, start = provenance(), time.perf_counter()
    rows = []
    for ds in sets:
        rows += _cascade_rows(encoder, ds, cascade, full, shortlist, query_layer, batch_size, log, show_progress)
    result = {
        "task": "retrieval-cascade",
        "datasets": [s.name for s in sets],
        "cascade": [list(c) for c in cascade] if cascade else None,
        "shortlist": shortlist if cascade else None,
        "query_layer": query_layer,
        "rows": rows,
        "model": encoder.info(),
        "settings": {
            "split": split,
            "search": "faiss IndexFlatIP on L2-normalised vectors; one query per search call",
            "query_encode_ms": "whole query set encoded in batches of the batch size, time divided by queries",
            "documents": {s.name: len(s.doc_ids) for s in sets},
            "queries": {s.name: len(s.query_ids) for s in sets},
        },
        "seconds": {"total": time.perf_counter() - start},
        "provenance": started,
    }
    result["provenance"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _cascade_rows(encoder, ds: BeirSet, cascade, full, shortlist, query_layer, batch_size, log, progress) -> list[dict]:
    """The rows of one dataset: documents encoded once at every layer any mode needs."""
    from matryoshka2d.retrieval.index import make_index
    from matryoshka2d.retrieval.search import cascade_search, flat_search, unit

    doc_layers = sorted({full[0], *([cascade[0][0]] if cascade else []), *([query_layer] if query_layer else [])})
    t0 = time.perf_counter()
    docs = encoder.pooled_states(ds.doc_texts, doc_layers, batch_size, show_progress=progress)
    log(f"{ds.name}: {len(ds.doc_texts)} documents at layers {doc_layers} in {time.perf_counter() - t0:.1f} s")
    position = {d: i for i, d in enumerate(ds.doc_ids)}
    exclude = np.array([position.get(q, -1) for q in ds.query_ids])
    indexes = {}
    n_queries = len(ds.query_texts)

    def index(cell):
        if cell not in indexes:
            indexes[cell] = make_index(unit(docs[cell[0]][:, : cell[1]]), "flat", "float32")
        return indexes[cell]

    def queries(layers):
        t = time.perf_counter()
        pooled = encoder.pooled_states(ds.query_texts, sorted(set(layers)), batch_size)
        return pooled, (time.perf_counter() - t) / n_queries

    def one_by_one(search_one):
        t = time.perf_counter()
        parts = [search_one(i) for i in range(n_queries)]
        return np.concatenate(parts), (time.perf_counter() - t) / n_queries

    def flat_one(cell, q):
        return lambda i: flat_search(index(cell), q[i : i + 1], 10, exclude[i : i + 1])[0]

    modes = []
    pooled, enc = queries([full[0]])
    ranking, sec = one_by_one(flat_one(full, unit(pooled[full[0]][:, : full[1]])))
    reference = ranking
    modes.append((f"flat ({full[0]},{full[1]})", ranking, enc, sec))
    if cascade:
        small = cascade[0]
        pooled, enc = queries([small[0], full[0]])
        qs, qf = unit(pooled[small[0]][:, : small[1]]), unit(pooled[full[0]][:, : full[1]])
        ranking, sec = one_by_one(
            lambda i: cascade_search(
                index(small), index(full), qs[i : i + 1], qf[i : i + 1], shortlist, 10, exclude[i : i + 1]
            )[0]
        )
        modes.append((f"cascade ({small[0]},{small[1]}) top {shortlist} -> ({full[0]},{full[1]})", ranking, enc, sec))
    if query_layer:
        pooled, enc = queries([query_layer])
        qa = unit(pooled[query_layer][:, : full[1]])
        ranking, sec = one_by_one(flat_one(full, qa))
        modes.append((f"queries at layer {query_layer} -> docs ({full[0]},{full[1]})", ranking, enc, sec))
        sym = (query_layer, full[1])
        ranking, sec = one_by_one(flat_one(sym, qa))
        modes.append((f"flat ({sym[0]},{sym[1]}) (queries and docs at layer {query_layer})", ranking, enc, sec))
    rows = []
    for name, ranking, enc, sec in modes:
        metrics = rank_metrics(ranking, ds.qrels)
        rows.append(
            {
                "dataset": ds.name,
                "mode": name,
                "ndcg@10": metrics["ndcg@10"],
                "recall@10": recall_at(ranking, ds.qrels, 10),
                "overlap@10_with_flat": overlap_at(ranking, reference, 10),
                "query_encode_ms": 1000 * enc,
                "search_ms": 1000 * sec,
            }
        )
        log(f"  {name}: nDCG@10 {metrics['ndcg@10']:.2f}")
    return rows


def cascade_markdown(result: dict) -> str:
    prov = result["provenance"]
    lines = [
        f"# Cascade / asymmetric retrieval: {result['model']['model']}",
        "",
        f"- date: {prov['date']}; machine: {prov['machine']}; {prov['software']}",
        f"- load average at start / end: {prov['load_average_at_start']} / {prov['load_average_at_end']}",
        f"- command: `{prov['command']}`",
        f"- {result['settings']['search']}; {result['settings']['query_encode_ms']}",
        "",
        "| dataset | mode | nDCG@10 | recall@10 | top-10 overlap with flat | query encode ms | search ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['dataset']} | {r['mode']} | {r['ndcg@10']:.2f} | {r['recall@10']:.2f} | "
            f"{r['overlap@10_with_flat']:.1f}% | {r['query_encode_ms']:.2f} | {r['search_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"
