"""What a pick weighs and where it writes: the options `matryoshka2d pick` parses into one `PickOptions` for
`pick.picker.run_pick`, which the demo builds too."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class PickOptions:
    """The results to weigh (result folders or their results.json / cascade.json), at most one budget (time per
    query in ms or as a share of the full model's, bytes per vector, or a least score), the backends to time and
    how, and the folder for pick.md, pick.json and pick.png (default: the first results folder)."""

    results: list[str]
    output: str | None = None
    model: str | None = None  # the model to time (default: the one the results name)
    backend: list[str] | None = None  # default: the backends the results were scored with
    storage: str = "float32"
    max_latency_ms: float | None = None
    max_latency_ratio: float | None = None
    max_bytes: float | None = None
    min_score: float | None = None
    batch: int | None = None  # also time calls of this many texts
    threads: int | None = None
    remeasure: bool = False

    @classmethod
    def of(cls, values) -> PickOptions:
        """The options among `values`' attributes (an argparse namespace): one field each."""
        return cls(**{field.name: getattr(values, field.name) for field in fields(cls)})
