"""`matryoshka2d export`: one (layer, dim) cell, or a model and its query side, as a standalone folder
(export/cell.py, export/pair.py); parse the arguments, call the library, print its report."""

from __future__ import annotations

import argparse
from pathlib import Path

from matryoshka2d.cli.args import command, count, positive_int, reads_and_writes, refuse_pooling_at_static_cell


def cmd_export(args) -> int:
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.export.cell import export_cell

    if args.query_model or args.query_cell:
        return export_pair_command(args)
    if args.layer is None or args.dim is None:
        raise ValueError("export needs --layer and --dim (a cell), or --query-model / --query-cell (a pair)")
    if args.layer == 0:
        refuse_pooling_at_static_cell(args, "--layer")
    encoder = load_encoder(args, device="cpu")
    report = export_cell(
        encoder,
        args.layer,
        args.dim,
        args.output,
        fmt=args.format,
        quantize=args.quantize,
        overwrite=args.overwrite,
        normalize=args.normalize,
        sts_file=args.sts_file,
    )
    print("\n".join(report.lines()))
    return 0


def export_pair_command(args) -> int:
    """export --query-model FOLDER | --query-cell LAYERxDIM: the model and its query side as one folder."""
    from matryoshka2d.cells import Cell
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.export.pair import export_pair

    if args.query_model and args.query_cell:
        raise ValueError("give --query-model or --query-cell, not both: a pair has one query side")
    if args.layer is not None or args.dim is not None or args.normalize is not None:
        raise ValueError("--layer, --dim and --normalize export one cell; a pair's cells are its query side's")
    cell = Cell.parse(args.query_cell, "--query-cell") if args.query_cell else None
    encoder = load_encoder(args, device="cpu")
    report = export_pair(
        encoder,
        Path(args.output),
        query_model=args.query_model,
        query_cell=cell,
        fmt=args.format,
        quantize=args.quantize,
        overwrite=args.overwrite,
    )
    print("\n".join(report.lines()))
    return 0


def register(sub, model_args) -> None:
    p = command(
        sub,
        "export",
        cmd_export,
        help="write one (layer, dim) cell as a standalone model (sentence-transformers folder, ONNX, int8)",
        description="A folder holding only LAYER layers (config and weights cut), the model's pooling, the first "
        "DIM numbers and Normalize as the cell does: plain SentenceTransformer(OUTPUT) gives the cell's "
        "embeddings and AutoModel.from_pretrained(OUTPUT) loads the cut transformer. Prints size on disk and "
        "parameters kept.",
    )
    model_args(p)
    p.add_argument(
        "--layer",
        type=count,
        help="keep this many transformer layers (one cell); 0: the model's static cell, as StaticEmbedding and "
        "Dense modules",
    )
    p.add_argument("--dim", type=positive_int, help="keep the first DIM numbers of each embedding (one cell)")
    p.add_argument(
        "--query-model",
        help="a pair: this query encoder (`distill --mode query` from --model) for encode_query, --model for "
        "encode_document, as one sentence-transformers folder (Router.for_query_document)",
    )
    p.add_argument(
        "--query-cell",
        metavar="LAYERxDIM",
        help="a pair: this shallow cell of --model for encode_query, its last layer at the same width for "
        "encode_document, as one sentence-transformers folder",
    )
    p.add_argument("--output", required=True, help="folder to write (must be empty or absent, see --overwrite)")
    p.add_argument("--format", choices=["st", "onnx"], default="st", help="onnx adds onnx/cell.onnx (extra [onnx])")
    p.add_argument("--quantize", choices=["int8"], help="add onnx/cell_int8.onnx (dynamic int8; needs --format onnx)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise after slicing (default: as the model does; it has a Normalize module or not)",
    )
    p.add_argument("--sts-file", help="STS-B test TSV for the int8 score (default: the shared data's stsb_test.tsv)")
    reads_and_writes(p, ("--model", "--query-model", "--sts-file"))
