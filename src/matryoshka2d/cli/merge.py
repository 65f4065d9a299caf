"""`matryoshka2d merge`: a weighted average of runs of one start (WiSE-FT, model soups; training/merge.py)."""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.cli.args import number, reads_and_writes


def cmd_merge(args) -> int:
    from matryoshka2d.cli.args import check_new_output, folder_metadata, load_encoder
    from matryoshka2d.training.checkpoints import save_model_atomically
    from matryoshka2d.training.merge import (
        STATIC_KEPT,
        check_different_folders,
        merge_encoders,
        merge_weights,
        static_cells,
    )

    out = Path(args.output)
    check_new_output(out, args.overwrite)
    weights = merge_weights(args.weights, len(args.models))  # before loading anything: a typo fails at once
    check_different_folders(args.models)
    encoders = [load_encoder(args, model=m) for m in args.models]
    metadata = folder_metadata(encoders[0])
    for stale in ("final_eval", "final_evals"):  # the first run's scores are not the average's
        metadata.pop(stale, None)
    metadata["merge"] = {
        "models": [e.location or e.name for e in encoders],
        "weights": weights,
        "rule": "weighted average of every weight (transformer, pooler head, exit heads); WiSE-FT / model soups",
    }
    merged = merge_encoders(encoders, weights, allow_different_starts=args.allow_different_starts)
    # what became of layer 0 (averaged, or dropped with the transformers averaged): the same answer after the merge,
    # which keeps a transformer every model shares exactly as it was
    cells = static_cells(encoders)
    saved = save_model_atomically(lambda folder: save_merged(merged, folder, metadata), out)
    parts = " + ".join(f"{w:g} x {m}" for w, m in zip(weights, args.models, strict=True))
    print(f"merged {parts} -> {saved}")
    if cells is not None:
        print(f"static cells (layer 0) of every model averaged and kept in {saved}" if cells == STATIC_KEPT else cells)
    return 0


def save_merged(merged, folder: Path, metadata: dict) -> Path:
    """The averaged model; an average of query encoders (training.merge.check_query_encoders) gets its record's
    own weights checksum and width stated for its own weights, as `distill` does for a student."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.query_record import query_encoder_record, record_own_identity

    saved = merged.save(folder, metadata=metadata)
    if query_encoder_record(merged) is not None:
        record_own_identity(saved, ElasticEncoder(str(saved), device="cpu"))
    return saved


def register(sub, model_args) -> None:
    p = sub.add_parser(
        "merge",
        help="average the weights of runs of one start (WiSE-FT, model soups)",
        description="Write the weighted average of models fine-tuned from one start, every weight alike (the "
        "transformer, a pooler head, the exit heads). With a trained run and the model it started from this is "
        "WiSE-FT (weights alpha, 1 - alpha); with several runs, a model soup. The models must share architecture, "
        "tokenizer, pooling and heads layout; the first gives everything that is not a weight.",
    )
    p.add_argument("--models", nargs="+", required=True, help="model folders (or names), two or more")
    p.add_argument(
        "--weights",
        nargs="+",
        type=number,
        help="one weight per model, in their order, summing to 1 (default: equal weights)",
    )
    p.add_argument("--output", required=True, help="folder for the averaged model")
    p.add_argument("--device", default="cpu", help="where the average is computed (default: cpu)")
    p.add_argument(
        "--allow-different-starts",
        action="store_true",
        help="average models that are not runs of one start (their records name other start models)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    p.set_defaults(func=cmd_merge)
    reads_and_writes(p, ("--models",))
