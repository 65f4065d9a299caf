"""Reading files strictly: every problem is reported with the file and the line it is on.

Text inputs (`encode`, `search --queries`) are one text per line; evaluation and training files are TSV or JSON
lines.

The shared data is tab-separated with one header line and no quoting (a `"` is an ordinary character), so
files are read with csv.QUOTE_NONE; BEIR corpora are JSON lines, optionally gzipped. A bad row should stop an
evaluation with a message such as `sts12_test.tsv line 17: score 'n/a' is not a number`, never with a
silently shifted column or a bare IndexError.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


class DataFormatError(ValueError):
    """An evaluation file is missing or malformed; the message names the file and, when known, the line."""


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (checkpoints and index files are checked with it)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def where(path: Path, line: int | None = None) -> str:
    return f"{path} line {line}" if line is not None else str(path)


def utf8_problem(lines: Iterable[bytes], name: object, at=lambda name, n: f"{name}:{n}:", what="file") -> str:
    """The first line that is not UTF-8, as a message naming the file, the line, the byte and its column.
    A decoder reads ahead in blocks, so this decodes line by line; `at` formats the place."""
    for line_no, raw in enumerate(lines, start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return (
                f"{at(name, line_no)} not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                f"save the {what} as UTF-8"
            )
    return f"{name}: not UTF-8 text; save the {what} as UTF-8"


def first_bad_utf8_line(path: Path) -> str:
    """utf8_problem for a file on disk (gzipped if its name ends in .gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return utf8_problem(f, path)


@dataclass
class Table:
    """A TSV file read into memory: its header, and each row paired with its 1-based line number."""

    path: Path
    header: list[str]
    rows: list[tuple[int, list[str]]]

    def column(self, name: str) -> int:
        """Index of a column; a missing one is an error that lists the columns the file does have."""
        if name not in self.header:
            raise DataFormatError(
                f"{where(self.path, 1)}: no column '{name}' in the header (columns: {', '.join(self.header)})"
            )
        return self.header.index(name)

    def has(self, *names: str) -> bool:
        return all(n in self.header for n in names)

    def strings(self, name: str) -> list[str]:
        i = self.column(name)
        return [row[i] for _, row in self.rows]

    def floats(self, name: str) -> list[float]:
        """A numeric column; 'nan', 'inf' and non-numbers are errors (a correlation cannot use them)."""
        i = self.column(name)
        out = []
        for line, row in self.rows:
            try:
                value = float(row[i])
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise DataFormatError(f"{where(self.path, line)}: {name} {row[i]!r} is not a finite number")
            out.append(value)
        return out


def read_tsv(path: str | Path, required: tuple[str, ...] = ()) -> Table:
    """Read a header + rows TSV (UTF-8, no quoting); check the column count of every row and the header."""
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"{path}: file not found")
    rows: list[tuple[int, list[str]]] = []
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader, None)
            if header is None or header == [] or header == [""]:
                raise DataFormatError(f"{path}: empty file (expected a header line)")
            header = [h.strip() for h in header]
            for row in reader:
                line = reader.line_num
                if not row or row == [""]:
                    continue  # a trailing blank line is harmless
                if len(row) != len(header):
                    raise DataFormatError(
                        f"{where(path, line)}: {len(row)} tab-separated columns, the header has {len(header)} "
                        f"({', '.join(header)})"
                    )
                rows.append((line, row))
    except UnicodeDecodeError:
        raise DataFormatError(first_bad_utf8_line(path)) from None
    except csv.Error as exc:
        raise DataFormatError(f"{path}: unreadable TSV ({exc})") from exc
    table = Table(path, header, rows)
    for name in required:
        table.column(name)
    if not rows:
        raise DataFormatError(f"{path}: no data rows after the header")
    return table


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) from a JSON-lines file, gzipped if the name ends in .gz."""
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"{path}: file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFormatError(f"{where(path, line_no)}: invalid JSON ({exc.msg})") from exc
                if not isinstance(obj, dict):
                    raise DataFormatError(f"{where(path, line_no)}: expected a JSON object, got {type(obj).__name__}")
                yield line_no, obj
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as exc:
        raise DataFormatError(f"{path}: unreadable ({exc})") from exc


# ---- one text per line: the inputs of `encode` and `search --queries` -------------------------------------


def open_input(path: str):
    """The input as a seekable binary file (standard input is spooled to a temporary file, read twice)."""
    if path == "-":
        spool = tempfile.TemporaryFile()  # noqa: SIM115 - returned open; the caller closes it
        shutil.copyfileobj(sys.stdin.buffer, spool)
        spool.seek(0)
        return spool, "standard input"
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"Input file {path} does not exist")
    return file.open("rb"), path


def iter_lines(binary, name: str):
    """One text per line, split on '\\n' only (a '\\r' before it is dropped); Unicode line and paragraph
    separators, form feeds and the like stay inside their text. A UTF-8 byte-order mark is skipped."""
    binary.seek(0)
    text = io.TextIOWrapper(binary, encoding="utf-8-sig", newline="\n")
    try:
        for line in text:
            line = line[:-1] if line.endswith("\n") else line
            yield line[:-1] if line.endswith("\r") else line
    except UnicodeDecodeError:
        binary.seek(0)
        raise ValueError(utf8_problem(binary, name, at=lambda name, n: f"{name}: line {n} is", what="input")) from None
    finally:
        text.detach()


def read_lines(path: str) -> list[str]:
    """Every text of a file (or '-', standard input) as `encode` reads them: see iter_lines."""
    binary, name = open_input(path)
    with binary:
        return list(iter_lines(binary, name))
