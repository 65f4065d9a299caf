"""A build directory's files, apart from the build that writes them (matryoshka2d.retrieval.index): the manifest
and the checks a reader runs on it, the corpus read in shard-sized blocks with a checksum of each block's
documents, and the shard files of unit vectors, written atomically and read back.

The local build and the Ray engine make a shard's vectors with the same encoder pass (encode_cells) and hand them
to the same shard writer, and the faiss and Qdrant backends read the shards back with the same loader.

Every file here is written by the one writer (matryoshka2d.outputs: a temporary name, then a rename; a link in
the destination's place is replaced, never written through) and read by the one confined reader
(confined.ConfinedFolder: an index folder holding a link that leaves it is refused before anything in it is opened).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from matryoshka2d import outputs
from matryoshka2d.beir import read_beir_file
from matryoshka2d.cells import Cell
from matryoshka2d.confined import ConfinedFolder, OutsideFolderError
from matryoshka2d.files import read_json

FORMAT = 1
INDEX_KINDS = ("flat", "hnsw", "ivf")
STORAGES = {"float32": 4, "float16": 2, "int8": 1, "int8-direct": 1, "binary": 1 / 8}  # bytes per number
# Storages whose index only shortlists: the shortlist is rescored with the float16 vectors kept beside it.
RESCORED_STORAGES = ("binary", "int8-direct")


class IndexBuildError(ValueError):
    """A build directory or its options are wrong; the message names the directory or the option."""


def cell_name(cell: Cell) -> str:
    """A cell's name in an index (its faiss file, its Qdrant vector): `cell-3x128`, as index folders hold them."""
    return f"cell-{Cell(*cell).label}"


def read_corpus(path: str | Path) -> Iterator[tuple[str, str]]:
    """(id, text) per document of a JSON-lines corpus (.jsonl or .jsonl.gz); a bad line names file and line."""
    for line, key, text in read_beir_file(path, titles=True):
        if len(f"{key}x".splitlines()) != 1:  # ids.txt holds one id a line: a line break in an id would shift them
            raise IndexBuildError(
                f"{path}:{line}: _id {key!r} holds a line break (newline, CR, U+2028 or another); an index stores one "
                "id per line, so such an id would shift every id after it: give the document another _id"
            )
        yield key, text


def input_sha256(block: Sequence[tuple[str, str]]) -> str:
    """sha256 of a shard's input: each document's id and text, in order (what its vectors were made from)."""
    digest = hashlib.sha256()
    for key, text in block:
        digest.update(json.dumps([key, text], ensure_ascii=False).encode("utf-8") + b"\n")
    return digest.hexdigest()


def write_json(path: Path, value: dict) -> None:
    outputs.write_json(path, value, indent=1)  # atomic: a killed build never leaves half a manifest


def confined_index(directory: str | Path, check: bool = True) -> ConfinedFolder:
    """The index folder for reading: with `check`, its links are checked before anything in it is opened (an
    `ids.txt`, a manifest, a shard or a faiss file that links out of it is refused, naming it)."""
    try:
        return ConfinedFolder(directory, "index", check=check)
    except OutsideFolderError as exc:
        raise IndexBuildError(f"{exc}; rebuild the index with `matryoshka2d index build ... --overwrite`") from None


def index_path(index: ConfinedFolder, name: str, field: str) -> Path:
    """A file of the index that the manifest names (`field`), confined to the folder."""
    try:
        return index.path(name, index.folder / "manifest.json", field)
    except OutsideFolderError as exc:
        raise IndexBuildError(f"{exc}; rebuild the index with `matryoshka2d index build ... --overwrite`") from None


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = index_path(confined_index(directory), "manifest.json", "the index manifest")  # links checked first
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
    # By shard name; a list in builds from before that (a resume refuses those, a complete one is read).
    digests = list(inputs.values()) if isinstance(inputs, dict) else inputs
    if inputs is not None and (not isinstance(digests, list) or not all(isinstance(h, str) for h in digests)):
        raise bad("shard_inputs", inputs, "a mapping of shard name to the sha256 of its documents")
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
        for v in files.values()
    ):
        raise bad("files", files, "a mapping of file name to its bytes and sha256")


def corpus_blocks(corpus: Path, shard_size: int, limit: int | None) -> Iterator[list[tuple[str, str]]]:
    """The corpus in blocks of `shard_size` (id, text) pairs: block i is shard i, in every build of it."""
    docs = read_corpus(corpus)
    if limit is not None:
        docs = itertools.islice(docs, limit)
    while block := list(itertools.islice(docs, shard_size)):
        yield block


def shard_file_name(number: int) -> str:
    return f"shard-{number:05d}.npz"


def write_shard(path: Path, ids: list[str], texts: list[str], arrays: dict[str, np.ndarray]) -> None:
    """One shard file, atomically: written under a temporary name, renamed when complete."""
    encoded = [t.encode("utf-8") for t in texts]  # texts as one byte string and end offsets (no pickled objects)
    with outputs.writing(path) as tmp:  # its name ends in .npz, so np.savez adds nothing
        np.savez(
            tmp,
            ids=np.array(ids, dtype=object).astype(str),
            texts_utf8=np.frombuffer(b"".join(encoded), dtype=np.uint8),
            text_ends=np.cumsum([len(t) for t in encoded], dtype=np.int64),
            **arrays,
        )


def read_shard_texts(shard) -> list[str]:
    """The document texts a shard file holds."""
    data, ends = shard["texts_utf8"].tobytes(), shard["text_ends"]
    starts = np.concatenate([[0], ends[:-1]])
    return [data[a:b].decode("utf-8") for a, b in zip(starts, ends, strict=True)]


def load_shards(out: Path, manifest: dict) -> list:
    """The manifest's shard files, in order; a missing or unreadable one is named, with what to do."""
    shards = []
    # A shard that links out of shards/, or a shards/ that links out of the index, is refused before any is read
    # (a build reads only these: the links it is about to replace, such as an ids.txt, do not matter here).
    confined_index(Path(out) / "shards")
    index = confined_index(out, check=False)
    for name in manifest["shards"]:
        path = index_path(index, f"shards/{name}", "shards")
        try:
            shards.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise IndexBuildError(
                f"{path}: the manifest lists this shard but it cannot be read ({exc}); remove its name from "
                f"{out / 'manifest.json'} (and {manifest['documents']} documents less) or rebuild with --overwrite"
            ) from None
    return shards


# ---- what a shard's vectors are made by: the model, and one encoder pass over the shard's texts --------------


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


def encode_cells(
    encoder, texts: list[str], cells: Sequence[Cell], batch_size: int, progress: Callable[[int], None] | None = None
) -> dict[str, np.ndarray]:
    """Unit float32 vectors of every cell for `texts`, from one encoder pass to the deepest cell's layer;
    `progress` is told how many texts each forward pass encoded (a duplicate, encoded once, counts at the end)."""
    done = 0

    def counted(n: int) -> None:
        nonlocal done
        done += n
        progress(n)

    pooled = encoder.pooled_states(texts, sorted({n for n, _ in cells}), batch_size, progress=progress and counted)
    if progress is not None and done < len(texts):
        progress(len(texts) - done)
    arrays = {}
    for n, d in cells:
        v = pooled[n][:, :d]
        arrays[cell_name((n, d))] = (v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)).astype(np.float32)
    return arrays
