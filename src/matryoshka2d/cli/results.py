"""How a command reports: progress and notes on stderr (`log`), and an evaluation's results written into --output
(results.json/.md/.csv and heatmap.png, evaluate.results) with one line of summary printed (`write_results`)."""

from __future__ import annotations

import sys

# The files an evaluation writes into its --output folder (evaluate.results.write_outputs).
RESULT_FILES = ("results.json", "results.md", "results.csv", "heatmap.png")


def log(message: str) -> None:
    """A progress line or note, on stderr (stdout holds what the command produced)."""
    print(message, file=sys.stderr)


def write_results(result, output: str) -> int:
    """Write an evaluation's results into `output` and print its summary and the files written; exit code 0."""
    from matryoshka2d.evaluate.results import write_outputs

    paths = write_outputs(result, output)
    summary = result.summary
    if summary.get("average") is not None:
        layer, dim = summary["cell"]
        line = f"{result.task} {result.metric}: {summary['average']:.2f} at layer {layer}, dim {dim}"
        if "shallow_average" in summary:
            line += f"; shallow average (layers {summary['shallow_layers']}): {summary['shallow_average']:.2f}"
        print(line)
    print(f"{len(result.scores)} scores in {result.seconds['total']:.1f} s -> {', '.join(map(str, paths))}")
    return 0
