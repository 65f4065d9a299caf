"""Cells in a Qdrant collection, and the cascade as one server-side query.

One collection holds the corpus: a point per document (id = its position in the corpus, payload `doc_id` and
`text`) with one named vector per cell (`cell-<layer>x<dim>`, cosine). The full cell (the index's largest) is
kept on disk without an HNSW graph (`m=0`): it is only ever read for a shortlist. The smaller cells get Qdrant's
HNSW graph, optionally over Qdrant's scalar (int8) or binary quantisation. The build's settings (model identity
with its weights checksum, cells, corpus) live in the collection's metadata, so a search, or a resumed build,
from any machine can check that its model is the collection's.

`search --cascade small,full` is one Query API request: a `prefetch` on the small cell's vector with
`limit=shortlist`, then the query on the full cell's vector, which Qdrant scores exactly for the shortlisted
points only.

Where: `QdrantTarget(url=...)` is a Qdrant server or cluster (REST, port 6333; an API key from the
QDRANT_API_KEY environment variable, never written to the manifest); `QdrantTarget(path=...)` is
qdrant-client's local mode, a Python re-implementation inside the client that searches exactly (no HNSW, no
quantisation) and allows one process per folder. It is for tests and small corpora, not the server's engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from matryoshka2d.cells import Cell
from matryoshka2d.retrieval.search import SearchIndex
from matryoshka2d.retrieval.shards import IndexBuildError, cell_name, load_shards, read_shard_texts, write_json

QUANTIZATIONS = ("none", "scalar", "binary")
METADATA_KEY = "matryoshka2d"
UPLOAD_BATCH = 256  # points per upsert request
QUERY_BATCH = 64  # queries per query_batch_points request


def require_qdrant():
    try:
        import qdrant_client
    except ImportError:
        from matryoshka2d.extras import install_line  # the package is on no index: the checkout's extra

        raise IndexBuildError(f"--backend qdrant needs qdrant-client: {install_line('qdrant')}") from None
    return qdrant_client


@dataclass
class QdrantTarget:
    """Where the collection lives: a server (`url`) or a local-mode folder (`path`), and its name."""

    url: str | None = None
    path: str | None = None
    collection: str = "matryoshka2d"
    timeout: int = 10  # seconds per request to a server
    shards: int | None = None  # a new collection's shard_number on a cluster (default: the server's)
    replicas: int | None = None  # and its replication_factor

    def __post_init__(self):
        if (self.url is None) == (self.path is None):
            raise IndexBuildError("give exactly one of --url URL (a Qdrant server) or --path DIR (local mode)")
        if not self.collection:
            raise IndexBuildError("--collection: the name is empty")
        for flag, value in (("--qdrant-shards", self.shards), ("--qdrant-replicas", self.replicas)):
            if value is not None and value < 1:
                raise IndexBuildError(f"{flag} must be at least 1, got {value}")

    @property
    def where(self) -> str:
        return f"--url {self.url}" if self.url else f"--path {self.path}"

    def describe(self) -> dict:
        """What the manifest records (no API key)."""
        where = {"url": self.url} if self.url else {"path": str(Path(self.path).resolve())}
        return {**where, "collection": self.collection}

    @classmethod
    def from_manifest(cls, recorded: dict, url: str | None = None, path: str | None = None) -> QdrantTarget:
        """The recorded target, or the same collection at another address (`url` / `path` given)."""
        if url or path:
            return cls(url=url, path=path, collection=recorded["collection"])
        return cls(url=recorded.get("url"), path=recorded.get("path"), collection=recorded["collection"])


def _cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def vector_params(cells: Sequence[Cell], quantization: str):
    """Named vector settings: the full cell on disk without a graph, the others with HNSW (quantised or not)."""
    from qdrant_client import models

    full = max(cells)
    quantized = {
        "none": None,
        "scalar": models.ScalarQuantization(
            scalar=models.ScalarQuantizationConfig(type=models.ScalarType.INT8, quantile=0.99, always_ram=True)
        ),
        "binary": models.BinaryQuantization(binary=models.BinaryQuantizationConfig(always_ram=True)),
    }[quantization]
    params = {}
    for cell in cells:
        if cell == full:
            params[cell_name(cell)] = models.VectorParams(
                size=cell[1], distance=models.Distance.COSINE, on_disk=True, hnsw_config=models.HnswConfigDiff(m=0)
            )
        else:
            params[cell_name(cell)] = models.VectorParams(
                size=cell[1], distance=models.Distance.COSINE, quantization_config=quantized
            )
    return params


LOCAL_META = "meta.json"  # what qdrant-client's local mode keeps in its folder


class QdrantStore:
    """A connection to the target, with the collection's checks, filling and search."""

    def __init__(self, target: QdrantTarget, create: bool = False):
        """`create`: a build, which may start a new local-mode folder (made by the one writer beforehand). A search
        opens only a folder that holds a collection store: qdrant-client would otherwise create one, with its
        files, wherever --path or the index's manifest points."""
        require_qdrant()
        from qdrant_client import QdrantClient

        self.target = target
        if target.path and not create and not (Path(target.path) / LOCAL_META).is_file():
            raise IndexBuildError(
                f"{target.where}: not a local-mode Qdrant folder (no {LOCAL_META} in it); nothing was created there: "
                "give the folder `matryoshka2d index build --backend qdrant --path` filled"
            )
        try:
            if target.url:
                # The version check would warn from a thread on an unreachable server; reachability is checked
                # right below, with an error that says where.
                self.client = QdrantClient(
                    url=target.url,
                    api_key=os.environ.get("QDRANT_API_KEY"),
                    timeout=target.timeout,
                    check_compatibility=False,
                )
            else:
                self.client = QdrantClient(path=target.path)
            self.client.get_collections()
        except Exception as exc:
            if target.path:
                raise IndexBuildError(
                    f"{target.where}: cannot open this local-mode Qdrant folder ({_cause(exc)}); local mode allows one "
                    "process at a time: use a Qdrant server (--url) for concurrent access"
                ) from None
            raise IndexBuildError(
                f"{target.where}: no Qdrant server answers there ({_cause(exc)}); start one (e.g. `docker run -p "
                "6333:6333 qdrant/qdrant`) or fix the URL. Nothing was changed"
            ) from None

    def close(self) -> None:
        self.client.close()

    @property
    def collection(self) -> str:
        return self.target.collection

    def recorded(self) -> dict | None:
        """The build settings in the collection's metadata; None when there is no such collection."""
        if not self.client.collection_exists(self.collection):
            return None
        metadata = self.client.get_collection(self.collection).config.metadata or {}
        recorded = metadata.get(METADATA_KEY)
        if not isinstance(recorded, dict):
            raise IndexBuildError(
                f"{self.target.where}: collection '{self.collection}' exists but was not made by `matryoshka2d index "
                "build` (no matryoshka2d metadata); choose another --collection"
            )
        return recorded

    def check_collection(self, settings: dict, overwrite: bool) -> bool:
        """An existing collection must hold the same model's vectors (weights checksum) and the same build;
        True when `overwrite` is to replace it (at fill time, once the new vectors are ready)."""
        recorded = self.recorded()
        if recorded is None:
            return False
        check_same_model(
            recorded.get("model", {}), settings["model"], f"{self.target.where} collection '{self.collection}'"
        )
        if overwrite:
            return True
        differs = [
            k
            for k in ("cells", "corpus", "corpus_bytes", "limit", "shard_size", "quantization")
            if recorded.get(k) != settings.get(k)
        ]
        if differs:
            raise IndexBuildError(
                f"{self.target.where}: collection '{self.collection}' holds a build with different "
                f"{', '.join(differs)}; pass --overwrite to replace it or choose another --collection"
            )
        return False

    def fill(self, out: Path, manifest: dict, log: Callable[[str], None], replace: bool = False) -> None:
        """Upload the shards the manifest does not mark uploaded (upserts by position: a redone one overwrites
        itself), then mark the collection and the manifest complete. `replace`: delete an existing collection
        first (--overwrite)."""
        from qdrant_client import models

        cells = [Cell(*c) for c in manifest["cells"]]
        recorded = {k: v for k, v in manifest.items() if k not in ("shards", "uploaded", "qdrant")}
        recorded["complete"] = False
        if replace and not manifest.get("uploaded"):
            self.client.delete_collection(self.collection)
        if not self.client.collection_exists(self.collection):
            self.client.create_collection(
                self.collection,
                vectors_config=vector_params(cells, manifest.get("quantization", "none")),
                shard_number=self.target.shards,
                replication_factor=self.target.replicas,
                on_disk_payload=True,
                metadata={METADATA_KEY: recorded},
            )
        uploaded = manifest.setdefault("uploaded", [])
        shards = load_shards(out, manifest)
        position = 0
        start = time.perf_counter()
        for name, shard in zip(manifest["shards"], shards, strict=True):
            n = len(shard["ids"])
            if name not in uploaded:
                texts = read_shard_texts(shard)
                vectors = {cell_name(c): shard[cell_name(c)] for c in cells}
                for a in range(0, n, UPLOAD_BATCH):
                    b = min(n, a + UPLOAD_BATCH)
                    self.client.upsert(
                        self.collection,
                        points=models.Batch(
                            ids=list(range(position + a, position + b)),
                            vectors={k: v[a:b].tolist() for k, v in vectors.items()},
                            payloads=[{"doc_id": str(shard["ids"][i]), "text": texts[i]} for i in range(a, b)],
                        ),
                        wait=True,
                    )
                uploaded.append(name)
                write_json(out / "manifest.json", manifest)
                log(f"  {name}: {n} points -> {self.collection} ({time.perf_counter() - start:.1f} s)")
            position += n
        recorded["complete"] = True
        self.client.update_collection(self.collection, metadata={METADATA_KEY: recorded})
        manifest["complete"] = True
        write_json(out / "manifest.json", manifest)
        log(f"  collection '{self.collection}' at {self.target.where}: {position} points, cells {cells}")


def search_params(ef_search: int | None, oversampling: float | None):
    """The HNSW breadth, and for a quantised cell, how many times the shortlist to take by quantised scores
    before rescoring them with the original vectors (Qdrant's oversampling)."""
    from qdrant_client import models

    if not ef_search and not oversampling:
        return None
    quantization = models.QuantizationSearchParams(rescore=True, oversampling=oversampling) if oversampling else None
    return models.SearchParams(hnsw_ef=ef_search or None, quantization=quantization)


def check_same_model(recorded: dict, identity: dict, where: str) -> None:
    """The vectors of `where` must come from the model whose identity is given (the same weights checksum)."""
    want, have = recorded.get("weights_sha256"), identity.get("weights_sha256")
    if want and have and want != have:
        raise IndexBuildError(
            f"{where}: was built from another model ({recorded.get('model')}, weights sha256 {want[:12]}...) than "
            f"{identity.get('model')} (weights sha256 {have[:12]}...); its vectors cannot be compared with this "
            "model's. Use the model it was built with, or another --collection. Nothing was changed"
        )


class QdrantIndex(SearchIndex):
    """A complete collection, searched like a CellIndex: flat, cascade (one query with a prefetch), query layer."""

    def __init__(self, target: QdrantTarget, ef_search: int | None = None, oversampling: float | None = None):
        if oversampling is not None and oversampling < 1:
            raise IndexBuildError(f"--oversampling must be at least 1, got {oversampling}")
        self.store = QdrantStore(target)
        recorded = self.store.recorded()
        if recorded is None:
            raise IndexBuildError(f"{target.where}: no collection '{target.collection}'")
        if not recorded.get("complete"):
            raise IndexBuildError(
                f"{target.where}: collection '{target.collection}' is not finished; run the same `matryoshka2d "
                "index build` command again to resume it"
            )
        self.manifest = recorded
        self.cells: list[Cell] = [Cell(*c) for c in recorded["cells"]]
        # Local mode searches exactly and warns about search parameters: they are sent to servers only.
        self.ef_search = ef_search if target.url else None
        self.oversampling = oversampling if target.url else None
        self.directory = f"{target.where} collection '{target.collection}'"

    def close(self) -> None:
        self.store.close()

    def check_cell(self, cell: Cell) -> None:
        if cell not in self.cells:
            have = ", ".join(f"{n}:{d}" for n, d in self.cells)
            raise IndexBuildError(f"{self.directory}: no vector for cell {cell[0]}:{cell[1]} (cells here: {have})")

    def check_encoder(self, encoder) -> None:
        want = self.manifest["model"]
        if (encoder.num_layers, encoder.hidden_size) != (want["layers"], want["hidden_size"]):
            raise IndexBuildError(
                f"{self.directory}: built with {want['model']} ({want['layers']} layers x {want['hidden_size']}), "
                f"but the query model {encoder.name} has {encoder.num_layers} x {encoder.hidden_size}"
            )
        from matryoshka2d.models.identity import vectors_difference

        differs = vectors_difference(want, self.manifest.get("vectors"), encoder, [n for n, _ in self.cells])
        if differs:
            raise IndexBuildError(f"{self.directory}: was built from another model ({want.get('model')}): {differs}")

    def requests(self, vectors: dict[Cell, np.ndarray], cell: Cell | None, cascade, shortlist: int, top_k: int):
        from qdrant_client import models

        params = search_params(self.ef_search, self.oversampling)
        out = []
        if cascade:
            small, full = cascade
            for qs, qf in zip(vectors[small], vectors[full], strict=True):
                prefetch = models.Prefetch(query=qs.tolist(), using=cell_name(small), limit=shortlist, params=params)
                out.append(
                    models.QueryRequest(
                        prefetch=prefetch,
                        query=qf.tolist(),
                        using=cell_name(full),
                        limit=top_k,
                        with_payload=["doc_id"],
                    )
                )
        else:
            for q in vectors[cell]:
                out.append(
                    models.QueryRequest(
                        query=q.tolist(), using=cell_name(cell), limit=top_k, params=params, with_payload=["doc_id"]
                    )
                )
        return out

    def check_search(self, encoder, cells: list[Cell], cascade, shortlist: int, top_k: int, query_layer) -> None:
        if cascade and shortlist < top_k:
            raise ValueError(f"--shortlist {shortlist} is smaller than --top-k {top_k}; the rerank can only reorder it")
        for c in cells:
            self.check_cell(c)
        if query_layer is not None:
            self.check_query_layer(encoder.check_layer(query_layer), cells)

    def run_search(self, vectors: dict[Cell, np.ndarray], cells: list[Cell], cascade, shortlist: int, top_k: int):
        requests = self.requests(vectors, cells[0], cascade, shortlist, top_k)
        ids, scores = [], []
        for a in range(0, len(requests), QUERY_BATCH):
            for response in self.store.client.query_batch_points(
                self.store.collection, requests=requests[a : a + QUERY_BATCH]
            ):
                ids.append([p.payload["doc_id"] for p in response.points])
                scores.append([float(p.score) for p in response.points])
        if cascade:
            small, full = cascade
            what = (
                f"qdrant cascade ({small[0]},{small[1]}) prefetch {shortlist} -> ({full[0]},{full[1]}), one query each"
            )
        else:
            what = f"qdrant ({cells[0][0]},{cells[0][1]})"
        return ids, scores, what
