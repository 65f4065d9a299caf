"""A cascade evaluation as one call: `evaluate_cascade` (flat full-cell search next to a cascade, shallow queries,
query encoders and storage tiers) written into a results folder as cascade.json and cascade.md, the files `pick`
reads, through the one writer. `eval retrieval --cascade / --query-layer / --query-model / --storage` calls it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from matryoshka2d.outputs import write_text
from matryoshka2d.retrieval.cascade import cascade_markdown, evaluate_cascade

CASCADE_FILES = ("cascade.json", "cascade.md")


def write_cascade_evaluation(
    output: str | Path, encoder, directories: Sequence[str | Path], split: str, **options
) -> tuple[dict, list[Path]]:
    """Run `evaluate_cascade(encoder, directories, split, **options)` and write its result into `output` (the
    folder named by --output): (the result, the files written)."""
    result = evaluate_cascade(encoder, directories, split, **options)
    json_file, markdown_file = (Path(output) / name for name in CASCADE_FILES)
    write_text(json_file, json.dumps(result, indent=1) + "\n", "--output")
    write_text(markdown_file, cascade_markdown(result), "--output")
    return result, [json_file, markdown_file]
