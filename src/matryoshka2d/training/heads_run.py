"""`heads fit` as one call: exit heads fitted in closed form (models.heads_fit.fit_heads) on the distinct sentences
of text files, the STS test sentences left out wherever the data folder holds them, set on the model and written
with it into a new folder; then the STS-B dev gain at a few cells. `matryoshka2d heads fit` parses its options into
a `HeadsFit` and calls `fit_heads_into`; the demo picks the ridge strength with `ridge_selection`."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matryoshka2d.evaluate.sts import LeftOutSentences

FIT_BATCH = 512  # texts per encoder call while fitting (the encoder batches them further by --batch-size)
GAIN_CELLS = ((1, 64), (3, 128), (5, 384))  # cells whose STS-B dev gain the fit prints (clipped to the model)


@dataclass
class HeadsFit:
    """What to fit on (`data`: training files, plain text files or a BEIR corpus) and how (models.heads_fit:
    target, kind, inputs, the exits `layers`, the ridge strength chosen by `select` or fixed by `ridge`).
    `exclude_sts_test`: True leaves the STS test sentences out (an error if the sets cannot be read), False keeps
    them, None leaves them out wherever the data folder holds them."""

    data: list[str]
    target: str = "normalized"
    kind: str = "affine"
    inputs: str = "exit"
    layers: list[int] | None = None
    select: str = "auto"
    ridge: float | None = None
    max_sentences: int | None = None
    exclude_sts_test: bool | None = None
    quiet: bool = False

    def check(self) -> None:
        """The options that exclude each other, before the model is used."""
        if self.max_sentences is not None and self.max_sentences < 1:
            raise ValueError(f"--max-sentences must be at least 1, got {self.max_sentences}")
        if self.ridge is not None and self.select != "auto":
            raise ValueError(
                f"--select {self.select} chooses the ridge strength; --ridge {self.ridge:g} fixes it: give one"
            )


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def fit_heads_into(
    output: str | Path, encoder, fit: HeadsFit, metadata: dict, log: Callable[[str], None] = _log
) -> tuple[object, object, Path]:
    """Fit `encoder`'s exit heads as `fit` says, set them on it and save it with `metadata` (its folder's record)
    into `output` (atomically): (the heads, the fit's report, the folder written)."""
    from matryoshka2d.models.heads_fit import fit_heads
    from matryoshka2d.training.checkpoints import save_model_atomically

    fit.check()
    check_not_a_query_encoder(encoder)
    select, dev = fit.select, None
    if fit.ridge is None:
        select, dev = _dev_selection(select, log)
    excluded = _sts_test_filter(fit.exclude_sts_test, log)
    show_bar = not fit.quiet and sys.stderr.isatty()  # elsewhere the fit logs counts
    bar = _sentence_bar(fit.data, excluded, fit.max_sentences) if show_bar else None
    try:
        heads, report = fit_heads(
            encoder,
            _batches(fit, excluded),
            target=fit.target,
            kind=fit.kind,
            select="mse" if select == "auto" else select,  # auto with --ridge: nothing is selected
            ridge=fit.ridge,
            dev=dev,
            layers=fit.layers,
            log=log if not fit.quiet else None,
            inputs=fit.inputs,
            progress=bar.update if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    heads.record["data"] = [str(Path(d).resolve()) for d in fit.data]
    heads.record["sts_test_sentences_left_out"] = excluded.count if excluded is not None else None
    if excluded is not None:
        log(f"heads fit: {excluded.count} sentences of the STS test sets were in --data and were left out")
    encoder.set_exit_heads(heads)
    metadata = {**metadata, "heads_fit": {"from_model": encoder.location or encoder.name, "seconds": report.seconds}}
    saved = save_model_atomically(lambda folder: encoder.save(folder, metadata=metadata), Path(output))
    return heads, report, saved


def check_not_a_query_encoder(encoder) -> None:
    """A query encoder (`distill --mode query|static`) is refused before the fit: its record vouches for the checksum
    of its own weights, which fitted heads change (the folder written would be a query encoder that no index of its
    teacher takes), and what it is for, the queries of its teacher's index, is done by its own last layer (or its
    static cell), which exit heads do not touch. Heads belong on the teacher, whose exits serve both sides."""
    from matryoshka2d.models.query_record import query_encoder_record

    record = query_encoder_record(encoder)
    if record is None:
        return
    teacher = record.get("teacher") or "its teacher"
    raise ValueError(
        f"--model {encoder.location or encoder.name}: a query encoder (`distill --mode {record.get('mode')}` of "
        f"{teacher}), not a model to fit exit heads on: its matryoshka2d.json vouches for the checksum of its own "
        "weights, which heads change (no index of its teacher would take the folder written), and its queries come "
        "from its "
        f"{'static cell (layer 0)' if record.get('mode') == 'static' else 'last layer'}, which heads do not touch. "
        f"Fit heads on the teacher ({teacher}) instead; nothing was fitted or written"
    )


def _batches(fit: HeadsFit, excluded: LeftOutSentences | None) -> Iterator[list[str]]:
    texts = _fit_texts(fit.data, excluded, fit.max_sentences)
    given = False
    while chunk := list(itertools.islice(texts, FIT_BATCH)):
        given = True
        yield chunk
    if not given and excluded is not None and excluded.count:
        raise ValueError(
            f"--data {' '.join(fit.data)}: no sentences to fit on: all {excluded.count} of its sentences are "
            "sentences of the STS test sets, left out by default; pass --no-exclude-sts-test to keep them"
        )


def _dev_selection(select: str, log: Callable[[str], None]):
    from matryoshka2d.paths import sts_dev_file

    try:
        dev_file, missing = sts_dev_file(), None
    except FileNotFoundError as exc:  # no data folder at all
        dev_file, missing = None, str(exc)
    return ridge_selection(select, dev_file, missing, log)


def ridge_selection(select: str, dev_file: Path | None, missing: str | None = None, log: Callable[[str], None] = _log):
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
    log(f"heads fit: {missing}; the ridge strength is chosen by held-out squared error (--select mse)")
    return "mse", None


def _sts_test_filter(wanted: bool | None, log: Callable[[str], None]) -> LeftOutSentences | None:
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
        log(f"heads fit: the STS test sets were not found, so STS test sentences are not left out ({exc})")
        return None


def _fit_texts(data: list[str], excluded: LeftOutSentences | None, most: int | None) -> Iterator[str]:
    """The distinct sentences of `data` a fit uses, in order: those `excluded` passes on, at most `most` of them."""
    from matryoshka2d.training.texts import read_texts

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


def gain_table(encoder) -> list[str]:
    """STS-B dev Spearman x 100 at a few cells (GAIN_CELLS clipped to the model, and the full cell), without and
    with the heads (the only STS data a fit may see)."""
    from matryoshka2d.cells import unit_rows
    from matryoshka2d.evaluate.sts import load_pairs, spearman_x100
    from matryoshka2d.paths import sts_dev_file

    top, width = encoder.num_layers, encoder.hidden_size
    cells = sorted({(min(n, top - 1), min(d, width)) for n, d in GAIN_CELLS} | {(top, width)})
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
