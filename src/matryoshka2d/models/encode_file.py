"""One cell of every line of a text file into a .npy, streamed: `matryoshka2d encode` parses its options and calls
`encode_file`. Memory stays bounded whatever the size of the input; the array is written as it is computed, through
the one writer (a temporary file beside it, renamed into place when whole: an error or Ctrl-C leaves no half array,
and a link in its place is replaced, never written through). The lines are counted first (the header's row
count) and encoded in a second pass; an input that changes between them (cut, grown, rewritten or replaced) is
refused, naming it, and nothing is written: a header over rows it does not describe is no array."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from matryoshka2d.allocator import fix_mmap_threshold, trim_heap
from matryoshka2d.files import changed_since, input_state, iter_lines, open_input
from matryoshka2d.outputs import check_destination, open_for_writing

ENCODE_CHUNK = 1024  # lines embedded per chunk: memory stays bounded whatever the size of the input
# oneDNN keeps a primitive per shape it has run (1,024 by default) with its scratch memory; length groups make
# batches of many shapes, so over a long input that cache alone grew the heap by tens of MB (docs/benchmarks.md,
# encode memory). A few dozen cover the shapes that repeat within a chunk. Read at oneDNN's first use, so it is
# set before the model runs; a value in the environment wins.
ONEDNN_CACHE_CAPACITY = "64"
# Tokens per batch once texts are long: 64 texts of up to 64 tokens batch as asked, 256-token texts 16 at a time.
# A batch's activations grow with batch x length (x length for attention); this caps the peak at any input.
TOKEN_BUDGET = 64 * 64


@dataclass
class EncodedFile:
    """What `encode_file` wrote: `texts` rows of the cell (`layer`, `dim`) of `model` into `path`."""

    path: Path
    texts: int
    layer: int
    dim: int
    model: str
    num_layers: int
    hidden_size: int
    seconds: float


NOTHING_WRITTEN = ": no .npy was written; encode it again once the file is complete"


class InputChanged(ValueError):
    """The input changed between the pass that counted its lines (the .npy header's row count) and the pass that
    encoded them: the array would not be its lines, so none is written."""


def refuse_if_changed(binary, source: str, name: str, opened) -> None:
    """An InputChanged naming the input if it is not the file that was opened and counted (files.changed_since)."""
    if what := changed_since(binary, source, opened):
        raise InputChanged(f"--input {name} changed while it was read ({what}){NOTHING_WRITTEN}")


def npy_path(output: str | Path) -> Path:
    """Where the array goes: like numpy.save, '.npy' is added to a name without it."""
    out = Path(output)
    return out if out.suffix == ".npy" else out.with_name(out.name + ".npy")


def encode_chunk(encoder, texts: list[str], layer: int, dim: int, batch_size: int, normalize: bool) -> np.ndarray:
    """Embed texts in length groups of at most `batch_size` texts and TOKEN_BUDGET padded tokens (one tokenizer
    call for the chunk)."""
    from matryoshka2d.cells import unit_rows

    pooled = encoder.pooled_states(texts, [layer], batch_size, token_budget=TOKEN_BUDGET)[layer][:, :dim]
    return unit_rows(pooled) if normalize else np.ascontiguousarray(pooled)


def encode_file(
    source: str,
    output: str | Path,
    load_encoder: Callable[[], object],
    layer: int | None = None,
    dim: int | None = None,
    batch_size: int = 64,
    normalize: bool = False,
) -> EncodedFile:
    """Every line of `source` (a UTF-8 text file, '-' for stdin) at cell (`layer`, `dim`) (default: the full
    cell) into the float32 array `output` ('.npy' added). The output is checked and the text read through once
    before `load_encoder()` is called, so that a bad output or text costs no model."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    out = check_destination(npy_path(output), "--output")  # '.npy' added: the file written is checked too
    fix_mmap_threshold()  # activations must not fragment the heap (matryoshka2d.allocator)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)
    binary, name = open_input(source)
    with binary:
        opened = input_state(binary, source)  # the header says `count` rows: the file must stay as counted
        count = sum(1 for _ in iter_lines(binary, name))  # also checks the text before any model work
        encoder = load_encoder()
        layer, dim = encoder.check_layer(layer), encoder.check_dim(dim)
        start = time.perf_counter()
        with open_for_writing(out, "wb", "--output") as f:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False}
            np.lib.format.write_array_header_1_0(f, {**header, "shape": (count, dim)})
            lines, written = iter_lines(binary, name), 0
            with tqdm(total=count, desc=f"encode {encoder.name}", unit="text", disable=count == 0) as bar:
                try:
                    while chunk := list(itertools.islice(lines, ENCODE_CHUNK)):
                        vectors = encode_chunk(encoder, chunk, layer, dim, batch_size, normalize)
                        f.write(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
                        written += len(chunk)
                        bar.update(len(chunk))
                        trim_heap()
                except ValueError:  # a file cut inside a character reads as one not UTF-8: say it was cut
                    refuse_if_changed(binary, source, name, opened)
                    raise
            refuse_if_changed(binary, source, name, opened)
            if written != count:  # changed within its clock's tick: the rows are still not the header's
                raise InputChanged(
                    f"--input {name} changed while it was read ({count:,} lines when counted, "
                    f"{written:,} when encoded){NOTHING_WRITTEN}"
                )
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    return EncodedFile(out, count, layer, dim, encoder.name, encoder.num_layers, encoder.hidden_size, seconds)
