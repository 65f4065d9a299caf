"""`matryoshka2d pick`: the quality/cost Pareto frontier over (cell, backend) and the option that fits a budget
(pick/picker.py)."""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.cli.args import command, number, positive_float, positive_int, reads_and_writes


def cmd_pick(args) -> int:
    from matryoshka2d.pick.options import PickOptions
    from matryoshka2d.pick.picker import run_pick

    return run_pick(PickOptions.of(args))


def pick_output(args) -> Path:
    """Where pick writes without --output: beside the first results."""
    first = Path(args.results[0])
    return first if first.is_dir() else first.parent


def register(sub, model_args) -> None:
    p = command(
        sub,
        "pick",
        cmd_pick,
        help="the quality/cost Pareto frontier over (cell, backend) and the option that fits a budget",
        description="Quality from the files `eval` writes (results.json of sts, classification, retrieval grids, "
        "scored by torch or by the onnx / onnx-int8 graphs; cascade.json of `eval retrieval --cascade / --query-layer "
        "/ --query-model`); cost from the encode time per layer measured with each backend on this machine (cached) "
        "and bytes per vector. Writes pick.md, pick.json and pick.png.",
    )
    p.add_argument(
        "--results", nargs="+", required=True, help="result folders or their results.json / cascade.json files"
    )
    _budget_options(p.add_mutually_exclusive_group())
    p.add_argument(
        "--backend",
        nargs="+",
        choices=["torch", "onnx", "onnx-int8"],
        help="backends to time, each with results scored on it (default: the backends the results were scored with)",
    )
    p.add_argument(
        "--batch", type=positive_int, help="also time calls of this many texts (ms per text, offline throughput)"
    )
    p.add_argument(
        "--threads", type=positive_int, help="threads for torch and onnxruntime while timing (default: torch's)"
    )
    p.add_argument("--storage", choices=["float32", "float16", "int8"], default="float32", help="for bytes/vector")
    p.add_argument("--model", help="model to time (default: the one named in the results)")
    p.add_argument("--remeasure", action="store_true", help="time the layers again instead of using the cache")
    p.add_argument("--output", help="directory for pick.md/.json/.png (default: the first results directory)")
    reads_and_writes(p, ("--results", "--model"), files=("pick.md", "pick.json", "pick.png"), default=pick_output)


def _budget_options(budget) -> None:
    budget.add_argument("--max-latency-ms", type=positive_float, help="encode time per query at most this (ms)")
    budget.add_argument(
        "--max-latency-ratio",
        type=positive_float,
        help="encode time per query at most this share of the full model's on the reference backend (torch when "
        "timed), e.g. 0.5",
    )
    budget.add_argument("--max-bytes", type=positive_float, help="bytes per stored vector at most this")
    budget.add_argument("--min-score", type=number, help="the cheapest cell scoring at least this")
