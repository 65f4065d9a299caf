"""`matryoshka2d info`, `encode` and `models`: a model's facts, one cell of a text file into a .npy, short names."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from matryoshka2d.allocator import fix_mmap_threshold, trim_heap
from matryoshka2d.cli.args import (
    POOLING_CHOICES,
    command,
    command_group,
    count,
    heads_flag,
    positive_int,
    reads_and_writes,
    refuse_pooling_at_static_cell,
)
from matryoshka2d.files import iter_lines, open_input
from matryoshka2d.outputs import check_destination, open_for_writing


def _encoder(args):
    from matryoshka2d.cli.args import load_encoder

    return load_encoder(args)


def cmd_info(args) -> int:
    info = _encoder(args).info()
    width = max(len(k) for k in info)
    for key, value in info.items():
        shown = f"{value:,}" if key == "parameters" else value
        print(f"{key:<{width}}  {shown}")
    return 0


ENCODE_CHUNK = 1024  # lines embedded per chunk: memory stays bounded whatever the size of the input
# oneDNN keeps a primitive per shape it has run (1,024 by default) with its scratch memory; length groups make
# batches of many shapes, so over a long input that cache alone grew the heap by tens of MB (docs/benchmarks.md,
# encode memory). A few dozen cover the shapes that repeat within a chunk. Read at oneDNN's first use, so it is
# set before the model runs; a value in the environment wins.
ONEDNN_CACHE_CAPACITY = "64"
# Tokens per batch once texts are long: 64 texts of up to 64 tokens batch as asked, 256-token texts 16 at a time.
# A batch's activations grow with batch x length (x length for attention); this caps the peak at any input.
TOKEN_BUDGET = 64 * 64


def npy_path(output: str) -> Path:
    """Where the array goes: like numpy.save, '.npy' is added to a name without it."""
    out = Path(output)
    return out if out.suffix == ".npy" else out.with_name(out.name + ".npy")


def encode_chunk(encoder, texts: list[str], layer: int, dim: int, batch_size: int, normalize: bool) -> np.ndarray:
    """Embed texts in length groups of at most `batch_size` texts and TOKEN_BUDGET padded tokens (one tokenizer
    call for the chunk)."""
    from matryoshka2d.views import unit_rows

    pooled = encoder.pooled_states(texts, [layer], batch_size, token_budget=TOKEN_BUDGET)[layer][:, :dim]
    return unit_rows(pooled) if normalize else np.ascontiguousarray(pooled)


def cmd_encode(args) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.layer == 0:
        refuse_pooling_at_static_cell(args, "--layer")
    out = check_destination(npy_path(args.output), "--output")  # '.npy' added: the file written is checked too
    fix_mmap_threshold()  # activations must not fragment the heap (matryoshka2d.allocator)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)
    binary, name = open_input(args.input)
    with binary:
        count = sum(1 for _ in iter_lines(binary, name))  # also checks the text before any model work
        encoder = _encoder(args)
        layer, dim = encoder.check_layer(args.layer), encoder.check_dim(args.dim)
        start = time.perf_counter()
        # The .npy is written as it is computed: the header (shape known from the count), then each chunk's rows,
        # into the one writer's temporary file beside it, renamed into place when whole (an error or Ctrl-C leaves
        # no half array; a link in its place is replaced, never written through).
        with open_for_writing(out, "wb", "--output") as f:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False}
            np.lib.format.write_array_header_1_0(f, {**header, "shape": (count, dim)})
            lines = iter_lines(binary, name)
            with tqdm(total=count, desc=f"encode {encoder.name}", unit="text", disable=count == 0) as bar:
                while chunk := list(itertools.islice(lines, ENCODE_CHUNK)):
                    vectors = encode_chunk(encoder, chunk, layer, dim, args.batch_size, args.normalize)
                    f.write(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
                    bar.update(len(chunk))
                    trim_heap()
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    print(
        f"{count} texts -> {out} ({count}, {dim}) float32 at layer {layer}/{encoder.num_layers}, "
        f"dim {dim}/{encoder.hidden_size} in {seconds:.2f} s",
        file=sys.stderr,
    )
    return 0


def cmd_models(args) -> int:
    from matryoshka2d.models.backbones import SHORT_NAMES, cache_dir, minilm_dir, prepare_mpnet

    if args.action == "list":
        for name, what in SHORT_NAMES.items():
            print(f"{name:<12} {what}")
        print(f"cache: {cache_dir()}")
        return 0
    if args.name == "minilm-l6":
        print(f"minilm-l6 needs no preparation: {minilm_dir()}")
    elif args.name == "mpnet-base":
        print(f"mpnet-base ready at {prepare_mpnet(force=args.force)}")
    else:
        raise ValueError(f"Nothing to prepare for '{args.name}'; short names: {', '.join(SHORT_NAMES)}")
    return 0


def register(sub, model_args) -> None:
    p = command(sub, "info", cmd_info, help="layers, hidden size, pooling and parameters of a model")
    p.add_argument("model", help="short name, directory or hub id")
    p.add_argument("--pooling", choices=POOLING_CHOICES)
    heads_flag(p)

    p = command(
        sub, "encode", cmd_encode, help="embed one text per line of a file at one (layer, dim) cell into a .npy"
    )
    model_args(p)
    p.add_argument(
        "--layer",
        type=count,
        help="exit after this many layers (default: all); 0: the model's static cell (distill --mode static)",
    )
    p.add_argument("--dim", type=positive_int, help="keep the first DIM numbers (default: all)")
    p.add_argument(
        "--input", required=True, help="UTF-8 text file, one text per line, split on \\n only ('-' for stdin)"
    )
    p.add_argument("--output", required=True, help="where to write the float32 .npy array ('.npy' is added if missing)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--normalize", action="store_true", help="L2-normalise each vector after slicing")
    reads_and_writes(p, ("--input", "--model"), files=("",))

    msub = command_group(
        sub, "models", help="list short model names or prepare one offline", dest="action", func=cmd_models
    )
    msub.add_parser("list", help="short names and the cache directory")
    mp = msub.add_parser("prepare", help="unpack a short-name model into the cache (mpnet-base)")
    mp.add_argument("name")
    mp.add_argument("--force", action="store_true", help="unpack again even if present")
