"""STS: Spearman correlation x 100 between cosine similarity and gold scores, for every (layer, dim) cell.

This is SentEval's "all" setting, the one the 2DMSE and ESE papers report: one correlation over the whole file
(STS12-16 are not averaged per subset), and the test split of STS-B and SICK-R. Each dataset's distinct
sentences are embedded once, for all cells together.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from matryoshka2d.cells import Cell, unit_rows
from matryoshka2d.evaluate.grid import CellEmbedder, embed_distinct
from matryoshka2d.evaluate.results import GridResult, grid_result, model_record, provenance
from matryoshka2d.files import DataFormatError, read_tsv

STS_SETS = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")
VARIANTS = ("raw", "senteval_tok")
# SentEval's SICK-R is the original, untokenised text, so senteval_tok has no copy of it: read it from raw.
FALLBACK = {"senteval_tok": "raw"}


@dataclass
class PairSet:
    """Sentence pairs with a gold similarity score, read from one TSV file."""

    name: str
    path: Path
    sentences1: list[str]
    sentences2: list[str]
    gold: np.ndarray


def sts_file(data_dir: Path, variant: str, name: str) -> Path:
    """Where `<name>_test.tsv` of a variant lives (SICK-R for senteval_tok falls back to raw, as SentEval)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown STS variant '{variant}'; choose one of {', '.join(VARIANTS)}")
    path = Path(data_dir) / "sts" / variant / f"{name}_test.tsv"
    if not path.is_file() and variant in FALLBACK:
        other = Path(data_dir) / "sts" / FALLBACK[variant] / f"{name}_test.tsv"
        if other.is_file():
            return other
    if not path.is_file():
        raise DataFormatError(f"{path}: file not found (STS set '{name}', variant {variant}; see --datasets)")
    return path


def load_pairs(path: str | Path, name: str | None = None) -> PairSet:
    """Read sentence1, sentence2, score (other columns ignored); the gold scores must not all be equal."""
    table = read_tsv(path, required=("sentence1", "sentence2", "score"))
    gold = np.asarray(table.floats("score"), dtype=np.float64)
    if np.ptp(gold) == 0:
        raise DataFormatError(f"{table.path}: every score is {gold[0]}; a correlation needs varying gold scores")
    return PairSet(name or table.path.stem, table.path, table.strings("sentence1"), table.strings("sentence2"), gold)


def spearman_x100(gold: np.ndarray, predicted: np.ndarray) -> float:
    """Spearman's rho x 100 (ties get average ranks, as scipy and SentEval do)."""
    return float(spearmanr(gold, predicted).statistic * 100)


def pair_spearman(pairs: PairSet, vectors: np.ndarray, rows: dict[str, int]) -> float:
    """Spearman x 100 of the cosine of each pair against gold; `vectors` has a row per distinct sentence and
    `rows` says which (as embed_distinct returns them)."""
    unit = unit_rows(vectors)
    a = unit[np.fromiter((rows[s] for s in pairs.sentences1), dtype=np.int64, count=len(pairs.sentences1))]
    b = unit[np.fromiter((rows[s] for s in pairs.sentences2), dtype=np.int64, count=len(pairs.sentences2))]
    return spearman_x100(pairs.gold, np.einsum("ij,ij->i", a, b))


def score_cells(cells: dict[Cell, np.ndarray], rows: dict[str, int], pairs: PairSet) -> dict[Cell, float]:
    """Spearman x 100 of the cosine of each pair against gold, for each cell."""
    return {cell: pair_spearman(pairs, x, rows) for cell, x in cells.items()}


def evaluate_sts(
    embedder: CellEmbedder,
    data_dir: str | Path,
    variant: str = "raw",
    datasets: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> GridResult:
    """Evaluate every cell of `embedder` on the STS sets."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    names = list(datasets or STS_SETS)
    files = {name: sts_file(Path(data_dir), variant, name) for name in names}  # fail before any encoding
    sets = {name: load_pairs(path, name) for name, path in files.items()}
    started, start = provenance(), time.perf_counter()  # the load average is the one at the start
    encode_seconds = 0.0
    scores = []
    for name, pairs in sets.items():
        t0 = time.perf_counter()
        cells, rows = embed_distinct(embedder, pairs.sentences1 + pairs.sentences2)
        encode_seconds += time.perf_counter() - t0
        per_cell = score_cells(cells, rows, pairs)
        scores += [{"dataset": name, "layer": n, "dim": d, "spearman": v} for (n, d), v in per_cell.items()]
        best = max(per_cell)  # deepest layer, widest dim
        log(
            f"{name}: {len(pairs.gold)} pairs, {len(rows)} distinct sentences; layer {best[0]} dim {best[1]}: "
            f"{per_cell[best]:.2f}"
        )
    settings = {
        "data_dir": str(Path(data_dir).resolve()),
        "variant": variant,
        "similarity": "cosine",
        "correlation": "Spearman x 100 over the whole file (SentEval 'all')",
        "files": {name: str(path) for name, path in files.items()},
    }
    seconds = {"total": time.perf_counter() - start, "encode": encode_seconds}
    return grid_result(
        "sts", ["spearman"], names, scores, embedder.cells(), model_record(embedder), settings, seconds, started
    )


def sts_dev_score(encoder, path: str | Path, layer: int, dim: int) -> float:
    """Spearman x 100 of cosine vs gold on one STS file (sentence1, sentence2, score), at one cell."""
    pairs = load_pairs(path)
    rows = distinct_rows(pairs)
    return pair_spearman(pairs, encoder.encode(list(rows), layer=layer, dim=dim), rows)


_WORD = re.compile(r"\w+")


def sentence_key(text: str) -> str:
    """A sentence as the overlap check compares it: lower-cased words, punctuation and spacing dropped, so that
    the raw and the SentEval-tokenised copy of a sentence ("A man's dog." / "a man 's dog .") meet."""
    return " ".join(_WORD.findall(text.lower()))


class LeftOutSentences:
    """Passes on the texts whose sentence_key is not in `keys` (e.g. sts_test_sentence_keys), counting the others."""

    def __init__(self, keys: frozenset[str]):
        self.keys, self.count = keys, 0

    def filter(self, texts: Iterable[str]) -> Iterator[str]:
        for text in texts:
            if sentence_key(text) in self.keys:
                self.count += 1
            else:
                yield text


def sts_test_sentence_keys(data_dir: str | Path) -> frozenset[str]:
    """The keys (sentence_key) of every sentence of the seven STS test sets, raw and tokenised where present: what
    no fit or training may see. The shared NLI triplets hold 454 such sentences (SICK-R test shares sentences
    with SICK train and trial, which are in them). Cached per folder: reading the sets takes about two seconds."""
    return _sts_test_sentence_keys(str(Path(data_dir).resolve()))


@functools.lru_cache(maxsize=4)
def _sts_test_sentence_keys(data_dir: str) -> frozenset[str]:
    keys: set[str] = set()
    for name in STS_SETS:
        paths = {sts_file(Path(data_dir), "raw", name)}  # without it nothing can be checked: an error
        tokenised = Path(data_dir) / "sts" / "senteval_tok" / f"{name}_test.tsv"
        if tokenised.is_file():
            paths.add(tokenised)
        for path in paths:
            table = read_tsv(path, required=("sentence1", "sentence2"))
            keys.update(map(sentence_key, table.strings("sentence1") + table.strings("sentence2")))
    return frozenset(keys)


def distinct_rows(pairs: PairSet) -> dict[str, int]:
    """Each distinct sentence of the pairs and its row, in order of first appearance."""
    return {text: i for i, text in enumerate(dict.fromkeys(pairs.sentences1 + pairs.sentences2))}
