"""The `matryoshka2d` command: thin wrappers that parse arguments, call the library and print."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np

COMMAND_MODULES = ("matryoshka2d.evaluate.commands", "matryoshka2d.train_cli", "matryoshka2d.compress_cli")
COMMAND_MODULES += ("matryoshka2d.retrieval.commands", "matryoshka2d.demo")  # index, search, pick; demo (issue 10)


def _encoder(args):
    from matryoshka2d.encoder import ElasticEncoder

    return ElasticEncoder(args.model, pooling=getattr(args, "pooling", None), device=getattr(args, "device", None))


def cmd_info(args) -> int:
    info = _encoder(args).info()
    width = max(len(k) for k in info)
    for key, value in info.items():
        shown = f"{value:,}" if key == "parameters" else value
        print(f"{key:<{width}}  {shown}")
    return 0


def read_lines(path: str) -> list[str]:
    """One text per line (UTF-8); '-' reads standard input. Blank lines are kept as empty texts."""
    if path == "-":
        return [line.rstrip("\r\n") for line in sys.stdin]
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"Input file {path} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from exc
    return text.splitlines()


def cmd_encode(args) -> int:
    encoder = _encoder(args)
    texts = read_lines(args.input)
    layer, dim = encoder.check_layer(args.layer), encoder.check_dim(args.dim)
    start = time.perf_counter()
    vectors = encoder.encode(
        texts, layer=layer, dim=dim, batch_size=args.batch_size, normalize=args.normalize, show_progress=True
    )
    seconds = time.perf_counter() - start
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, vectors)
    print(
        f"{len(texts)} texts -> {out} {vectors.shape} float32 at layer {layer}/{encoder.num_layers}, "
        f"dim {dim}/{encoder.hidden_size} in {seconds:.2f} s",
        file=sys.stderr,
    )
    return 0


def cmd_models(args) -> int:
    from matryoshka2d.backbones import SHORT_NAMES, cache_dir, minilm_dir, prepare_mpnet

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="matryoshka2d", description="Sentence embeddings elastic in depth (layers) and width (dims)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p, default="minilm-l6"):
        p.add_argument("--model", default=default, help="short name (minilm-l6, mpnet-base), directory or hub id")
        p.add_argument("--pooling", choices=["mean", "cls", "last-token"], help="override the model's pooling")
        p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")

    p = sub.add_parser("info", help="layers, hidden size, pooling and parameters of a model")
    p.add_argument("model", help="short name, directory or hub id")
    p.add_argument("--pooling", choices=["mean", "cls", "last-token"])
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("encode", help="embed one text per line of a file at one (layer, dim) cell into a .npy")
    model_args(p)
    p.add_argument("--layer", type=int, help="exit after this many layers (default: all)")
    p.add_argument("--dim", type=int, help="keep the first DIM numbers (default: all)")
    p.add_argument("--input", required=True, help="UTF-8 text file, one text per line ('-' for stdin)")
    p.add_argument("--output", required=True, help="where to write the float32 .npy array")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--normalize", action="store_true", help="L2-normalise each vector after slicing")
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("models", help="list short model names or prepare one offline")
    msub = p.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="short names and the cache directory")
    mp = msub.add_parser("prepare", help="unpack a short-name model into the cache (mpnet-base)")
    mp.add_argument("name")
    mp.add_argument("--force", action="store_true", help="unpack again even if present")
    p.set_defaults(func=cmd_models)

    # Larger command groups live next to their code; each module has register(subparsers, model_args).
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub, model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, OSError) as exc:
        print(f"matryoshka2d {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
