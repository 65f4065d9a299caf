"""`matryoshka2d heads fit`: exit heads fitted in closed form on unlabelled text, written with the model into a new
folder (matryoshka2d.models.heads)."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matryoshka2d.evaluate.sts import LeftOutSentences

FIT_BATCH = 512  # texts per encoder call while fitting (the encoder batches them further by --batch-size)
GAIN_CELLS = ((1, 64), (3, 128), (5, 384))  # cells whose STS-B dev gain the fit prints (clipped to the model)


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def _sts_test_filter(wanted: bool | None) -> LeftOutSentences | None:
    """The STS test sentences to leave out of a fit: always with --exclude-sts-test (an error if the sets cannot be
    read), never with --no-exclude-sts-test, and by default wherever the data folder holds them."""
    if wanted is False:
        return None
    from matryoshka2d.evaluate.sts import LeftOutSentences, sts_test_sentence_keys
    from matryoshka2d.files import DataFormatError
    from matryoshka2d.paths import data_dir

    try:
        return LeftOutSentences(sts_test_sentence_keys(data_dir()))
    except (FileNotFoundError, DataFormatError) as exc:
        if wanted:
            raise FileNotFoundError(f"--exclude-sts-test: cannot read the STS test sets ({exc})") from None
        _log(f"heads fit: the STS test sets were not found, so STS test sentences are not left out ({exc})")
        return None


def _fit_texts(data: list[str], excluded: LeftOutSentences | None, most: int | None) -> Iterator[str]:
    """The distinct sentences of `data` a fit uses, in order: those `excluded` passes on, at most `most` of them."""
    from matryoshka2d.training.distill import read_texts

    texts = read_texts(data)  # BEIR documents whole here (no tokenizer given: no passages)
    if excluded is not None:
        texts = excluded.filter(texts)
    return itertools.islice(texts, most) if most is not None else texts


def _sentence_bar(data: list[str], excluded: LeftOutSentences | None, most: int | None):
    """A bar over the sentences a fit will use (total, rate, time left), for where stderr is a terminal (elsewhere
    the fit logs counts); the total costs one read of the data."""
    from tqdm.auto import tqdm

    from matryoshka2d.evaluate.sts import LeftOutSentences

    counting = LeftOutSentences(excluded.keys) if excluded is not None else None  # `excluded` counts the fit's own
    total = sum(1 for _ in _fit_texts(data, counting, most))
    return tqdm(total=total, unit="sentence", desc="heads fit", dynamic_ncols=True)


def _gain_table(encoder, cells) -> list[str]:
    """STS-B dev Spearman x 100 at a few cells, without and with the heads (the only STS data a fit may see)."""
    from matryoshka2d.evaluate.sts import load_pairs, spearman_x100
    from matryoshka2d.paths import sts_dev_file
    from matryoshka2d.views import unit_rows

    try:
        pairs = load_pairs(sts_dev_file())
    except (FileNotFoundError, ValueError) as exc:
        return [f"(no STS-B dev gain table: {exc})"]
    n = len(pairs.sentences1)
    texts = pairs.sentences1 + pairs.sentences2
    layers = sorted({c[0] for c in cells})
    lines = ["STS-B dev, Spearman x 100 of cosine:", "| cell | no heads | heads | gain |", "|---|---:|---:|---:|"]
    pooled = encoder.pooled_states(texts, encoder.pooled_inputs(layers), pooled=True)  # both sides made from it
    sides = {use: encoder.cells_from_pooled(pooled, layers, heads=use) for use in (False, True)}
    for layer, dim in cells:
        scores = []
        for use in (False, True):
            cell = unit_rows(sides[use][layer][:, :dim])
            scores.append(spearman_x100(pairs.gold, (cell[:n] * cell[n:]).sum(1)))
        lines.append(f"| ({layer},{dim}) | {scores[0]:.2f} | {scores[1]:.2f} | {scores[1] - scores[0]:+.2f} |")
    return lines


def ridge_selection(select: str, dev_file: Path | None, missing: str | None = None):
    """(criterion, STS-B dev pairs or None) for fit_heads: "auto" takes STS-B dev where `dev_file` exists, else
    held-out squared error (and says so); "sts-dev" needs the file. `missing`: why there is no file to name."""
    if select not in ("auto", "sts-dev"):
        return select, None
    if dev_file is not None and dev_file.is_file():
        from matryoshka2d.evaluate.sts import load_pairs

        return "sts-dev", load_pairs(dev_file)
    missing = missing or f"no STS-B dev file at {dev_file}"
    if select == "sts-dev":
        raise FileNotFoundError(f"--select sts-dev: {missing} (set MATRYOSHKA2D_DATA to the data folder)")
    _log(f"heads fit: {missing}; the ridge strength is chosen by held-out squared error (--select mse)")
    return "mse", None


def cmd_heads_fit(args) -> int:

    from matryoshka2d.cli.args import check_new_output, folder_metadata, load_encoder
    from matryoshka2d.evaluate.grid import parse_ints
    from matryoshka2d.models.heads import fit_heads
    from matryoshka2d.training.checkpoints import save_model_atomically

    out = Path(args.output)
    check_new_output(out, args.overwrite)
    if args.max_sentences is not None and args.max_sentences < 1:
        raise ValueError(f"--max-sentences must be at least 1, got {args.max_sentences}")
    args.no_heads = True  # fit on the backbone alone: heads already in the folder are replaced
    encoder = load_encoder(args, log=lambda _m: None)
    if args.ridge is not None and args.select != "auto":
        raise ValueError(
            f"--select {args.select} chooses the ridge strength; --ridge {args.ridge:g} fixes it: give one"
        )
    select, dev = args.select, None
    if args.ridge is None:
        from matryoshka2d.paths import sts_dev_file

        try:
            dev_file, missing = sts_dev_file(), None
        except FileNotFoundError as exc:  # no data folder at all
            dev_file, missing = None, str(exc)
        select, dev = ridge_selection(select, dev_file, missing)
    excluded = _sts_test_filter(args.exclude_sts_test)
    texts = _fit_texts(args.data, excluded, args.max_sentences)

    def batches():
        given = False
        while chunk := list(itertools.islice(texts, FIT_BATCH)):
            given = True
            yield chunk
        if not given and excluded is not None and excluded.count:
            raise ValueError(
                f"--data {' '.join(args.data)}: no sentences to fit on: all {excluded.count} of its sentences are "
                "sentences of the STS test sets, left out by default; pass --no-exclude-sts-test to keep them"
            )

    bar = _sentence_bar(args.data, excluded, args.max_sentences) if not args.quiet and sys.stderr.isatty() else None
    try:
        heads, report = fit_heads(
            encoder,
            batches(),
            target=args.target,
            kind=args.kind,
            select="mse" if select == "auto" else select,  # auto with --ridge: nothing is selected
            ridge=args.ridge,
            dev=dev,
            layers=parse_ints(args.layers, "layers"),
            log=_log if not args.quiet else None,
            inputs=args.inputs,
            progress=bar.update if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    heads.record["data"] = [str(Path(d).resolve()) for d in args.data]
    heads.record["sts_test_sentences_left_out"] = excluded.count if excluded is not None else None
    if excluded is not None:
        _log(f"heads fit: {excluded.count} sentences of the STS test sets were in --data and were left out")
    encoder.set_exit_heads(heads)
    metadata = folder_metadata(encoder)
    metadata["heads_fit"] = {"from_model": encoder.location or encoder.name, "seconds": report.seconds}
    saved = save_model_atomically(lambda folder: encoder.save(folder, metadata=metadata), out)
    strengths = ", ".join(f"{n}: {v:g}" for n, v in report.strengths.items())
    print(
        f"fitted {heads.describe()} on {report.sentences} sentences ({report.held_out} held out; ridge strength "
        f"{heads.record['ridge_chosen_by']}; lambda/n per layer: {strengths}) in {report.seconds:.1f} s -> {saved}"
    )
    top, width = encoder.num_layers, encoder.hidden_size
    cells = sorted({(min(n, top - 1), min(d, width)) for n, d in GAIN_CELLS} | {(top, width)})
    print("\n".join(_gain_table(encoder, cells)))
    return 0


def register(sub, model_args) -> None:
    from matryoshka2d.cli.args import exit_ranges, positive_float, positive_int, reads_and_writes

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
        type=exit_ranges,
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
