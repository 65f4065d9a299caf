"""Search an index built by `matryoshka2d index build`: flat, cascade and asymmetric (shallow-query) search.

- flat: the query's vector at one cell against that cell's index.
- cascade: a shortlist from a small cell's index (cheap: few numbers per vector), reranked exactly with the
  query's and the documents' vectors at a full cell. Both query vectors come from one encoder pass up to the
  deeper of the two layers; the documents' full vectors are read back from the full cell's faiss index, or from
  its float16 file (memory-mapped: only the shortlist's rows are read) when the build stored one.
- binary storage: a cell's index holds sign bits; its search is a Hamming shortlist (`shortlist` long) rescored
  with the float query against the cell's float16 vectors, the same rerank as a cascade's.
- int8-direct storage: a cell's index holds int8 numbers under one scale; its search too is a shortlist from
  that index rescored with the cell's float16 vectors, so the scores are the float ones.
- asymmetric: `query_layer=n` encodes queries with only n layers and compares them with documents encoded at
  the index's (deeper) layers. Only a model trained for it (methods/asymmetric.py) puts layer-n queries in the
  last layer's space; on other models it shows how far apart the spaces are. A query exit deeper than the
  documents' layer is refused: it would cost more than the documents' own exit and no method trains it.

Before a search, the index is checked against what `index build` recorded: the query model's weights checksum
and pooling against the manifest's, each file's size and sha256, and each faiss index's width and count. The
folder is read through the confined reader (confined.ConfinedFolder): one holding a link that leaves it (an ids.txt
or a manifest.json linked to a file elsewhere) is refused before anything in it is opened.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from matryoshka2d.cells import Cell, unit_rows
from matryoshka2d.files import file_sha256
from matryoshka2d.retrieval.faiss_indexes import hnsw_graph, searchable
from matryoshka2d.retrieval.shards import (
    RESCORED_STORAGES,
    IndexBuildError,
    cell_name,
    confined_index,
    index_path,
    read_manifest,
)


def _drop_excluded(ids: np.ndarray, scores: np.ndarray, exclude: np.ndarray | None, k: int):
    """Remove each row's excluded id (BEIR's ignore_identical_ids) and keep k columns (-1 pads)."""
    if exclude is not None:
        hit = ids == exclude[:, None]
        scores = np.where(hit, -np.inf, scores)
        order = np.argsort(-scores, axis=1, kind="stable")
        ids, scores = np.take_along_axis(ids, order, 1), np.take_along_axis(scores, order, 1)
        ids = np.where(np.isneginf(scores), -1, ids)
    return ids[:, :k], scores[:, :k]


def flat_search(index, queries: np.ndarray, k: int, exclude: np.ndarray | None = None):
    """(ids, scores), best first, of the k highest inner products in a faiss index."""
    extra = 0 if exclude is None else 1
    scores, ids = index.search(np.ascontiguousarray(queries, dtype=np.float32), k + extra)
    return _drop_excluded(ids, scores, exclude, k)


def stored_vectors(index, ids: np.ndarray) -> np.ndarray:
    """The vectors a faiss index holds for `ids` (decoded from float16 / int8 storage when it is quantised), or
    the rows of an array of vectors (a memory-mapped float16 file reads only those rows)."""
    if isinstance(index, np.ndarray):
        # np.memmap's indexing builds a memmap of the rows (6 us a call); a plain view of its pages does not
        source = index.view(np.ndarray) if isinstance(index, np.memmap) else index
        rows = source[np.asarray(ids, dtype=np.int64)]
        if rows.dtype == np.float16:
            # numpy widens float16 one number at a time; torch's vectorised conversion gives the same numbers
            # (every float16 is a float32) about 6x faster: for a shortlist of 200 rows of 384 it was most of a
            # rerank, 0.13 of 0.15 ms a query (docs/benchmarks.md, issue 20)
            import torch

            return torch.from_numpy(np.ascontiguousarray(rows)).float().numpy()
        return rows.astype(np.float32, copy=False)
    return index.reconstruct_batch(np.ascontiguousarray(ids, dtype=np.int64))


def shortlist_search(index, queries: np.ndarray, n: int) -> np.ndarray:
    """The ids of the n best documents by an index's own measure: inner product, or Hamming distance between
    sign bits for a faiss binary index."""
    import faiss

    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if isinstance(index, faiss.IndexBinary):
        from matryoshka2d.retrieval.faiss_indexes import sign_bits

        _, ids = index.search(sign_bits(queries), n)
    else:
        _, ids = index.search(queries, n)
    return ids


def cascade_search(
    small_index,
    full_index,
    small_queries: np.ndarray,
    full_queries: np.ndarray,
    shortlist: int,
    k: int,
    exclude: np.ndarray | None = None,
):
    """Shortlist from the small cell's index, rerank by exact inner product with the full cell's stored vectors."""
    if shortlist < k:
        raise ValueError(f"--shortlist {shortlist} is smaller than --top-k {k}; the rerank can only reorder it")
    extra = 0 if exclude is None else 1
    candidates = shortlist_search(small_index, small_queries, shortlist + extra)
    q, s = candidates.shape
    # Every numpy call here costs microseconds, as much as the rerank's arithmetic at a short list: the usual
    # case (a full shortlist, nothing excluded) skips the masking, and rows are picked by plain indexing.
    valid = candidates >= 0
    full_list = bool(valid.all())
    rows = stored_vectors(full_index, (candidates if full_list else np.where(valid, candidates, 0)).ravel())
    scores = np.matmul(rows.reshape(q, s, -1), full_queries.astype(np.float32)[:, :, None])[:, :, 0]  # BLAS
    if not full_list:
        scores[~valid] = -np.inf
    if exclude is not None:
        scores[candidates == exclude[:, None]] = -np.inf
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    picked = np.arange(q)[:, None], top
    ids, top_scores = candidates[picked], scores[picked]
    if full_list and exclude is None:
        return ids, top_scores
    return np.where(np.isneginf(top_scores), -1, ids), top_scores


def query_vectors(
    encoder,
    texts: Sequence[str],
    cells: Sequence[Cell],
    query_layer: int | None = None,
    batch_size=64,
    query_encoder: int | None = None,
):
    """Unit query vectors per cell from one encoder pass (to the deepest layer needed, or to `query_layer`). A
    distilled query encoder (`query_encoder`: the layer its queries are encoded at, identity.query_encoder_layer)
    runs to that layer; a cell (N, d) of its teacher's documents takes the first d numbers of its output."""
    if query_encoder is not None:
        pooled = encoder.pooled_states(list(texts), [query_encoder], batch_size)[query_encoder]
        return {(n, d): unit_rows(pooled[:, :d]) for n, d in cells}
    layers = {n if query_layer is None else query_layer for n, _ in cells}
    pooled = encoder.pooled_states(list(texts), sorted(layers), batch_size)
    return {(n, d): unit_rows(pooled[n if query_layer is None else query_layer][:, :d]) for n, d in cells}


@dataclass
class Hits:
    ids: list[list[str]]  # per query, best first
    scores: list[list[float]]
    encode_seconds: float
    search_seconds: float
    description: str


REBUILD = "rebuild the index with `matryoshka2d index build ... --overwrite`"


class SearchIndex:
    """What a search does on any backend: the checks every search runs, the queries encoded once up to the
    deepest cell (timed apart from the search) and the answer as Hits. CellIndex (faiss files) and
    qdrant_store.QdrantIndex (a collection) say which cells they hold, what else they check, and how they search.
    """

    cells: list[Cell]

    @property
    def full_cell(self) -> Cell:
        return max(self.cells)

    def check_encoder(self, encoder) -> None:
        raise NotImplementedError

    def check_search(self, encoder, cells: list[Cell], cascade, shortlist: int, top_k: int, query_layer) -> None:
        """The backend's own checks of a search's cells and settings, before any query is encoded."""
        raise NotImplementedError

    def check_query_layer(self, query_layer: int, cells: Sequence[Cell]) -> None:
        """Asymmetric search runs queries through fewer layers than the documents: a query exit deeper than a
        searched cell's documents is refused (it costs more than the documents' own exit, and no method trains a
        deep query against shallow documents)."""
        shallowest = min(cells)
        if query_layer > shallowest[0]:
            raise IndexBuildError(
                f"--query-layer {query_layer} is deeper than the documents of cell {shallowest[0]}:{shallowest[1]} "
                f"(encoded at layer {shallowest[0]}): queries exit at most at the documents' layer; use "
                f"--query-layer {shallowest[0]} or less, or search a deeper cell"
            )

    def run_search(self, vectors: dict[Cell, np.ndarray], cells: list[Cell], cascade, shortlist: int, top_k: int):
        """(ids, scores, description) of the search proper: the timed part."""
        raise NotImplementedError

    def named(self, ids, scores) -> tuple[list[list[str]], list[list[float]]]:
        """The search's ids and scores as document ids and floats (after the timed part)."""
        return ids, scores

    def search(
        self,
        encoder,
        texts: Sequence[str],
        cell: Cell | None = None,
        cascade: tuple[Cell, Cell] | None = None,
        shortlist: int = 100,
        top_k: int = 10,
        query_layer: int | None = None,
    ) -> Hits:
        from matryoshka2d.models.query_record import (
            check_query_cells,
            check_query_encoder,
            query_encoder_layer,
            query_encoder_record,
        )

        student = query_encoder_record(encoder)  # a query encoder distilled for the documents' model, or None
        if student is None:
            self.check_encoder(encoder)
        else:
            if query_layer is not None:
                raise ValueError(f"--query-layer: {encoder.name} is a query encoder; it always runs all its layers")
            check_query_encoder(student, encoder.name, self.manifest["model"], str(self.directory))
        if top_k < 1 or shortlist < 1:
            raise ValueError(f"--top-k and --shortlist must be at least 1 (got {top_k}, {shortlist})")
        cells = list(cascade) if cascade else [cell or self.full_cell]
        if student is not None:
            check_query_cells(student, encoder.name, cells, str(self.directory))
        self.check_search(encoder, cells, cascade, shortlist, top_k, query_layer)
        t0 = time.perf_counter()
        own = query_encoder_layer(student, encoder) if student is not None else None
        vectors = query_vectors(encoder, texts, cells, query_layer, query_encoder=own)
        t1 = time.perf_counter()
        ids, scores, what = self.run_search(vectors, cells, cascade, shortlist, top_k)
        t2 = time.perf_counter()
        if query_layer is not None or own == 0:
            what += f", queries at layer {own if own == 0 else query_layer}"
        ids, scores = self.named(ids, scores)
        return Hits(ids=ids, scores=scores, encode_seconds=t1 - t0, search_seconds=t2 - t1, description=what)


class CellIndex(SearchIndex):
    """The indexes of one build directory, loaded on first use; searched with an encoder of the same model."""

    def __init__(self, directory: str | Path, nprobe: int = 16, ef_search: int = 64):
        self.directory = Path(directory)
        for flag, value in (("--nprobe", nprobe), ("--ef-search", ef_search)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise IndexBuildError(f"{flag} must be at least 1, got {value!r}")
        self.manifest = read_manifest(self.directory)  # the folder's links checked before its manifest is read
        self.confined = confined_index(self.directory, check=False)
        if not self.manifest.get("complete"):
            raise IndexBuildError(
                f"{self.directory}: the build is not finished ({self.manifest.get('documents', 0)} documents so far); "
                "run the same `matryoshka2d index build` command again to resume it"
            )
        self.cells: list[Cell] = [Cell(*c) for c in self.manifest["cells"]]
        ids_path = self._checked_file("ids.txt")
        try:
            self.ids = ids_path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise IndexBuildError(f"{ids_path}: not UTF-8 text (byte {exc.start}); {REBUILD}") from None
        if len(self.ids) != self.manifest["documents"]:
            raise IndexBuildError(
                f"{ids_path}: {len(self.ids)} ids, but the index holds {self.manifest['documents']} documents "
                f"(manifest.json); {REBUILD}"
            )
        self.nprobe, self.ef_search = nprobe, ef_search
        self._indexes: dict[Cell, object] = {}
        self._rescoring: dict[Cell, np.ndarray] = {}

    def _checked_file(self, name: str) -> Path:
        """The file, after its size and sha256 matched what the build recorded (indexes built before the
        record was kept are checked by shape only, in `index`). A name that leads out of the directory (a link)
        is refused before the file is opened."""
        path = index_path(self.confined, name, "files")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from the index directory; {REBUILD}")
        want = self.manifest.get("files", {}).get(name)
        if want is not None:
            size = path.stat().st_size
            if size != want["bytes"]:
                raise IndexBuildError(
                    f"{path}: {size} bytes, but the build wrote {want['bytes']} (truncated or replaced); {REBUILD}"
                )
            if file_sha256(path) != want["sha256"]:
                raise IndexBuildError(
                    f"{path}: its sha256 differs from the one the build recorded in manifest.json (the file was "
                    f"changed or swapped with another); {REBUILD}"
                )
        return path

    def index(self, cell: Cell):
        if cell not in self.cells:
            have = ", ".join(f"{n}:{d}" for n, d in self.cells)
            raise IndexBuildError(f"{self.directory}: no index for cell {cell[0]}:{cell[1]} (cells here: {have})")
        if cell not in self._indexes:
            import faiss

            path = self._checked_file(f"{cell_name(cell)}.faiss")
            if path.stat().st_size == 0:
                raise IndexBuildError(f"{path}: empty, not a faiss index; {REBUILD}")
            try:
                index = faiss.read_index_binary(str(path)) if self.binary else faiss.read_index(str(path))
            except RuntimeError as exc:  # faiss reports a damaged file as a RuntimeError with its C++ context
                reason = str(exc).splitlines()[-1].split(": ", 1)[-1][:120]
                raise IndexBuildError(f"{path}: not a readable faiss index ({reason}); {REBUILD}") from None
            width = 8 * ((cell[1] + 7) // 8) if self.binary else cell[1]  # a binary index counts bits, in bytes
            if index.d != width or index.ntotal != len(self.ids):
                raise IndexBuildError(
                    f"{path}: holds {index.ntotal} vectors of {index.d} {'bits' if self.binary else 'numbers'}, but "
                    f"cell {cell[0]}:{cell[1]} of this index has {len(self.ids)} of {cell[1]} (a file of another "
                    f"cell or another build); {REBUILD}"
                )
            if self.manifest["index"] == "ivf":
                if self.binary:
                    index.nprobe = self.nprobe
                else:
                    faiss.extract_index_ivf(index).nprobe = self.nprobe
            elif self.manifest["index"] == "hnsw":
                hnsw_graph(index).efSearch = max(self.ef_search, 1)
            self._indexes[cell] = searchable(index)
        return self._indexes[cell]

    @property
    def binary(self) -> bool:
        return self.manifest["storage"] == "binary"

    @property
    def rescored(self) -> bool:
        """Whether this build's indexes only shortlist, to be rescored from the float16 files beside them."""
        return self.manifest["storage"] in RESCORED_STORAGES

    def rerank_vectors(self, cell: Cell):
        """What reranks at `cell`: its float16 vectors memory-mapped (binary and int8-direct builds), else its
        faiss index."""
        if not self.rescored:
            return self.index(cell)
        if cell not in self._rescoring:  # checked once, like the faiss files: the sha256 reads the whole file
            self._rescoring[cell] = np.load(self._checked_file(f"{cell_name(cell)}.f16.npy"), mmap_mode="r")
        return self._rescoring[cell]

    def check_encoder(self, encoder) -> None:
        """The query model must give the index's vectors at its cells: same depth and width, the same pooling, and
        the same weights (the manifest's weights_sha256), or the same backbone and the same exit head (or none) at
        each layer the index holds (its `vectors` record; models/identity.py, vectors_difference). A model of the
        same shape with other weights would return confident, meaningless neighbours."""
        from matryoshka2d.models.identity import vectors_difference

        want = self.manifest["model"]
        built = f"{want.get('model')}" + (f" ({want['location']})" if want.get("location") else "")
        if (encoder.num_layers, encoder.hidden_size) != (want["layers"], want["hidden_size"]):
            raise IndexBuildError(
                f"{self.directory}: built with {built} ({want['layers']} layers x {want['hidden_size']}), "
                f"but the query model {encoder.name} has {encoder.num_layers} x {encoder.hidden_size}"
            )
        differs = vectors_difference(want, self.manifest.get("vectors"), encoder, [n for n, _ in self.cells])
        if differs:
            raise IndexBuildError(f"{self.directory}: built with {built}, {differs}")
        if want.get("pooling") and encoder.pooling != want["pooling"]:
            raise IndexBuildError(
                f"{self.directory}: documents were pooled with {want['pooling']}, the query model with "
                f"{encoder.pooling}; pass --pooling {want['pooling']} (or leave it out)"
            )

    def check_search(self, encoder, cells: list[Cell], cascade, shortlist: int, top_k: int, query_layer) -> None:
        if query_layer is not None:
            self.check_query_layer(encoder.check_layer(query_layer), cells)
        for c in cells:
            self.index(c)  # load (and check) before timing

    def run_search(self, vectors: dict[Cell, np.ndarray], cells: list[Cell], cascade, shortlist: int, top_k: int):
        if cascade:
            small, full = cascade
            ids, scores = cascade_search(
                self.index(small), self.rerank_vectors(full), vectors[small], vectors[full], shortlist, top_k
            )
            what = f"cascade ({small[0]},{small[1]}) shortlist {shortlist} -> ({full[0]},{full[1]})"
        elif self.rescored:
            cell = cells[0]
            ids, scores = cascade_search(
                self.index(cell), self.rerank_vectors(cell), vectors[cell], vectors[cell], shortlist, top_k
            )
            shortlist_by = "Hamming" if self.binary else "int8"
            what = f"{self.manifest['storage']} ({cell[0]},{cell[1]}): {shortlist_by} shortlist {shortlist}, "
            what += "float16 rescoring"
        else:
            ids, scores = flat_search(self.index(cells[0]), vectors[cells[0]], top_k)
            what = f"flat ({cells[0][0]},{cells[0][1]})"
        return ids, scores, what

    def named(self, ids, scores) -> tuple[list[list[str]], list[list[float]]]:
        """faiss's row numbers as document ids, without the -1 padding of a short answer."""
        return (
            [[self.ids[i] for i in row if i >= 0] for row in ids],
            [
                [float(s) for s, i in zip(srow, row, strict=True) if i >= 0]
                for srow, row in zip(scores, ids, strict=True)
            ],
        )
