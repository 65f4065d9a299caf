"""The one reader of a BEIR folder: `corpus.jsonl` (or `corpus.jsonl.gz`) with `_id, title, text`, `queries.jsonl`
with `_id, text`, and `qrels/<split>.tsv` with `query-id, corpus-id, score`.

As in BEIR and sentence-transformers, a document is `title + " " + text` (stripped). `load_beir` reads a split and
cross-checks it (only queries with at least one relevant document are kept); `read_beir_file` streams the records
of a corpus or queries file (an index build, distillation's texts); `find_corpus` tells a BEIR corpus from other
data. Every problem names the file and the line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from matryoshka2d.files import DataFormatError, read_jsonl, read_tsv, where

CORPUS_FILES = ("corpus.jsonl", "corpus.jsonl.gz")  # the first one a folder has is its corpus


def read_beir_file(path: str | Path, titles: bool) -> Iterator[tuple[int, str, str]]:
    """(line, id, text) of each record of a BEIR corpus or queries file (JSON lines with `_id` and `text`).
    With `titles` (a corpus), a document is `title + " " + text`, stripped, as BEIR and sentence-transformers
    embed it. A record without an id or a text, or an id used twice, is an error naming the line."""
    path = Path(path)
    seen: dict[str, int] = {}
    for line, obj in read_jsonl(path):
        if "_id" not in obj:
            raise DataFormatError(f"{where(path, line)}: no '_id' field")
        if not isinstance(obj.get("text"), str):
            raise DataFormatError(f"{where(path, line)}: no 'text' string field")
        key = str(obj["_id"])
        if key in seen:
            raise DataFormatError(f"{where(path, line)}: _id {key!r} already used on line {seen[key]}")
        seen[key] = line
        text = obj["text"]
        if titles:
            title = obj.get("title") or ""
            text = (f"{title} {text}" if title else text).strip()
        yield line, key, text


@dataclass
class BeirSet:
    """A corpus, the evaluated queries and their graded relevance judgements (qrels)."""

    name: str
    directory: Path
    split: str
    doc_ids: list[str]
    doc_texts: list[str]
    query_ids: list[str]
    query_texts: list[str]
    qrels: list[dict[int, int]]  # per evaluated query: document index -> relevance (> 0 only)
    unknown_docs: int  # qrels rows naming a document the corpus does not have (never retrievable)


def find_corpus(path: str | Path) -> Path | None:
    """The corpus file of a BEIR folder (corpus.jsonl, else corpus.jsonl.gz), or `path` itself when it is such a
    file; else None (a folder or file that is not a BEIR corpus)."""
    path = Path(path)
    if path.is_dir():
        return next((path / name for name in CORPUS_FILES if (path / name).is_file()), None)
    return path if path.name in CORPUS_FILES else None


def corpus_file(directory: Path) -> Path:
    """The corpus file of a BEIR folder; a folder without one is an error naming it."""
    found = find_corpus(directory) if Path(directory).is_dir() else None
    if found is None:
        raise DataFormatError(f"{directory}: no corpus.jsonl or corpus.jsonl.gz")
    return found


def _read_records(path: Path, titles: bool) -> tuple[list[str], list[str]]:
    records = list(read_beir_file(path, titles))
    if not records:
        raise DataFormatError(f"{path}: empty file")
    return [key for _, key, _ in records], [text for _, _, text in records]


def qrels_split(directory: Path, split: str | None = None) -> str:
    """`split`, else 'test' when the BEIR folder has qrels/test.tsv, else its only qrels file."""
    if split:
        return split
    available = sorted(p.stem for p in (directory / "qrels").glob("*.tsv"))
    if "test" in available:
        return "test"
    if len(available) == 1:
        return available[0]
    raise ValueError(
        f"{directory / 'qrels'}: {'several qrels files' if available else 'no qrels file'} "
        f"({', '.join(available) or 'none'}); a BEIR folder needs qrels/test.tsv or a single qrels/<split>.tsv, "
        "else pass --split"
    )


def load_beir(directory: str | Path, split: str = "test") -> BeirSet:
    """Read and cross-check a BEIR folder; unknown query ids in the qrels are an error naming the line."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataFormatError(f"{directory}: dataset directory not found")
    doc_ids, doc_texts = _read_records(corpus_file(directory), titles=True)
    all_qids, all_qtexts = _read_records(directory / "queries.jsonl", titles=False)
    qrels_path = directory / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        have = sorted(p.stem for p in (directory / "qrels").glob("*.tsv")) if (directory / "qrels").is_dir() else []
        raise DataFormatError(f"{qrels_path}: file not found (splits here: {', '.join(have) or 'none'}; see --split)")
    table = read_tsv(qrels_path, required=("query-id", "corpus-id", "score"))
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    query_index = {q: i for i, q in enumerate(all_qids)}
    judged: dict[int, dict[int, int]] = {}
    unknown_docs = 0
    qi, di, si = table.column("query-id"), table.column("corpus-id"), table.column("score")
    for line, row in table.rows:
        try:
            score = int(row[si])
        except ValueError:
            raise DataFormatError(f"{qrels_path} line {line}: score {row[si]!r} is not an integer") from None
        if row[qi] not in query_index:
            raise DataFormatError(f"{qrels_path} line {line}: query-id {row[qi]!r} is not in queries.jsonl")
        if row[di] not in doc_index:
            unknown_docs += 1
            continue
        if score > 0:
            judged.setdefault(query_index[row[qi]], {})[doc_index[row[di]]] = score
    if not judged:
        raise DataFormatError(f"{qrels_path}: no query has a relevant document (score > 0) in the corpus")
    order = sorted(judged)
    return BeirSet(
        name=directory.name,
        directory=directory,
        split=split,
        doc_ids=doc_ids,
        doc_texts=doc_texts,
        query_ids=[all_qids[i] for i in order],
        query_texts=[all_qtexts[i] for i in order],
        qrels=[judged[i] for i in order],
        unknown_docs=unknown_docs,
    )


@contextmanager
def linked_beir_folder(corpus: str | Path, queries: str | Path, qrels: str | Path, split: str | None = None):
    """The three files of one data set, wherever they are, seen as a BEIR folder: yields (folder, split), a
    temporary folder of links named after the corpus's folder (outside every output, named as the one writer names
    its temporary folders), removed on exit. The split is `split`, else the qrels file's name."""
    import tempfile

    from matryoshka2d.outputs import TEMPORARY_MARK

    corpus, qrels = Path(corpus).resolve(), Path(qrels).resolve()
    split = split or qrels.stem
    with tempfile.TemporaryDirectory(prefix=f"matryoshka2d-beir{TEMPORARY_MARK}") as tmp:
        folder = Path(tmp) / (corpus.parent.name or "dataset")
        (folder / "qrels").mkdir(parents=True)
        (folder / ("corpus.jsonl.gz" if corpus.name.endswith(".gz") else "corpus.jsonl")).symlink_to(corpus)
        (folder / "queries.jsonl").symlink_to(Path(queries).resolve())
        (folder / "qrels" / f"{split}.tsv").symlink_to(qrels)
        yield folder, split
