"""Combinations of `distill`'s options that would train or evaluate nothing of what the run makes, refused before
any work: `matryoshka2d distill` calls these as it parses its options (cli/distill.py), DistillTrainer as it builds
its objective (for a library caller's TrainConfig), so both refuse alike.
"""

from __future__ import annotations

from collections.abc import Iterable


class DistillOptionsError(ValueError):
    """Options that would do nothing together; the message names them."""


def check_eval_cells(mode: str, layer: int | None, cells: Iterable[tuple[int, int]] | None) -> None:
    """--eval-cell names cells of what the run makes: with --mode query the query encoder's own cell (its last
    layer, `layer`), and none with --mode static, whose run evaluates the static cell (layer 0, which --eval-cell
    cannot name) by itself; a cell of the frozen teacher's layers would be evaluated in its place, every time the
    same."""
    cells = [tuple(cell) for cell in cells or ()]
    if not cells:
        return
    named = ",".join(f"{n}:{d}" for n, d in cells)
    if mode == "static":
        raise DistillOptionsError(
            f"--eval-cell {named} would evaluate the teacher's frozen layers with --mode static: only the static "
            "cell (layer 0) trains, and the run evaluates it on STS-B dev at layer 0, full width (every --eval-steps "
            "and at the end); leave --eval-cell out"
        )
    if mode == "query" and layer is not None:
        other = ",".join(f"{n}:{d}" for n, d in cells if n != layer)
        if other:
            raise DistillOptionsError(
                f"--eval-cell {other}: the query encoder of --layer {layer} has {layer} layers and is saved as its "
                f"cell at layer {layer} (its head on that layer only); evaluate it at {layer}:DIM"
            )


def check_exit_heads_sentences(start: str | None, sentences_given: bool) -> None:
    """--exit-heads-sentences sizes the closed-form start of the heads (--exit-heads fit) only."""
    starts = {"identity": "the identity", "keep": "the teacher's own heads"}
    if sentences_given and start in starts:
        raise DistillOptionsError(
            f"--exit-heads-sentences sets how many texts the closed-form start of the heads is fitted on (--exit-heads "
            f"fit); --exit-heads {start} starts from {starts[start]} and fits nothing: leave it out"
        )
