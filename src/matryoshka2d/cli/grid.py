"""What `eval sts`, `eval classification` and `eval retrieval` share: their options (the cells, the backend that
computes them, the output), the cells of --model as torch or a serving backend computes them, and one evaluation
run (with --compare-heads, twice from one pass) written into --output."""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.cli.args import (
    Numbers,
    layer_list,
    only_static_layers,
    positive_int,
    reads_and_writes,
    refuse_pooling_at_static_cell,
    token_length,
    width_list,
)
from matryoshka2d.cli.results import RESULT_FILES, log, write_results

# What an evaluation reads (the options each command has) and the files it writes into --output.
EVAL_READS = ("--model", "--data-dir", "--reducer-corpus", "--classification-dir", "--dataset-dir", "--corpus")
EVAL_READS += ("--queries", "--qrels", "--query-model")
EVAL_WRITES = (*RESULT_FILES, "cascade.json", "cascade.md", "no-heads")
DATA_DIR_HELP = "shared data root (default: $MATRYOSHKA2D_DATA, else ../shared/data)"


def grid_options(p, model_args, caches: tuple[str, ...] = ()) -> None:
    """The options every grid evaluation has: the model, its cells, the backend, the output."""
    reads_and_writes(p, EVAL_READS, files=EVAL_WRITES, caches=caches)
    model_args(p)
    p.add_argument(
        "--layers", nargs="+", type=layer_list, action=Numbers, help="layers to evaluate: 1 2 3, 1,2,3 or 1-6"
    )
    p.add_argument(
        "--dims", nargs="+", type=width_list, action=Numbers, help="leading dims to evaluate: 64 128 384, or 64,128,384"
    )
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--max-length", type=token_length, help="truncate texts to this many tokens (default: the model's)")
    p.add_argument("--data-dir", help=DATA_DIR_HELP)
    p.add_argument("--output", required=True, help="directory for results.json/.md/.csv and heatmap.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--backend",
        choices=["torch", "onnx"],
        default="torch",
        help="what computes the cells: torch, or the ONNX graphs `serve --backend onnx` serves (built and cached "
        "the same way; results record each graph's sha256)",
    )
    p.add_argument("--quantize", choices=["int8"], help="onnx backend: score the dynamic int8 graphs")
    p.add_argument(
        "--compare-heads",
        action="store_true",
        help="also score every cell without the exit heads, from the same encoder pass (into OUTPUT/no-heads)",
    )


def served_backend(args) -> str:
    """The backend named by --backend and --quantize (serve/served.py), checked before any model is loaded."""
    from matryoshka2d.serve.served import backend_name

    if args.quantize and args.backend != "onnx":
        raise ValueError("--quantize int8 applies to --backend onnx (the torch backend scores in fp32)")
    if args.backend == "onnx":
        if getattr(args, "compare_heads", False):
            raise ValueError(
                "--compare-heads scores torch's cells with and without heads from one pass; drop it with "
                "--backend onnx (the graphs hold the heads)"
            )
        if args.device not in (None, "cpu"):
            raise ValueError(f"--backend onnx runs on the CPU (onnxruntime); drop --device {args.device}")
    return backend_name(args.backend, args.quantize)


def check_layers(args) -> None:
    """Before anything loads: --pooling where every layer asked for is 0, the static cell, would do nothing."""
    if only_static_layers(args.layers):
        refuse_pooling_at_static_cell(args, "--layers")


def cell_embedder(args, default_cells=None):
    """The encoder named by --model, wrapped to give the cells of --layers x --dims (or the defaults), computed
    by torch or by the serving backend's graphs (--backend onnx [--quantize int8])."""
    from matryoshka2d.cli.args import load_encoder

    backend = served_backend(args)
    encoder = load_encoder(
        args, max_length=args.max_length, log=log, **({"device": "cpu"} if backend != "torch" else {})
    )
    layers, dims = args.layers, args.dims
    if default_cells is not None:
        default_layers, default_dims = default_cells(encoder.num_layers, encoder.hidden_size)
        layers, dims = layers or default_layers, dims or default_dims
    if backend != "torch":
        return _served_cells(args, encoder, backend, layers, dims)
    from matryoshka2d.evaluate.grid import EncoderCells

    compare = bool(getattr(args, "compare_heads", False))
    if compare and encoder.exit_heads is None:
        raise ValueError(f"--compare-heads: {encoder.name} has no exit heads to compare (heads fit makes them)")
    return EncoderCells(
        encoder, layers, dims, batch_size=args.batch_size, show_progress=not args.quiet, compare_heads=compare
    )


def _served_cells(args, encoder, backend: str, layers, dims):
    from matryoshka2d.evaluate import grid
    from matryoshka2d.serve.served import BackendCells, make_backend

    layers, dims = grid.check_cells(  # before any graph is built
        layers or encoder.layers,
        dims or grid.default_dims(encoder.hidden_size),
        encoder.num_layers,
        encoder.hidden_size,
        static=encoder.static_cell is not None,
    )
    served = make_backend(encoder, backend, layers, batch_size=args.batch_size, log=log)
    return BackendCells(encoder, served, layers, dims, show_progress=not args.quiet)


def evaluate_into_output(args, run, embedder) -> int:
    """Run one evaluator; with --compare-heads also on the cells without heads from the same pass: results
    in --output and --output/no-heads, and the gain per cell."""
    result = run(embedder)
    code = write_results(result, args.output)
    if not getattr(args, "compare_heads", False):
        return code
    without = run(embedder.without_heads())
    write_results(without, str(Path(args.output) / "no-heads"))
    metric = result.metric
    gains = {(r["layer"], r["dim"]): r[metric] for r in result.average}
    print(f"exit heads, {result.task} {metric} average: without -> with (gain)")
    for row in without.average:
        cell = (row["layer"], row["dim"])
        if cell in gains and row.get(metric) is not None:
            print(f"  ({cell[0]},{cell[1]}): {row[metric]:.2f} -> {gains[cell]:.2f} ({gains[cell] - row[metric]:+.2f})")
    return code
