"""`matryoshka2d heads fit`: exit heads fitted in closed form on unlabelled text, written with the model into a new
folder (training/heads_run.py)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from matryoshka2d.cli.args import Numbers, exit_list, positive_float, positive_int, reads_and_writes
from matryoshka2d.cli.results import log


def cmd_heads_fit(args) -> int:
    from matryoshka2d.cli.args import check_new_output, folder_metadata, load_encoder
    from matryoshka2d.training.heads_run import HeadsFit, fit_heads_into, gain_table

    out = Path(args.output)
    check_new_output(out, args.overwrite)
    fit = HeadsFit(**{field.name: getattr(args, field.name) for field in dataclasses.fields(HeadsFit)})
    fit.check()
    args.no_heads = True  # fit on the backbone alone: heads already in the folder are replaced
    encoder = load_encoder(args, log=lambda _m: None)
    heads, report, saved = fit_heads_into(out, encoder, fit, folder_metadata(encoder), log)
    strengths = ", ".join(f"{n}: {v:g}" for n, v in report.strengths.items())
    print(
        f"fitted {heads.describe()} on {report.sentences} sentences ({report.held_out} held out; ridge strength "
        f"{heads.record['ridge_chosen_by']}; lambda/n per layer: {strengths}) in {report.seconds:.1f} s -> {saved}"
    )
    print("\n".join(gain_table(encoder)))
    return 0


def register(sub, model_args) -> None:
    p = sub.add_parser("heads", help="exit heads: a small map at every exit into the last layer's space")
    hsub = p.add_subparsers(dest="action", required=True)
    f = hsub.add_parser(
        "fit",
        help="fit exit heads in closed form on unlabelled text and write the model with them",
        description="One encoder pass over the text fits one affine head per exit layer l < N by ridge regression "
        "from the pooled layer-l vector to the last layer's vector (normal equations in float64, streamed; the "
        "ridge strength chosen on STS-B dev where it is found, else on a held-out tenth). No labels are used. "
        "The model with its heads is written to --output; the input model is not changed.",
    )
    model_args(f, heads=False)
    f.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="training data (TSV/JSONL triplets, NLI or scored pairs), plain text files, or a BEIR corpus",
    )
    f.add_argument("--output", required=True, help="folder for the model with its heads")
    _fit_options(f)
    f.add_argument("--max-sentences", type=positive_int, help="use at most this many distinct sentences (default: all)")
    f.add_argument(
        "--exclude-sts-test",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="leave out every sentence of the STS test sets (compared by lower-cased words); default: wherever the "
        "STS data is found, saying so when it is not (the shared NLI triplets hold 454 such sentences)",
    )
    f.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    f.add_argument("--quiet", action="store_true", help="no progress lines")
    f.set_defaults(func=cmd_heads_fit)
    reads_and_writes(f, ("--model", "--data"))


def _fit_options(f) -> None:
    """What the heads are (models.heads_fit.fit_heads) and how their ridge strength is chosen."""
    f.add_argument("--target", choices=["normalized", "raw"], default="normalized", help="last-layer vector as target")
    f.add_argument("--kind", choices=["affine", "mlp"], default="affine", help="affine (closed form) or a small MLP")
    f.add_argument(
        "--inputs",
        choices=["exit", "stack"],
        default="exit",
        help="what each head reads: its exit's pooled vector (exit; exportable as a Dense module), or the pooled "
        "vectors of the embedding output and every layer up to its exit, side by side (stack; better cells, served "
        "by matryoshka2d and ONNX)",
    )
    f.add_argument(
        "--layers",
        nargs="+",
        type=exit_list,
        action=Numbers,
        help="exits to fit: 1 2 3, 1,2,3 or 1-5 (default: every layer below the last)",
    )
    f.add_argument(
        "--select",
        choices=["auto", "sts-dev", "mse", "similarity"],
        default="auto",
        help="how the ridge strength is chosen: by STS-B dev Spearman (sts-dev; the only STS data a fit may see), "
        "by squared error to the last layer's vectors on the held-out tenth (mse), or by how well the heads keep "
        "its cosine similarities there (similarity); auto: sts-dev where the STS-B dev file is found, else mse",
    )
    f.add_argument(
        "--ridge",
        type=positive_float,
        help="a fixed ridge strength as a multiple of the number of sentences (no selection)",
    )
