"""The cascade and the shallow query exit, evaluated against flat search (`eval retrieval --cascade` /
`--query-layer`): nDCG@10 and the share of flat's top 10 each keeps, on a BEIR-format set.

Encoding the corpus is nearly all of the cost. With a document cache folder (`--doc-cache`), the documents'
pooled layer states before any exit head are kept there, keyed by what makes them (cache_keys.cache_key, the key
recorded in the file and compared on read): the backbone's checksum (not the exit heads') and configuration, the
tokenizer, pooling, maximum length, device type and dtype, and the documents' texts hashed with their lengths; the
file is signed under this machine's key (models.signing). Models that share a backbone (with heads, without, with
other heads) then encode the corpus once; each applies its own heads to the states. A file under another key,
damaged, edited, or a link out of the folder is a miss: computed again and replaced.
"""

from __future__ import annotations

import os
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from matryoshka2d import outputs
from matryoshka2d.beir import BeirSet, load_beir
from matryoshka2d.cache_keys import cache_key, encoder_config_sha256, texts_sha256, tokenizer_sha256
from matryoshka2d.cells import unit_rows
from matryoshka2d.confined import OutsideFolderError, inside
from matryoshka2d.evaluate.results import model_record, provenance, provenance_lines
from matryoshka2d.evaluate.retrieval import rank_metrics
from matryoshka2d.models.query_record import query_encoder_layer, query_encoder_record
from matryoshka2d.models.signing import sign, signature_holds
from matryoshka2d.retrieval.faiss_indexes import make_index
from matryoshka2d.retrieval.search import cascade_search, flat_search
from matryoshka2d.retrieval.shards import RESCORED_STORAGES, STORAGES


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
    query_layers: Sequence[int] | int | None = None,
    batch_size: int = 64,
    log: Callable[[str], None] | None = None,
    show_progress: bool = True,
    doc_cache: str | Path | None = None,
    query_encoders: Sequence = (),
    storages: Sequence[str] = (),
) -> dict:
    """Flat search at the full cell next to a cascade (small cell shortlist, full cell rerank) and/or queries
    encoded at shallow layers (`query_layers`: one or several, each its own rows) against full-depth documents,
    on faiss flat indexes. The documents are encoded once for every mode and layer.

    Each row reports nDCG@10, recall@10, how much of flat full-cell search's top 10 it finds, and per-query
    latency split into query encoding (one query at a time is not what a server does, so the whole query set
    is encoded in batches and divided) and search (one query at a time, as a server would). `doc_cache`: a
    folder for the documents' pooled states (see the module docstring). `query_encoders`: students distilled
    from `encoder` with `distill --mode query`, each a row of its own queries against the full cell's documents.
    `storages`: the full cell's documents held as an index of that storage holds them (float16, int8, int8-direct,
    binary; the last two a shortlist of `shortlist` rescored with float16 vectors, as `search` does), each a row.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    full = cascade[1] if cascade else (encoder.num_layers, encoder.hidden_size)
    for n, d in [*(cascade or ()), full]:
        encoder.check_layer(n), encoder.check_dim(d)
    if isinstance(query_layers, int):
        query_layers = [query_layers]
    query_layers = sorted({encoder.check_layer(n) for n in query_layers or ()})
    if query_layers and query_layers[0] == 0:
        raise ValueError(
            f"--query-layer 0: {encoder.name}'s static cell is scored as a query encoder; pass its folder as "
            "--query-model (the documents stay the full model's)"
        )
    if query_layers and query_layers[-1] > full[0]:
        raise ValueError(
            f"--query-layer {query_layers[-1]} is deeper than the documents of the full cell {full[0]}:{full[1]}: "
            f"queries exit at most at the documents' layer; use --query-layer {full[0]} or less"
        )
    _check_query_encoders(encoder, query_encoders, full)
    unknown = [s for s in storages if s not in STORAGES]
    if unknown:
        raise ValueError(f"--storage {', '.join(unknown)}: choose from {', '.join(STORAGES)}")
    if (cascade or any(s in RESCORED_STORAGES for s in storages)) and shortlist < 10:
        raise ValueError(f"--shortlist {shortlist} is below the 10 results nDCG@10 needs")
    sets = [load_beir(d, split) for d in directories]
    started, start = provenance(), time.perf_counter()
    rows = []
    for ds in sets:
        rows += _cascade_rows(
            encoder,
            ds,
            cascade,
            full,
            shortlist,
            query_layers,
            batch_size,
            log,
            show_progress,
            doc_cache,
            query_encoders,
            storages,
        )
    result = {
        "task": "retrieval-cascade",
        "datasets": [s.name for s in sets],
        "cascade": [list(c) for c in cascade] if cascade else None,
        "shortlist": shortlist if cascade else None,
        "query_layers": query_layers,
        "query_encoders": [model_record(e) for e in query_encoders],
        "storages": list(storages),
        "rows": rows,
        "model": model_record(encoder),
        "settings": {
            "split": split,
            "search": "faiss IndexFlatIP on L2-normalised vectors; one query per search call",
            "query_encode_ms": "whole query set encoded in batches of the batch size, time divided by queries",
            "documents": {s.name: len(s.doc_ids) for s in sets},
            "doc_cache": str(doc_cache) if doc_cache else None,
            "queries": {s.name: len(s.query_ids) for s in sets},
        },
        "seconds": {"total": time.perf_counter() - start},
        "provenance": started,
    }
    result["provenance"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


DOC_CACHE_KIND = "retrieval-document-states"  # the cache kind in the key


def tokenizer_digest(encoder) -> str:
    """The checksum of the tokenizer an encoder tokenizes with, as loaded (cache_keys.tokenizer_sha256)."""
    return tokenizer_sha256(encoder.tokenizer)


def document_cache_key(encoder, texts: Sequence[str]) -> str:
    """The key of the documents' pooled states (cache_keys.cache_key): the backbone's weights (not the exit heads',
    applied after) and configuration, the tokenizer (as loaded, every setting), max length, pooling, the width of
    the pooled states, the texts hashed with their lengths, and the device type and dtype the states were computed
    in."""
    from matryoshka2d.models.identity import backbone_sha256

    return cache_key(
        DOC_CACHE_KIND,
        weights_sha256=backbone_sha256(encoder),
        config_sha256=encoder_config_sha256(encoder),
        tokenizer_sha256=tokenizer_digest(encoder),
        max_length=encoder.max_length,
        pooling=encoder.pooling,
        widths=[encoder.transformer_size],
        texts_sha256=texts_sha256(texts),
        device=encoder.device.type,
        dtype=str(next(encoder.parameters()).dtype),
    )


def _signed_states(arrays: Iterable[tuple[str, np.ndarray]]) -> Iterator[bytes]:
    """What a document cache file's signature covers: each array's name, dtype and shape (framed by their length),
    then its bytes, in the order given (by name)."""
    for name, array in arrays:
        header = f"{name}|{array.dtype.str}|{array.shape}".encode()
        yield len(header).to_bytes(8, "big") + header
        yield np.ascontiguousarray(array).tobytes()


def read_document_cache(path: Path, key: str, rows: int, layers: Sequence[int]) -> dict[int, np.ndarray] | None:
    """The pooled states of `layers` the cache file at `path` holds, or None (a miss: compute them) unless it is a
    whole file of this cache, under this exact key (recorded in it, compared here: a file renamed or copied under
    another key's name is a miss), whose signature (models.signing: every array under the key, this machine's key)
    holds, with `rows` rows per layer. A link out of the cache folder is a miss, never opened; so is a damaged file
    or an edited one, its rows changed by hand. Checking costs one read of the file, as loading it does."""
    try:
        inside(path.parent, path.name, path.parent, "the document cache file")
    except OutsideFolderError:
        return None
    if not path.is_file():
        return None
    try:
        stored = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    if not isinstance(stored, np.lib.npyio.NpzFile):  # a single array (.npy bytes): not a file of this cache
        return None
    try:
        with stored:
            if "cache_key" not in stored.files or str(stored["cache_key"]) != key or "signature" not in stored.files:
                return None
            if not all(f"layer{n}" in stored.files for n in layers):
                return None
            arrays = {name: stored[name] for name in sorted(stored.files) if name.startswith("layer")}
            if not signature_holds(key, _signed_states(arrays.items()), str(stored["signature"])):
                return None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    pooled = {n: arrays[f"layer{n}"] for n in layers}
    if any(v.ndim != 2 or len(v) != rows for v in pooled.values()):
        return None
    return pooled


def document_states(encoder, texts: Sequence[str], layers: Sequence[int], batch_size: int, progress: bool, cache):
    """Full-width document vectors per layer, as the encoder makes them (through its exit heads when on), and
    the cache file used; the pooled states under them come from `cache` when it holds them under this key
    (document_cache_key) with every layer needed, else they are computed and the file (re)written."""
    layers = sorted(set(layers))
    reads = encoder.pooled_inputs(layers)  # the layers, and those their exit heads also read
    pooled, path = None, None
    if cache is not None:
        key = document_cache_key(encoder, texts)
        path = Path(cache) / f"docs-{key[:24]}.npz"
        pooled = read_document_cache(path, key, len(texts), reads)
    if pooled is None:
        # every layer up to the deepest: the pass runs them all anyway, and a later run may ask for others
        wanted = sorted(set(range(1, max(layers) + 1)) | set(reads)) if path is not None else reads
        pooled = encoder.pooled_states(texts, wanted, batch_size, show_progress=progress, pooled=True)
        if path is not None:
            # the one writer: a temporary file beside, renamed when whole (a killed run never leaves half a cache
            # file; a link in its place is replaced, never written through), the key and the signature inside
            arrays = {f"layer{n}": v for n, v in sorted(pooled.items())}
            signature = sign(key, _signed_states(sorted(arrays.items())))
            with outputs.writing(path, "--doc-cache") as tmp:
                np.savez(tmp, cache_key=np.array(key), signature=np.array(signature), **arrays)
    return encoder.cells_from_pooled(pooled, layers, encoder.use_heads), path


def _check_query_encoders(encoder, students: Sequence, full) -> None:
    """Each query encoder must be distilled from `encoder` (the documents' model), for its last layer."""
    if not students:
        return
    from matryoshka2d.models.query_record import (
        check_query_cells,
        check_query_encoder,
        documents_identity,
        query_encoder_record,
    )

    documents = documents_identity(encoder)
    for student in students:
        record = query_encoder_record(student)
        if record is None:
            raise ValueError(
                f"--query-model {student.name}: not a query encoder (its folder has no `distill` record of "
                "--mode query or static); make one with `matryoshka2d distill --mode query` or `--mode static`"
            )
        check_query_encoder(record, student.name, documents, "--query-model")
        check_query_cells(record, student.name, [full], "--query-model")


def _cascade_rows(
    encoder,
    ds: BeirSet,
    cascade,
    full,
    shortlist,
    query_layers,
    batch_size,
    log,
    progress,
    doc_cache,
    query_encoders=(),
    storages=(),
) -> list[dict]:
    """The rows of one dataset: documents encoded once at every layer any mode needs, then each mode's queries
    searched one at a time (flat full cell first: the reference of the overlap)."""
    doc_layers = sorted({full[0], *([cascade[0][0]] if cascade else []), *query_layers})
    t0 = time.perf_counter()
    docs, cached = document_states(encoder, ds.doc_texts, doc_layers, batch_size, progress, doc_cache)
    seconds = time.perf_counter() - t0
    where = f" (pooled states: {cached})" if cached else ""
    log(f"{ds.name}: {len(ds.doc_texts)} documents at layers {doc_layers} in {seconds:.1f} s{where}")
    search = _DatasetSearch(encoder, ds, docs, batch_size)
    modes = _flat_modes(search, full, storages, shortlist)
    if cascade:
        modes.append(_cascade_mode(search, cascade[0], full, shortlist))
    for query_layer in query_layers:
        modes += _query_layer_modes(search, query_layer, full)
    for student in query_encoders:
        modes.append(_query_encoder_mode(search, student, full))
    reference = modes[0][1]
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


class _DatasetSearch:
    """One dataset's documents (full-width vectors per layer) and its queries, searched one at a time: a flat index
    per document cell, made once; the time to encode the queries and to search, each per query."""

    def __init__(self, encoder, ds: BeirSet, docs: dict[int, np.ndarray], batch_size: int):
        self.encoder, self.ds, self.docs, self.batch_size = encoder, ds, docs, batch_size
        position = {d: i for i, d in enumerate(ds.doc_ids)}
        self.exclude = np.array([position.get(q, -1) for q in ds.query_ids])
        self.indexes: dict = {}
        self.n_queries = len(ds.query_texts)

    def index(self, cell):
        if cell not in self.indexes:
            self.indexes[cell] = make_index(unit_rows(self.docs[cell[0]][:, : cell[1]]), "flat", "float32")
        return self.indexes[cell]

    def queries(self, layers) -> tuple[dict[int, np.ndarray], float]:
        """The queries' vectors at `layers` and the seconds per query."""
        t = time.perf_counter()
        pooled = self.encoder.pooled_states(self.ds.query_texts, sorted(set(layers)), self.batch_size)
        return pooled, (time.perf_counter() - t) / self.n_queries

    def one_by_one(self, search_one) -> tuple[np.ndarray, float]:
        """The rankings of every query, searched alone (`search_one(i)`), and the seconds per query."""
        t = time.perf_counter()
        parts = [search_one(i) for i in range(self.n_queries)]
        return np.concatenate(parts), (time.perf_counter() - t) / self.n_queries

    def searched(self, source):
        """An index, or a cell's flat index, made when the first query needs it (its making is timed with the
        search, as the first query of a fresh index pays for it)."""
        return self.index(source) if isinstance(source, tuple) else source

    def flat(self, source, q: np.ndarray) -> tuple[np.ndarray, float]:
        exclude = self.exclude
        return self.one_by_one(lambda i: flat_search(self.searched(source), q[i : i + 1], 10, exclude[i : i + 1])[0])

    def rescored(self, shortlisting, rescoring, qs: np.ndarray, qf: np.ndarray, shortlist: int):
        """A shortlist from `shortlisting` by the queries `qs`, rescored by `rescoring` with the queries `qf`."""
        exclude = self.exclude
        return self.one_by_one(
            lambda i: cascade_search(
                self.searched(shortlisting),
                self.searched(rescoring),
                qs[i : i + 1],
                qf[i : i + 1],
                shortlist,
                10,
                exclude[i : i + 1],
            )[0]
        )


def _flat_modes(search: _DatasetSearch, full, storages, shortlist: int) -> list[tuple]:
    """Flat search of the full cell, then of the same documents as an index of each storage holds them."""
    pooled, enc = search.queries([full[0]])
    q = unit_rows(pooled[full[0]][:, : full[1]])
    ranking, sec = search.flat(full, q)
    modes = [(f"flat ({full[0]},{full[1]})", ranking, enc, sec)]
    full_docs = unit_rows(search.docs[full[0]][:, : full[1]]) if storages else None
    for storage in storages:
        stored = make_index(full_docs, "flat", storage)
        if storage in RESCORED_STORAGES:
            ranking, sec = search.rescored(stored, full_docs.astype(np.float16), q, q, shortlist)
            how = f"{'Hamming' if storage == 'binary' else 'int8'} shortlist {shortlist}, float16 rescoring"
            modes.append((f"flat ({full[0]},{full[1]}) stored as {storage} ({how})", ranking, enc, sec))
        else:
            ranking, sec = search.flat(stored, q)
            modes.append((f"flat ({full[0]},{full[1]}) stored as {storage}", ranking, enc, sec))
    return modes


def _cascade_mode(search: _DatasetSearch, small, full, shortlist: int) -> tuple:
    """A shortlist from the small cell's index, rescored by the full cell's."""
    pooled, enc = search.queries([small[0], full[0]])
    qs, qf = unit_rows(pooled[small[0]][:, : small[1]]), unit_rows(pooled[full[0]][:, : full[1]])
    ranking, sec = search.rescored(small, full, qs, qf, shortlist)
    return (f"cascade ({small[0]},{small[1]}) top {shortlist} -> ({full[0]},{full[1]})", ranking, enc, sec)


def _query_layer_modes(search: _DatasetSearch, query_layer: int, full) -> list[tuple]:
    """Queries at a shallow layer against the full cell's documents, and against documents at that layer too."""
    pooled, enc = search.queries([query_layer])
    qa = unit_rows(pooled[query_layer][:, : full[1]])
    ranking, sec = search.flat(full, qa)
    modes = [(f"queries at layer {query_layer} -> docs ({full[0]},{full[1]})", ranking, enc, sec)]
    sym = (query_layer, full[1])
    ranking, sec = search.flat(sym, qa)
    modes.append((f"flat ({sym[0]},{sym[1]}) (queries and docs at layer {query_layer})", ranking, enc, sec))
    return modes


def _query_encoder_mode(search: _DatasetSearch, student, full) -> tuple:
    """A distilled query encoder's queries (at its last layer, or its static cell) against the full cell."""
    t = time.perf_counter()
    top = query_encoder_layer(query_encoder_record(student), student)
    qa = unit_rows(student.pooled_states(search.ds.query_texts, [top], search.batch_size)[top][:, : full[1]])
    enc = (time.perf_counter() - t) / search.n_queries
    ranking, sec = search.flat(full, qa)
    runs = f"{top} layers" if top else "its static cell, layer 0"
    return (f"query encoder {student.name} ({runs}) -> docs ({full[0]},{full[1]})", ranking, enc, sec)


def cascade_markdown(result: dict) -> str:
    lines = [
        f"# Cascade / asymmetric retrieval: {result['model']['model']}",
        "",
        *provenance_lines(result["provenance"]),
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
