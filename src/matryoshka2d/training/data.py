"""Read training data: triplets, NLI-labelled pairs, or scored pairs, from TSV/JSONL files or the HF hub.

The kind is read from the header (TSV) or the keys (JSONL, HF datasets):
- triplets: anchor, positive, negative
- pairs: anchor, positive   (a text and one relevant text, e.g. a query and a document it should find; the
  other positives of the batch are the negatives, so only in-batch-negative losses train on them: infonce)
- NLI pairs: premise, hypothesis, label   (or sentence1, sentence2, label with entailment/neutral/contradiction)
- scored pairs: sentence1, sentence2, score   (STS-B / SICK train)
- sentences: plain text, one sentence per line (.txt), for unsupervised objectives (SimCSE, SMAE). Such data
  has two identical columns, so that a batch encodes every sentence twice (two dropout masks, as SimCSE does).
  `read_training_data(..., sentences=True)` reads any file as sentences (every distinct text of a TSV).
Several sources can be given; they must be of one kind. A malformed row stops the run with file and line.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from matryoshka2d.files import DataFormatError, first_bad_utf8_line, iter_tsv, read_jsonl
from matryoshka2d.losses.batch import NLI_LABELS

KINDS = {
    "triplets": (("anchor", "positive", "negative"), None),
    "pairs": (("anchor", "positive"), None),
    "nli": (("premise", "hypothesis"), "label"),
    "scored": (("sentence1", "sentence2"), "score"),
}
# Columns that hold text, for reading any TSV as plain sentences (classification sets have `sentence`).
TEXT_COLUMNS = ("anchor", "positive", "negative", "premise", "hypothesis", "sentence1", "sentence2", "sentence", "text")


def _at(path, line: int | None = None) -> str:
    return f"{path}:{line}" if line is not None else str(path)


class DataError(DataFormatError):
    """A training file is missing, empty or malformed; the message names the file and line (as `file:line`)."""

    at = staticmethod(_at)


# Scores of scored pairs: STS-B and SICK-R use 0..5 (a 0..1 scale fits too). A score outside is a typo or a
# file on another scale, which the ranking losses would silently learn from.
SCORE_RANGE = (0.0, 5.0)


@dataclass
class TrainingData:
    kind: str
    columns: list[list[str]]
    labels: np.ndarray | None = None
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.columns[0])

    def rows(self, idx) -> tuple[list[list[str]], np.ndarray | None]:
        cols = [[col[i] for i in idx] for col in self.columns]
        return cols, (self.labels[idx] if self.labels is not None else None)


def _kind_of(header: list[str], where: str) -> tuple[str, list[str], str | None]:
    names = [h.strip().lower() for h in header]
    if all(c in names for c in KINDS["triplets"][0]):
        return "triplets", list(KINDS["triplets"][0]), None
    if all(c in names for c in KINDS["pairs"][0]):
        return "pairs", list(KINDS["pairs"][0]), None
    if "label" in names and {"premise", "hypothesis"} <= set(names):
        return "nli", ["premise", "hypothesis"], "label"
    if "label" in names and {"sentence1", "sentence2"} <= set(names):
        return "nli", ["sentence1", "sentence2"], "label"
    if "score" in names and {"sentence1", "sentence2"} <= set(names):
        return "scored", ["sentence1", "sentence2"], "score"
    raise DataError(
        f"{where}: cannot tell the kind of data from the columns {header}; expected anchor/positive/negative, "
        "anchor/positive, premise/hypothesis/label, or sentence1/sentence2/score"
    )


def _label(kind: str, value, where: str):
    if kind == "nli":
        key = str(value).strip().lower()
        if key not in NLI_LABELS:
            raise DataError(f"{where}: label '{value}' is not one of {', '.join(NLI_LABELS)}")
        return NLI_LABELS[key]
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: score '{value}' is not a number") from None
    if not math.isfinite(score):
        raise DataError(f"{where}: score '{value}' is not finite")
    low, high = SCORE_RANGE
    if not low <= score <= high:
        raise DataError(
            f"{where}: score {value} is outside {low:g}..{high:g} (the STS-B / SICK-R scale); rescale the file's "
            "scores to 0..5"
        )
    return score


def _read_tsv(path: Path) -> tuple[str, list[list[str]], list]:
    rows = iter_tsv(path, DataError)
    _, header = next(rows)
    kind, text_cols, label_col = _kind_of(header, f"{path}:1")
    names = [h.lower() for h in header]
    positions = [names.index(c) for c in text_cols]
    label_pos = names.index(label_col) if label_col else None
    columns: list[list[str]] = [[] for _ in text_cols]
    labels = []
    for line_no, row in rows:
        where = f"{path}:{line_no}"
        for col, pos in zip(columns, positions, strict=True):
            if not row[pos].strip():
                raise DataError(f"{where}: empty '{header[pos]}'")
            col.append(row[pos])
        if label_pos is not None:
            labels.append(_label(kind, row[label_pos], where))
    return kind, columns, labels


def _read_records(records, where_prefix: str) -> tuple[str, list[list[str]], list]:
    """Training data from (line number, record) pairs: JSON lines of a file or the rows of a hub dataset."""
    columns: list[list[str]] = []
    labels: list = []
    kind = text_cols = label_col = None
    for n, record in records:
        where = f"{where_prefix}:{n}"
        if kind is None:
            kind, text_cols, label_col = _kind_of(list(record), where)
            columns = [[] for _ in text_cols]
        for col, name in zip(columns, text_cols, strict=True):
            value = record.get(name)
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: '{name}' is missing or not a non-empty string")
            col.append(value)
        if label_col:
            if label_col not in record:
                raise DataError(f"{where}: '{label_col}' is missing")
            labels.append(_label(kind, record[label_col], where))
    if kind is None:
        raise DataError(f"{where_prefix}: no rows")
    return kind, columns, labels


def _read_hub(name: str):
    """'owner/dataset[:config][:split]' through the datasets library (needs network and `pip install datasets`)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{name}: not a local file; reading Hugging Face datasets needs `pip install datasets`"
        ) from None
    parts = name.split(":")
    repo, config, split = parts[0], (parts[1] if len(parts) > 2 else None), parts[-1] if len(parts) > 1 else "train"
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as exc:
        raise DataError(f"{name}: could not load from the Hugging Face Hub ({exc})") from exc
    label_names = getattr(ds.features.get("label"), "names", None)

    def records():
        for row in ds:
            if label_names and isinstance(row.get("label"), int):
                if row["label"] < 0:
                    continue  # SNLI marks pairs without a gold label with -1
                row = {**row, "label": label_names[row["label"]]}
            yield row

    return _read_records(enumerate(records(), start=1), name)


def _is_plain_text(path: Path) -> bool:
    return path.name.lower().endswith((".txt", ".txt.gz"))


def read_source(source: str) -> tuple[str, list[list[str]], list]:
    path = Path(source).expanduser()
    if path.is_file():
        return _read_file(path)
    if path.exists():
        raise DataError(f"{source}: is a directory; give the training files themselves")
    if "/" in source and not source.startswith((".", "/", "~")) and not path.parent.exists():
        return _read_hub(source)
    raise DataError(f"{source}: no such file")


def _read_file(path: Path) -> tuple[str, list[list[str]], list]:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json")):
        return _read_records(read_jsonl(path, DataError), str(path))
    if _is_plain_text(path):
        sentences = read_sentences(path)
        return "sentences", [sentences, list(sentences)], []
    return _read_tsv(path)


def read_training_data(sources: list[str], sentences: bool = False) -> TrainingData:
    """Read and concatenate several sources of the same kind (with `sentences`, every source as sentences)."""
    if not sources:
        raise DataError("no training data given")
    data: TrainingData | None = None
    for source in sources:
        if sentences:
            texts = read_sentences(Path(str(source)).expanduser())
            kind, columns, labels = "sentences", [texts, list(texts)], []
        else:
            kind, columns, labels = read_source(str(source))
        if not columns or not columns[0]:
            raise DataError(f"{source}: no rows after the header")
        if data is None:
            data = TrainingData(kind, columns, [] if labels else None, [])
        elif kind != data.kind:
            raise DataError(f"{source}: holds {kind} data but {data.sources[0]} holds {data.kind}; use one kind")
        else:
            for mine, theirs in zip(data.columns, columns, strict=True):
                mine.extend(theirs)
        if labels:
            data.labels.extend(labels)
        data.sources.append(str(source))
    if data.labels is not None:
        data.labels = np.asarray(data.labels, dtype=np.int64 if data.kind == "nli" else np.float32)
    return data


def read_sentences(path: str | Path) -> list[str]:
    """Plain sentences for unsupervised objectives and reducers: one per line of a text file (blank lines
    skipped), or, for a TSV with a header or a JSONL file, every distinct text of its text fields
    (anchor/positive/negative, premise/hypothesis, sentence1/sentence2, sentence or text) in file order, row by
    row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        return _read_sentences(path)
    except UnicodeDecodeError:
        raise DataError(first_bad_utf8_line(path)) from None


def _read_sentences(path: Path) -> list[str]:
    if path.name.lower().endswith((".tsv", ".tsv.gz")):
        out = list(dict.fromkeys(_tsv_texts(path)))
    elif path.name.lower().endswith((".jsonl", ".jsonl.gz", ".json")):
        out = list(dict.fromkeys(_jsonl_texts(path)))
    else:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8-sig") as f:
            out = [line.strip() for line in f if line.strip()]
    if not out:
        raise DataError(f"{path}: no sentences")
    return out


def _jsonl_texts(path: Path):
    for _, record in read_jsonl(path, DataError):
        for name in TEXT_COLUMNS:
            value = record.get(name)
            if isinstance(value, str) and value.strip():
                yield value.strip()


def _tsv_texts(path: Path):
    rows = iter_tsv(path, DataError)
    _, header = next(rows)
    positions = [i for i, name in enumerate(header) if name.lower() in TEXT_COLUMNS]
    if not positions:
        raise DataError(f"{path}:1: no text column in {header}; expected one of {', '.join(TEXT_COLUMNS)}")
    for _, row in rows:
        for pos in positions:
            text = row[pos].strip()
            if text:
                yield text


def without_rows_holding(data: TrainingData, keys: frozenset[str], key) -> tuple[TrainingData, int]:
    """`data` without every row one of whose texts has its `key(text)` in `keys` (e.g. STS test sentences, which
    no training may see), and how many rows went."""
    keep = [i for i, row in enumerate(zip(*data.columns, strict=True)) if not any(key(t) in keys for t in row)]
    if len(keep) == len(data):
        return data, 0
    if not keep:
        raise DataError(f"{', '.join(data.sources)}: every row holds an excluded sentence; nothing is left to train on")
    columns = [[column[i] for i in keep] for column in data.columns]
    labels = data.labels[keep] if data.labels is not None else None
    return TrainingData(data.kind, columns, labels, list(data.sources)), len(data) - len(keep)


def without_repeated_texts(data: TrainingData, rows: np.ndarray, tokenizer, max_length: int | None) -> np.ndarray:
    """The batch's rows without those that repeat a text already in the batch: angle-emb's `filter_duplicate`
    (0.6.1 `AngleDataCollator.__call__`, angle_emb/angle.py L124-244; on by default in `AnglE.fit` and in
    v0.3.8-0.5.x, off in the 0.6 command line).

    As there: a text's key is its token ids with special tokens, truncated to the maximum length (texts that
    differ only in case meet under an uncased tokenizer); a row's texts are checked in column order against
    every text seen so far in the batch, its own included, and the first repeat drops the whole row, while
    the texts before the repeat stay seen. The batch gets smaller, as it does there.
    """
    if data.kind == "sentences":
        raise ValueError(
            "filter_duplicates: plain sentences are two copies of each sentence by design (SimCSE), so every row "
            "would be dropped; turn filter_duplicates off for this data"
        )
    columns, _ = data.rows(rows)
    texts = [text for row in zip(*columns, strict=True) for text in row]
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    width, seen, keep = len(columns), set(), []
    for i, row in enumerate(rows):
        for key in map(tuple, ids[i * width : (i + 1) * width]):
            if key in seen:
                break
            seen.add(key)
        else:
            keep.append(row)
    if not keep:
        raise ValueError("filter_duplicates dropped every row of a batch: each repeats a text of its own row")
    return np.asarray(keep, dtype=rows.dtype)
