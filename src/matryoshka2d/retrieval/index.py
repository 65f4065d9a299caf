"""Build faiss indexes of several (layer, dim) cells of one corpus in a single encoder pass, resumably.

A build directory holds:

- `manifest.json`: the model's identity, the cells, the index kind and storage, the corpus, the sha256 of each
  shard's input documents, and while a build is running, the shards that are done; `complete` turns true at
  the end, with the size and sha256 of `ids.txt` and of every `.faiss` file.
- `shards/shard-00000.npz`, ...: one file per block of documents (their ids and one float32 array per cell,
  unit rows), written atomically before the manifest names them. A killed build re-runs only the shard it was in.
- `ids.txt`: document ids in index order (faiss id i is line i + 1).
- `cell-<layer>x<dim>.faiss`: one faiss index per cell, inner product on L2-normalised vectors (cosine).

The corpus is read as a stream (JSON lines, optionally gzipped, with `_id` and `text` and optional `title`, as in
BEIR; a document is `title + " " + text`), so memory holds one shard of texts at a time while encoding. Each
shard is encoded up to the deepest requested layer once, pooling every requested layer on the way
(ElasticEncoder.pooled_states), and every cell is a leading slice of its layer's vector.

A resumed build reads the documents of its finished shards again and compares their sha256 with the manifest's:
a corpus edited in place (even at the same size) is refused instead of mixing old vectors with new documents.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from matryoshka2d.files import DataFormatError, file_sha256, read_beir, read_json
from matryoshka2d.views import parse_cells, unit_rows

FORMAT = 1
INDEX_KINDS = ("flat", "hnsw", "ivf")
STORAGES = {"float32": 4, "float16": 2, "int8": 1}  # bytes per number
Cell = tuple[int, int]


class IndexBuildError(ValueError):
    """A build directory or its options are wrong; the message names the directory or the option."""


def cell_name(cell: Cell) -> str:
    return f"cell-{cell[0]}x{cell[1]}"


def parse_cell_list(text: str, what: str = "--cells") -> list[Cell]:
    """'2:128,6:384' -> [(2, 128), (6, 384)]; the error names the option and the bad part."""
    try:
        cells = [(int(c[0]), int(c[1])) for c in parse_cells(text)]
    except (ValueError, TypeError) as exc:
        raise IndexBuildError(f"{what}: {exc}") from None
    if not cells:
        raise IndexBuildError(f"{what}: no cells in {text!r}; write them as layer:dim,layer:dim (e.g. 2:128,6:384)")
    return cells


def factory_string(kind: str, storage: str, n_vectors: int) -> str:
    """The faiss index_factory description of an index kind with a storage type."""
    if kind not in INDEX_KINDS:
        raise IndexBuildError(f"--index {kind!r}: choose one of {', '.join(INDEX_KINDS)}")
    if storage not in STORAGES:
        raise IndexBuildError(f"--storage {storage!r}: choose one of {', '.join(STORAGES)}")
    code = {"float32": "Flat", "float16": "SQfp16", "int8": "SQ8"}[storage]
    if kind == "flat":
        return code
    if kind == "hnsw":
        return "HNSW32" if storage == "float32" else f"HNSW32_{code}"
    return f"IVF{ivf_lists(n_vectors)},{code}"


def ivf_lists(n_vectors: int) -> int:
    """About 4 sqrt(n) inverted lists, with at least 39 training points per list (faiss's own minimum)."""
    return max(1, min(int(4 * np.sqrt(max(n_vectors, 1))), n_vectors // 39))


def make_index(vectors: np.ndarray, kind: str, storage: str):
    """A trained faiss index holding `vectors` (unit rows, float32), searchable by inner product."""
    import faiss

    n, d = vectors.shape
    index = faiss.index_factory(d, factory_string(kind, storage, n), faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    if kind == "ivf":
        faiss.extract_index_ivf(index).make_direct_map()  # lets the cascade read stored vectors back by id
    return index


def model_identity(encoder) -> dict:
    """What identifies the model that made the vectors: its description plus a checksum of its weights."""
    from matryoshka2d.models.identity import weights_sha256

    info = encoder.info()
    return {
        "model": info["model"],
        "location": info.get("location"),
        "layers": info["layers"],
        "hidden_size": info["hidden_size"],
        "pooling": info["pooling"],
        "max_length": info["max_length"],
        "weights_sha256": weights_sha256(encoder),
    }


def read_corpus(path: str | Path) -> Iterator[tuple[str, str]]:
    """(id, text) per document of a JSON-lines corpus (.jsonl or .jsonl.gz); a bad line names file and line."""
    for _, key, text in read_beir(path, titles=True):
        yield key, text


def input_sha256(block: Sequence[tuple[str, str]]) -> str:
    """sha256 of a shard's input: each document's id and text, in order (what its vectors were made from)."""
    digest = hashlib.sha256()
    for key, text in block:
        digest.update(json.dumps([key, text], ensure_ascii=False).encode("utf-8") + b"\n")
    return digest.hexdigest()


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a killed build never leaves half a manifest


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no manifest.json (not an index built by `matryoshka2d index build`)")
    manifest = read_json(path, IndexBuildError)
    if manifest.get("format") != FORMAT:
        raise IndexBuildError(f"{path}: format {manifest.get('format')!r}, this version reads format {FORMAT}")
    check_manifest(manifest, path)
    return manifest


SHARD_NAME = re.compile(r"shard-\d{5}\.npz")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_manifest(manifest: dict, path: Path) -> None:
    """Every field a reader turns into a file name or a loop is what `index build` writes: cells are pairs of
    positive integers (so `cell-<layer>x<dim>.faiss` names a file in the directory, never a path), shards are
    plain `shard-NNNNN.npz` names, counts are integers. Anything else is refused, naming the field."""

    def bad(field: str, value, want: str) -> IndexBuildError:
        return IndexBuildError(
            f"{path}: '{field}' must be {want}, got {json.dumps(value)[:80]}; the manifest was changed "
            "by hand or damaged: rebuild the index with `matryoshka2d index build ... --overwrite`"
        )

    cells = manifest.get("cells")
    if (
        not isinstance(cells, list)
        or not cells
        or not all(isinstance(c, list) and len(c) == 2 and all(_positive_int(v) for v in c) for c in cells)
    ):
        raise bad("cells", cells, "a list of [layer, dim] pairs of positive integers")
    if manifest.get("index") not in INDEX_KINDS:
        raise bad("index", manifest.get("index"), f"one of {', '.join(INDEX_KINDS)}")
    if manifest.get("storage") not in STORAGES:
        raise bad("storage", manifest.get("storage"), f"one of {', '.join(STORAGES)}")
    model = manifest.get("model")
    if not isinstance(model, dict) or not all(_positive_int(model.get(k)) for k in ("layers", "hidden_size")):
        raise bad("model", model, "the model's description with positive integer 'layers' and 'hidden_size'")
    documents = manifest.get("documents")
    if not isinstance(documents, int) or isinstance(documents, bool) or documents < 0:
        raise bad("documents", documents, "a count of documents")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, str) and SHARD_NAME.fullmatch(s) for s in shards):
        raise bad("shards", shards, "a list of shard-NNNNN.npz names")
    inputs = manifest.get("shard_inputs")
    if inputs is not None and (not isinstance(inputs, list) or not all(isinstance(h, str) for h in inputs)):
        raise bad("shard_inputs", inputs, "a list of sha256 hex digests")
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
        for v in files.values()
    ):
        raise bad("files", files, "a mapping of file name to its bytes and sha256")


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
) -> dict:
    """Encode `corpus` once up to the deepest cell's layer and write one faiss index per cell into `output`.

    An unfinished build in `output` with the same model, cells and corpus is resumed from its last finished
    shard; different settings are an error unless `overwrite`. Returns the final manifest.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    cells = sorted({(encoder.check_layer(n), encoder.check_dim(d)) for n, d in cells})
    if not cells:
        raise IndexBuildError("--cells: need at least one cell")
    factory_string(kind, storage, 1000)  # check the kind and storage before any work
    if shard_size < 1 or batch_size < 1:
        raise IndexBuildError(f"--shard-size and --batch-size must be at least 1 (got {shard_size}, {batch_size})")
    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"--corpus {corpus}: file not found")
    out = Path(output)
    shards_dir = out / "shards"
    settings = {
        "format": FORMAT,
        "model": model_identity(encoder),
        "cells": [list(c) for c in cells],
        "index": kind,
        "storage": storage,
        "corpus": str(corpus.resolve()),
        "corpus_bytes": corpus.stat().st_size,
        "limit": limit,
        "shard_size": shard_size,
        "normalized": True,
        "metric": "inner product on L2-normalised vectors (cosine)",
    }
    manifest = {**settings, "shards": [], "shard_inputs": [], "documents": 0, "complete": False}
    docs = read_corpus(corpus)
    if limit is not None:
        docs = itertools.islice(docs, limit)
    if (out / "manifest.json").is_file() and not overwrite:
        old = read_manifest(out)
        differs = [k for k in settings if k != "format" and old.get(k) != settings[k]]
        if differs:
            raise IndexBuildError(
                f"{out}: holds a build with different {', '.join(differs)}; pass --overwrite to replace it or "
                "choose another --output"
            )
        _check_inputs(old, docs, out, corpus, log)  # reads the finished shards' documents: docs goes on after them
        if old.get("complete"):
            log(f"{out}: already complete ({old['documents']} documents); nothing to do")
            return old
        manifest = old
        log(f"{out}: resuming after {len(old['shards'])} finished shards ({old['documents']} documents)")
    elif out.exists() and overwrite:
        for stale in itertools.chain(out.glob("cell-*.faiss"), shards_dir.glob("*.npz")):
            stale.unlink()
    shards_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out / "manifest.json", manifest)

    layers = sorted({n for n, _ in cells})
    start = time.perf_counter()
    new_docs = 0
    while True:
        block = list(itertools.islice(docs, shard_size))
        if not block:
            break
        ids = [i for i, _ in block]
        pooled = encoder.pooled_states([t for _, t in block], layers, batch_size)
        arrays = {cell_name((n, d)): unit_rows(pooled[n][:, :d]) for n, d in cells}
        shard = shards_dir / f"shard-{len(manifest['shards']):05d}.npz"
        tmp = shard.with_suffix(".tmp.npz")
        np.savez(tmp, ids=np.array(ids, dtype=object).astype(str), **arrays)
        os.replace(tmp, shard)
        manifest["shards"].append(shard.name)
        manifest["shard_inputs"].append(input_sha256(block))
        manifest["documents"] += len(block)
        _write_json(out / "manifest.json", manifest)
        new_docs += len(block)
        rate = new_docs / max(time.perf_counter() - start, 1e-9)
        log(f"  shard {len(manifest['shards'])}: {manifest['documents']} documents encoded ({rate:.1f} docs/s)")
    if manifest["documents"] == 0:
        raise DataFormatError(f"{corpus}: no documents")
    finalize(out, manifest, log)
    if not keep_shards:
        for name in manifest["shards"]:
            (shards_dir / name).unlink(missing_ok=True)
        manifest["shards"] = []
        _write_json(out / "manifest.json", manifest)
    return manifest


def _check_inputs(manifest: dict, docs: Iterator[tuple[str, str]], out: Path, corpus: Path, log) -> None:
    """The documents of every finished shard, read from the corpus now, are the ones its vectors were made from
    (sha256 of ids and texts): an in-place edit of the corpus, even one that keeps its size, is refused."""
    inputs = manifest.get("shard_inputs")
    if inputs is None:  # written before the shards' inputs were recorded
        if manifest.get("complete"):
            log(f"{out}: built by an earlier version without checksums of its documents; the corpus is not checked")
            return
        raise IndexBuildError(
            f"{out}: an unfinished build by an earlier version, without checksums of its shards' documents, so an "
            "edited corpus could not be detected; pass --overwrite to build the index again"
        )
    size = manifest["shard_size"]
    for i, expected in enumerate(inputs):
        first = i * size
        count = min(size, manifest["documents"] - first)
        block = list(itertools.islice(docs, count))
        if len(block) != count or input_sha256(block) != expected:
            raise IndexBuildError(
                f"{out}: --corpus {corpus} changed since this build encoded it: documents {first + 1}..{first + count} "
                f"(shard {i + 1}) are not the ones their vectors were made from; pass --overwrite to build the index "
                "again, or restore the corpus"
            )


def finalize(out: Path, manifest: dict, log: Callable[[str], None]) -> None:
    """Join the shards into ids.txt and one faiss index per cell; mark the manifest complete."""
    import faiss

    shards = [np.load(out / "shards" / name, allow_pickle=False) for name in manifest["shards"]]
    ids = [str(i) for s in shards for i in s["ids"]]
    (out / "ids.txt").write_text("\n".join(ids) + "\n", encoding="utf-8")
    manifest["factory"] = {}
    # Size and sha256 of every file a search reads: a damaged or swapped file is named before faiss reads it.
    manifest["files"] = {"ids.txt": {"bytes": (out / "ids.txt").stat().st_size, "sha256": file_sha256(out / "ids.txt")}}
    for cell in [tuple(c) for c in manifest["cells"]]:
        vectors = np.ascontiguousarray(np.concatenate([s[cell_name(cell)] for s in shards]))
        t0 = time.perf_counter()
        index = make_index(vectors, manifest["index"], manifest["storage"])
        path = out / f"{cell_name(cell)}.faiss"
        faiss.write_index(index, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        manifest["files"][path.name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        manifest["factory"][cell_name(cell)] = factory_string(manifest["index"], manifest["storage"], len(vectors))
        log(
            f"  ({cell[0]},{cell[1]}): {manifest['factory'][cell_name(cell)]} index of {len(vectors)} vectors "
            f"-> {path.name} ({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)"
        )
    manifest["complete"] = True
    _write_json(out / "manifest.json", manifest)
