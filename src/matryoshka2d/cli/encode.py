"""`matryoshka2d encode`: one cell of every line of a text file into a .npy, streamed (models/encode_file.py)."""

from __future__ import annotations

import sys

from matryoshka2d.cli.args import command, count, positive_int, reads_and_writes, refuse_pooling_at_static_cell


def _encoder(args):
    from matryoshka2d.cli.args import load_encoder

    return load_encoder(args)


def cmd_encode(args) -> int:
    from matryoshka2d.models.encode_file import encode_file

    if args.layer == 0:
        refuse_pooling_at_static_cell(args, "--layer")
    done = encode_file(
        args.input,
        args.output,
        lambda: _encoder(args),  # called once the output and the text are checked
        layer=args.layer,
        dim=args.dim,
        batch_size=args.batch_size,
        normalize=args.normalize,
    )
    print(
        f"{done.texts} texts -> {done.path} ({done.texts}, {done.dim}) float32 at layer {done.layer}/"
        f"{done.num_layers}, dim {done.dim}/{done.hidden_size} in {done.seconds:.2f} s",
        file=sys.stderr,
    )
    return 0


def register(sub, model_args) -> None:
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
