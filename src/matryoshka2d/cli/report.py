"""`matryoshka2d report RESULTS...`: eval results side by side (evaluate/report.py); `matryoshka2d report compression
--model M ...`: what a width cut or an exit keeps, ESE's Figure 7 (evaluate/compression_report.py)."""

from __future__ import annotations

from matryoshka2d.cli.args import (
    DEVICE_HELP,
    MODEL_HELP,
    POOLING_CHOICES,
    POOLING_HELP,
    Numbers,
    command,
    positive_float,
    positive_int,
    reads_and_writes,
    seed,
    width_list,
)
from matryoshka2d.cli.results import log

# The options only `report compression` reads (CompressionReport's fields): `report RESULTS` refuses them.
COMPRESSION_OPTIONS = (
    "model",
    "pooling",
    "device",
    "layer",
    "dims",
    "exit",
    "sentences",
    "seed",
    "perplexity",
    "layout",
    "overwrite",
)


def cmd_report(args) -> int:
    if args.results[0] == "compression":  # a results folder named compression is given as ./compression
        return _report_compression(args)
    from matryoshka2d.evaluate.report import write_report

    if given := [name for name in COMPRESSION_OPTIONS if getattr(args, name) not in (None, False)]:
        raise ValueError(f"--{given[0]} belongs to `report compression`; `report RESULTS` puts results side by side")
    paths = write_report(args.results, args.output, names=args.names)
    print(f"report -> {', '.join(map(str, paths))}")
    return 0


def _report_compression(args) -> int:
    from matryoshka2d.evaluate.compression_report import CompressionReport, run

    if len(args.results) > 1:
        raise ValueError(f"`report compression` reads models (--model), not results: drop {' '.join(args.results[1:])}")
    given = {name: getattr(args, name) for name in COMPRESSION_OPTIONS if getattr(args, name) is not None}
    report = CompressionReport(
        models=given.pop("model", None) or [],
        **given,
        output=args.output,
        names=args.names,
        data_dir=args.data_dir,
        progress=not args.quiet,
    )
    markdown, paths = run(report, log=log)
    print(markdown, end="")
    print(f"report compression -> {', '.join(map(str, paths))}")
    return 0


def register(sub, model_args) -> None:
    p = command(
        sub,
        "report",
        cmd_report,
        help="put results side by side: markdown table and difference heatmaps; `report compression`: what a "
        "width cut or an exit keeps (ESE's Figure 7)",
        description="`report RESULTS...` puts eval results side by side. `report compression --model M [--model M2 "
        "...] --dims K FULL [--exit N]` draws, per model, a t-SNE of the STS-B test sentences at (L, FULL) next to "
        "(L, K) (the width view) and to (N, FULL) (the depth view), with the average distance between each "
        "sentence's two points under each panel (ESE, Figure 7) and two distances that do not depend on the "
        "layout; a results folder named compression is given as ./compression.",
    )
    p.add_argument("results", nargs="+", help="result directories or results.json files (first = baseline)")
    p.add_argument(
        "--output", required=True, help="directory for report.md and diff_*.png (compression: .json/.md/.png)"
    )
    p.add_argument("--names", nargs="+", help="a short name per result, or per --model (default: model names)")
    _compression_options(p.add_argument_group("report compression"))
    reads_and_writes(
        p,
        ("results", "--model", "--data-dir"),
        files=("report.md", "compression.json", "compression.md", "compression.png"),
    )


def _compression_options(g) -> None:
    g.add_argument("--model", action="append", help="a model to draw (again for more): " + MODEL_HELP)
    g.add_argument("--pooling", choices=POOLING_CHOICES, help=POOLING_HELP)
    g.add_argument("--device", help=DEVICE_HELP)
    g.add_argument("--layer", type=positive_int, help="L, the layer of the whole vector (default: the model's last)")
    g.add_argument(
        "--dims",
        nargs="+",
        type=width_list,
        action=Numbers,
        help="K FULL: the width view, (L, FULL) against its first K numbers (L, K)",
    )
    g.add_argument("--exit", type=positive_int, help="N: the depth view, (L, FULL) against the exit's (N, FULL)")
    g.add_argument("--sentences", type=positive_int, help="the first N distinct STS-B test sentences (default: all)")
    g.add_argument("--seed", type=seed, help="t-SNE's random_state (default 0)")
    g.add_argument("--perplexity", type=positive_float, help="t-SNE's perplexity (default 30)")
    g.add_argument(
        "--layout",
        choices=["joint", "separate"],
        help="joint (default): one t-SNE of both sets, cuts zero-padded; separate: a t-SNE per set, the cut's "
        "turned onto the whole's",
    )
    g.add_argument("--data-dir", help="shared data root (default: $MATRYOSHKA2D_DATA, else ../shared/data)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--overwrite", action="store_true", help="replace a compression report already in --output")
