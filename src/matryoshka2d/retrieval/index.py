"""Build indexes of several (layer, dim) cells of one corpus in a single encoder pass, resumably.

A build directory holds (its files are read and written by matryoshka2d.retrieval.shards):

- `manifest.json`: the model's identity, the cells, the backend, index kind and storage, the corpus, the sha256
  of each shard's input documents, and while a build is running, the shards that are done; `complete` turns
  true at the end, with the size and sha256 of `ids.txt` and of every `.faiss` file.
- `shards/shard-00000.npz`, ...: one file per block of `shard_size` documents (their ids and texts and one
  float32 array per cell, unit rows), written atomically (a temporary name, then a rename) before the manifest
  names it. A build resumes by re-encoding only the shards the manifest does not name: a file a killed build
  was writing is redone, never read. The encoder pass runs in this process (`engine="local"`) or on a Ray
  cluster (`engine="ray"`, matryoshka2d.retrieval.ray_engine), which writes the same files.
- faiss backend: `ids.txt` (document ids in index order: faiss id i is line i + 1) and one
  `cell-<layer>x<dim>.faiss` per cell (matryoshka2d.retrieval.faiss_indexes), inner product on L2-normalised
  vectors (cosine); with `storage="binary"` a binary faiss index of sign bits plus `cell-<layer>x<dim>.f16.npy`,
  the float16 vectors that rescore its Hamming shortlist (memory-mapped at search time, so only the shortlist's
  rows are read); with `storage="int8-direct"` an index of int8 numbers under one scale (faiss
  `SQ8_direct_signed`, searched by L2 distance on the scaled vectors, which ranks unit vectors as cosine does)
  plus the same float16 file.
- qdrant backend: one collection with a named vector per cell, filled shard by shard
  (matryoshka2d.retrieval.qdrant_store).

The corpus is read as a stream (JSON lines, optionally gzipped, with `_id` and `text` and optional `title`, as in
BEIR; a document is `title + " " + text`), so memory holds one shard of texts at a time while encoding. Each
shard is encoded up to the deepest requested layer once, pooling every requested layer on the way
(ElasticEncoder.pooled_states), and every cell is a leading slice of its layer's vector.

A resumed build reads the documents of its finished shards again and compares their sha256 with the manifest's:
a corpus edited in place (even at the same size) is refused instead of mixing old vectors with new documents.

Every file of the folder is written, replaced and deleted by the one writer (matryoshka2d.outputs): the manifest,
ids.txt, shards and faiss files go to a temporary name and are renamed into place (a link standing there is
replaced, never written through); a `shards/` that is a link is refused.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from matryoshka2d import outputs
from matryoshka2d.cells import Cell
from matryoshka2d.files import DataFormatError, file_sha256
from matryoshka2d.models.identity import vectors_identity
from matryoshka2d.models.query_record import refuse_query_encoder_for_documents
from matryoshka2d.retrieval.faiss_indexes import HNSW_EF_CONSTRUCTION, factory_string, make_index
from matryoshka2d.retrieval.shards import (
    FORMAT,
    RESCORED_STORAGES,
    IndexBuildError,
    cell_name,
    corpus_blocks,
    encode_cells,
    input_sha256,
    load_shards,
    model_identity,
    read_manifest,
    shard_file_name,
    write_json,
    write_shard,
)

BACKENDS = ("faiss", "qdrant")
ENGINES = ("local", "ray")


def build_index(
    encoder,
    corpus: str | Path,
    cells: Sequence[Cell],
    output: str | Path,
    kind: str = "flat",
    storage: str = "float32",
    batch_size: int = 64,
    shard_size: int = 2048,
    limit: int | None = None,
    overwrite: bool = False,
    keep_shards: bool = False,
    log: Callable[[str], None] | None = None,
    backend: str = "faiss",
    qdrant=None,
    quantization: str = "none",
    engine: str = "local",
    ray_address: str | None = None,
    workers: int | None = None,
    progress: bool | None = None,
) -> dict:
    """Encode `corpus` once up to the deepest cell's layer and index every cell into `output` (faiss files) or
    into a Qdrant collection (`qdrant`: a matryoshka2d.retrieval.qdrant_store.QdrantTarget).

    An unfinished build in `output` with the same model, cells and corpus is resumed: only shards the manifest
    does not name are encoded (here, or on Ray with `engine="ray"`). Different settings are an error unless
    `overwrite`. Returns the final manifest.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    refuse_query_encoder_for_documents(encoder, "--model")
    cells = sorted({Cell(encoder.check_layer(n), encoder.check_dim(d)) for n, d in cells})
    _check_options(cells, backend, engine, kind, storage, shard_size, batch_size, qdrant)
    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"--corpus {corpus}: file not found")
    out = Path(output)
    settings = _settings(encoder, cells, backend, kind, storage, corpus, limit, shard_size)
    replace = None
    if backend == "qdrant":
        replace = _check_qdrant(qdrant, settings, quantization, kind, storage, overwrite)
    manifest = _start_or_resume(encoder, cells, settings, corpus, out, overwrite, log)
    if manifest.get("complete"):
        return manifest
    _clear_folder(out, manifest, overwrite)
    shards = _Shards(out, manifest, engine, log)
    done = set(manifest["shards"])
    pending = (
        (number, block)
        for number, block in enumerate(corpus_blocks(corpus, shard_size, limit))
        if shard_file_name(number) not in done
    )
    try:
        if progress if progress is not None else sys.stderr.isatty():
            shards.show_bar(sum(len(block) for block in corpus_blocks(corpus, shard_size, limit)))
        if engine == "ray":
            from matryoshka2d.retrieval.ray_engine import encode_on_ray

            encode_on_ray(
                encoder, pending, cells, batch_size, shards.finished, address=ray_address, workers=workers, log=log
            )
        else:
            for number, block in pending:
                texts = [t for _, t in block]
                vectors = encode_cells(encoder, texts, cells, batch_size, progress=shards.moved)
                shards.finished(number, [i for i, _ in block], texts, vectors)
    finally:
        shards.close()
    if manifest["documents"] == 0:
        raise DataFormatError(f"{corpus}: no documents")
    manifest["shards"] = sorted(manifest["shards"])
    if backend == "qdrant":
        _fill_qdrant(qdrant, out, manifest, log, replace)
    else:
        finalize(out, manifest, log)
    if not keep_shards:
        for name in manifest["shards"]:
            outputs.remove_file(out / "shards" / name)
        manifest["shards"] = []
        write_json(out / "manifest.json", manifest)
    return manifest


def _check_options(cells, backend, engine, kind, storage, shard_size, batch_size, qdrant) -> None:
    """The options a build cannot run with, refused before any work, each naming its option."""
    if not cells:
        raise IndexBuildError("--cells: need at least one cell")
    if backend not in BACKENDS:
        raise IndexBuildError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if engine not in ENGINES:
        raise IndexBuildError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    factory_string(kind, storage, 1000)  # check the kind and storage before any work
    if shard_size < 1 or batch_size < 1:
        raise IndexBuildError(f"--shard-size and --batch-size must be at least 1 (got {shard_size}, {batch_size})")
    if backend == "qdrant" and qdrant is None:
        raise IndexBuildError("--backend qdrant needs --url URL (a Qdrant server) or --path DIR (local mode)")


def _settings(encoder, cells, backend, kind, storage, corpus: Path, limit, shard_size) -> dict:
    """What the build's vectors depend on; a build in the folder with other settings is not resumed."""
    return {
        "format": FORMAT,
        "model": model_identity(encoder),
        "cells": [list(c) for c in cells],
        "backend": backend,
        "index": kind,
        "storage": storage,
        **({"hnsw_ef_construction": HNSW_EF_CONSTRUCTION} if kind == "hnsw" else {}),
        "corpus": str(corpus.resolve()),
        "corpus_bytes": corpus.stat().st_size,
        "limit": limit,
        "shard_size": shard_size,
        "normalized": True,
        "metric": "inner product on L2-normalised vectors (cosine)",
    }


def _check_qdrant(qdrant, settings: dict, quantization: str, kind: str, storage: str, overwrite: bool) -> bool:
    """Adds the collection to `settings`, then reaches the server and checks any existing collection before
    anything is written; whether the collection is to be replaced."""
    from matryoshka2d.retrieval.qdrant_store import QUANTIZATIONS, QdrantStore

    if quantization not in QUANTIZATIONS:
        raise IndexBuildError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if (kind, storage) != ("flat", "float32"):
        raise IndexBuildError(
            "--index and --storage choose faiss indexes; with --backend qdrant the small cells get Qdrant's "
            "HNSW and --quantization none|scalar|binary, the full cell stays on disk without a graph"
        )
    settings["qdrant"] = qdrant.describe()
    settings["quantization"] = quantization
    if qdrant.path:  # local mode: the folder Qdrant fills, made by the one writer (checked against the inputs)
        outputs.check_destination(qdrant.path, "--path")
        outputs.make_folder(qdrant.path, "--path", check=False)
    store = QdrantStore(qdrant, create=True)
    try:
        return store.check_collection(settings, overwrite=overwrite)
    finally:
        store.close()  # reopened to fill it: local mode locks its folder while a client is open


def _start_or_resume(encoder, cells, settings: dict, corpus: Path, out: Path, overwrite: bool, log) -> dict:
    """A new manifest, or the unfinished (or complete) build in `out` when its settings and finished shards'
    documents are the ones asked for now; a build with other settings is refused unless `overwrite`."""
    # What the vectors of each cell depend on (models/identity.py): a model that gives the same vectors there may
    # query the index, with its own exit heads elsewhere. Apart from the settings: an older build resumes.
    vectors = vectors_identity(encoder, [n for n, _ in cells])
    if not (out / "manifest.json").is_file() or overwrite:
        return {**settings, "vectors": vectors, "shards": [], "shard_inputs": {}, "documents": 0, "complete": False}
    old = read_manifest(out)
    old.setdefault("backend", "faiss")  # builds from before the qdrant backend
    differs = [k for k in settings if k != "format" and old.get(k) != settings[k]]
    if differs:
        raise IndexBuildError(
            f"{out}: holds a build with different {', '.join(differs)}; pass --overwrite to replace it or "
            "choose another --output"
        )
    _check_inputs(old, corpus, out, log)
    if old.get("complete"):
        log(f"{out}: already complete ({old['documents']} documents); nothing to do")
        return old
    old.setdefault("vectors", vectors)  # the same model (weights_sha256 above): its vectors' identity
    log(f"{out}: resuming after {len(old['shards'])} finished shards ({old['documents']} documents)")
    return old


def _clear_folder(out: Path, manifest: dict, overwrite: bool) -> None:
    """`shards/` made (one that links elsewhere is refused, never filled or emptied), the files of a replaced
    build and the half files of a killed one removed, and the manifest written."""
    shards_dir = out / "shards"
    outputs.make_folder(shards_dir, own=True)
    if overwrite and out.exists():
        for stale in itertools.chain(out.glob("cell-*.faiss"), out.glob("cell-*.npy"), shards_dir.glob("*.npz")):
            outputs.remove_file(stale)
    temporary = f".*{outputs.TEMPORARY_MARK}*"
    for leftover in itertools.chain(shards_dir.glob("*.tmp.npz"), shards_dir.glob(temporary), out.glob(temporary)):
        if not leftover.is_dir() or leftover.is_symlink():
            outputs.remove_file(leftover)  # half a file from a killed build: redone below, never read
    write_json(out / "manifest.json", manifest)


class _Shards:
    """Where encoded shards go: each written, then named in the manifest (written again), so a killed build
    resumes after the last shard it named; progress as a log line per shard, or a bar over the documents."""

    def __init__(self, out: Path, manifest: dict, engine: str, log: Callable[[str], None]):
        self.out, self.manifest, self.engine, self.log = out, manifest, engine, log
        self.start, self.new_docs = time.perf_counter(), 0
        self.bar = None
        self.moved = None  # what each forward pass calls with its number of texts (the bar's update)

    def show_bar(self, total: int) -> None:
        """A bar over the documents (total, rate, time left), moved by every forward pass (by every shard on
        Ray); the total costs one read of the corpus."""
        self.bar = tqdm(
            total=total, initial=self.manifest["documents"], unit="doc", desc="index build", dynamic_ncols=True
        )
        self.moved = self.bar.update

    def finished(self, number: int, ids: list[str], texts: list[str], arrays: dict[str, np.ndarray]) -> None:
        name = shard_file_name(number)
        write_shard(self.out / "shards" / name, ids, texts, arrays)
        self.manifest["shards"].append(name)
        self.manifest["shard_inputs"][name] = input_sha256(list(zip(ids, texts, strict=True)))
        self.manifest["documents"] += len(ids)
        write_json(self.out / "manifest.json", self.manifest)
        self.new_docs += len(ids)
        rate = self.new_docs / max(time.perf_counter() - self.start, 1e-9)
        if self.bar is None:
            self.log(f"  shard {number + 1}: {self.manifest['documents']} documents encoded ({rate:.1f} docs/s)")
        elif self.engine == "ray":
            self.bar.update(len(ids))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fill_qdrant(qdrant, out: Path, manifest: dict, log, replace: bool) -> None:
    from matryoshka2d.retrieval.qdrant_store import QdrantStore

    store = QdrantStore(qdrant, create=True)
    try:
        store.fill(out, manifest, log, replace=replace)
    finally:
        store.close()


def _check_inputs(manifest: dict, corpus: Path, out: Path, log) -> None:
    """The documents of every finished shard, read from the corpus now, are the ones its vectors were made from
    (sha256 of ids and texts): an in-place edit of the corpus, even one that keeps its size, is refused."""
    inputs = manifest.get("shard_inputs")
    if not isinstance(inputs, dict):  # written before the shards' inputs were recorded by name
        if manifest.get("complete"):
            log(f"{out}: built by an earlier version without checksums of its documents; the corpus is not checked")
            return
        raise IndexBuildError(
            f"{out}: an unfinished build by an earlier version, without checksums of its shards' documents, so an "
            "edited corpus could not be detected; pass --overwrite to build the index again"
        )
    size, left = manifest["shard_size"], len(inputs)
    for number, block in enumerate(corpus_blocks(corpus, size, manifest.get("limit"))):
        if not left:
            break  # every finished shard is checked; the rest of the corpus is read when it is encoded
        expected = inputs.get(shard_file_name(number))
        left -= expected is not None
        if expected is not None and input_sha256(block) != expected:
            first = number * size
            raise IndexBuildError(
                f"{out}: --corpus {corpus} changed since this build encoded it: documents {first + 1}.."
                f"{first + len(block)} (shard {number + 1}) are not the ones their vectors were made from; pass "
                "--overwrite to build the index again, or restore the corpus"
            )


def finalize(out: Path, manifest: dict, log: Callable[[str], None]) -> None:
    """Join the shards into ids.txt and one faiss index per cell; mark the manifest complete."""
    import faiss

    shards = load_shards(out, manifest)
    ids = [str(i) for s in shards for i in s["ids"]]
    outputs.write_text(out / "ids.txt", "\n".join(ids) + "\n")
    manifest["factory"] = {}
    # Size and sha256 of every file a search reads: a damaged or swapped file is named before faiss reads it.
    manifest["files"] = {"ids.txt": {"bytes": (out / "ids.txt").stat().st_size, "sha256": file_sha256(out / "ids.txt")}}
    for cell in [Cell(*c) for c in manifest["cells"]]:
        vectors = np.ascontiguousarray(np.concatenate([s[cell_name(cell)] for s in shards]))
        t0 = time.perf_counter()
        index = make_index(vectors, manifest["index"], manifest["storage"])
        path = out / f"{cell_name(cell)}.faiss"
        with outputs.writing(path) as tmp:  # renamed into place once written (after its rescoring vectors)
            if manifest["storage"] == "binary":
                faiss.write_index_binary(index, str(tmp))
            else:
                faiss.write_index(index, str(tmp))
            if manifest["storage"] in RESCORED_STORAGES:
                rescoring = out / f"{cell_name(cell)}.f16.npy"
                with outputs.writing(rescoring) as tmp_vectors:  # ends in .npy: np.save adds nothing
                    np.save(tmp_vectors, vectors.astype(np.float16))
                manifest["files"][rescoring.name] = {
                    "bytes": rescoring.stat().st_size,
                    "sha256": file_sha256(rescoring),
                }
        manifest["files"][path.name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        manifest["factory"][cell_name(cell)] = factory_string(manifest["index"], manifest["storage"], len(vectors))
        log(
            f"  ({cell[0]},{cell[1]}): {manifest['factory'][cell_name(cell)]} index of {len(vectors)} vectors "
            f"-> {path.name} ({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)"
        )
    manifest["complete"] = True
    write_json(out / "manifest.json", manifest)
