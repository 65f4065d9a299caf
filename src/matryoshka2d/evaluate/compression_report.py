"""`report compression` as one call: ESE's Figure 7 for each model (evaluate/compression.py), a t-SNE of the STS-B
test sentences at (L, FULL) next to (L, K) (the width view) and to (N, FULL) (the depth view), written as
compression.json, .md and .png. The command parses its options into a `CompressionReport` and calls `run`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matryoshka2d.evaluate import compression
from matryoshka2d.evaluate.grid import EncoderCells

REPORT_FILES = ("compression.json", "compression.md", "compression.png")
TSNE_RECORD = (
    "scikit-learn TSNE, cosine metric, PCA init; joint: one t-SNE per panel, first-K vectors zero-padded to FULL; "
    "separate: one per set, the cut's layout turned onto the whole's (orthogonal Procrustes)"
)


@dataclass
class CompressionReport:
    """What to draw: the models (names or folders), the views (`dims` K FULL: the width view; `exit` N: the depth
    view), the layer L of the whole vector (default: each model's last), and the t-SNE's settings."""

    models: list[str]
    output: str | Path
    dims: list[int] | None = None
    exit: int | None = None
    layer: int | None = None
    names: list[str] | None = None
    pooling: str | None = None
    device: str | None = None
    sentences: int | None = None  # the first N distinct STS-B test sentences (default: all)
    seed: int = 0
    perplexity: float = 30.0
    layout: str = "joint"
    data_dir: str | None = None
    overwrite: bool = False
    progress: bool = True

    def check(self) -> list[Path]:
        """The options checked together, and the files the report will write (an earlier report there is named
        at once unless `overwrite`), before any model loads."""
        if not self.models:
            raise ValueError("`report compression` needs at least one --model")
        if self.names and len(self.names) != len(self.models):
            raise ValueError(f"--names: {len(self.names)} names for {len(self.models)} models")
        if self.exit is None and not self.dims:
            raise ValueError("give --dims K FULL (the width view), --exit N (the depth view), or both")
        out = Path(self.output)
        paths = [out / name for name in REPORT_FILES]
        if not self.overwrite and (old := [p for p in paths if p.exists() or p.is_symlink()]):
            raise ValueError(f"--output {out} already holds {old[0].name}; pass --overwrite or choose another folder")
        return paths


def run(report: CompressionReport, log: Callable[[str], None] | None = None) -> tuple[str, list[Path]]:
    """Draw every model's views and write the report (evaluate.compression.write_report, through the one writer):
    (the table as markdown, the files written)."""
    from matryoshka2d.models.backbones import check_device
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.paths import data_dir

    log = log or (lambda message: print(message, file=sys.stderr))
    report.check()
    check_device(report.device)
    texts = compression.stsb_sentences(data_dir(report.data_dir), report.sentences)
    dims, panels, records = report.dims or None, [], []
    for i, model in enumerate(report.models):
        encoder = ElasticEncoder(model, pooling=report.pooling, device=report.device)
        name = report.names[i] if report.names else Path(model).name
        layer = encoder.num_layers if report.layer is None else report.layer
        compression.check_views(layer, dims, report.exit, encoder.num_layers, encoder.hidden_size, f"--model {model}")
        full = dims[1] if dims else encoder.hidden_size
        cells = EncoderCells(
            encoder, [layer, report.exit or layer], [*(dims or ()), full], show_progress=report.progress
        )
        log(f"{name}: {len(texts)} STS-B test sentences, t-SNE per view")
        panels += compression.model_panels(
            cells, name, layer, dims, report.exit, texts, report.seed, report.perplexity, report.layout
        )
        records.append(cells.info())
    settings = {
        "sentences": len(texts),
        "data": "STS-B test (raw), distinct sentences",
        "seed": report.seed,
        "perplexity": report.perplexity,
        "layout": report.layout,
        "tsne": TSNE_RECORD,
        "models": records,
    }
    paths = compression.write_report(panels, report.output, settings, overwrite=report.overwrite)
    return compression.markdown(panels), paths
