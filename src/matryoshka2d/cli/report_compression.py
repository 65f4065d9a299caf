"""`matryoshka2d report compression`: ESE's Figure 7 for each --model (evaluate/compression.py); its options are
registered with `report` in cli/evaluate.py."""

from __future__ import annotations

import sys
from pathlib import Path

from matryoshka2d.evaluate.grid import EncoderCells, parse_ints

REPORT_FILES = ("compression.json", "compression.md", "compression.png")


def _log(message: str) -> None:
    print(message, file=sys.stderr)


# The options only `report compression` reads: `report RESULTS` refuses them.
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


def report_compression(args) -> int:
    """`report compression`: ESE's Figure 7 for each --model (evaluate/compression.py)."""
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.evaluate import compression
    from matryoshka2d.paths import data_dir

    if len(args.results) > 1:
        raise ValueError(f"`report compression` reads models (--model), not results: drop {' '.join(args.results[1:])}")
    if not args.model:
        raise ValueError("`report compression` needs at least one --model")
    if args.names and len(args.names) != len(args.model):
        raise ValueError(f"--names: {len(args.names)} names for {len(args.model)} models")
    dims = parse_ints(args.dims, "dims")
    if args.exit is None and dims is None:
        raise ValueError("give --dims K FULL (the width view), --exit N (the depth view), or both")
    paths = report_paths(args.output, args.overwrite)  # before the work: an earlier report is named at once
    texts = compression.stsb_sentences(data_dir(args.data_dir), args.sentences)
    seed = 0 if args.seed is None else args.seed
    perplexity = 30.0 if args.perplexity is None else args.perplexity
    layout = args.layout or "joint"
    panels, records = [], []
    for i, model in enumerate(args.model):
        encoder = load_encoder(args, model=model, log=_log)
        name = args.names[i] if args.names else Path(model).name
        layer = encoder.num_layers if args.layer is None else args.layer
        compression.check_views(layer, dims, args.exit, encoder.num_layers, encoder.hidden_size, f"--model {model}")
        full = dims[1] if dims else encoder.hidden_size
        cells = EncoderCells(encoder, [layer, args.exit or layer], [*(dims or ()), full], show_progress=not args.quiet)
        _log(f"{name}: {len(texts)} STS-B test sentences, t-SNE per view")
        panels += compression.model_panels(cells, name, layer, dims, args.exit, texts, seed, perplexity, layout)
        records.append(cells.info())
    settings = {
        "sentences": len(texts),
        "data": "STS-B test (raw), distinct sentences",
        "seed": seed,
        "perplexity": perplexity,
        "layout": layout,
        "tsne": "scikit-learn TSNE, cosine metric, PCA init; joint: one t-SNE per panel, first-K vectors zero-padded "
        "to FULL; separate: one per set, the cut's layout turned onto the whole's (orthogonal Procrustes)",
        "models": records,
    }
    compression.write_report(panels, args.output, settings, overwrite=args.overwrite)  # through the one writer
    print(compression.markdown(panels), end="")
    print(f"report compression -> {', '.join(map(str, paths))}")
    return 0


def report_paths(output, overwrite: bool) -> list[Path]:
    """compression.json, .md and .png in `output`; an earlier report there is replaced only with --overwrite
    (checked before any model loads; evaluate.compression.write_report checks it again for library callers)."""
    out = Path(output)
    paths = [out / name for name in REPORT_FILES]
    if not overwrite and (old := [p for p in paths if p.exists() or p.is_symlink()]):
        raise ValueError(f"--output {out} already holds {old[0].name}; pass --overwrite or choose another folder")
    return paths
