"""Reading files strictly: every problem is reported with the file and the line it is on.

The readers of the toolkit's inputs: TSV tables and JSON lines (evaluation and training files), JSON documents,
the texts of `encode` and `search --queries` (one text per line, from a file or standard input), and the sha256 of
a file's bytes (checkpoints and index files are checked with it). Folders are read through the confined reader
(matryoshka2d.confined), BEIR folders through matryoshka2d.beir; both read their files with these.

The shared data is tab-separated with one header line and no quoting (a `"` is an ordinary character), so
files are read with csv.QUOTE_NONE; JSON lines may be gzipped. A bad row should stop an evaluation with a
message such as `sts12_test.tsv line 17: score 'n/a' is not a number`, never with a silently shifted column or a
bare IndexError.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (checkpoints and index files are checked with it)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def where(path: Path, line: int | None = None) -> str:
    return f"{path} line {line}" if line is not None else str(path)


class DataFormatError(ValueError):
    """A data file is missing or malformed; the message names the file and, when known, the line."""

    at = staticmethod(where)  # how a message names a place; training data writes `file:line` instead


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


def first_bad_utf8_line(path: str | Path) -> str:
    """utf8_problem for a file on disk (gzipped if its name ends in .gz)."""
    path = Path(path)
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


def iter_tsv(path: str | Path, error: type[DataFormatError] = DataFormatError) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of a header + rows TSV (UTF-8, gzipped if the name ends in .gz, no quoting): the
    header first, as line 1, stripped; then every row that is not blank, each checked to have the header's
    number of columns. Every problem is an `error` naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = None
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:
                    raise error(_csv_problem(error.at(path, reader.line_num), exc)) from None
                if header is None:
                    if row == [] or row == [""]:
                        break
                    header = [h.strip() for h in row]
                    yield 1, header
                    continue
                if not row or row == [""]:
                    continue  # a trailing blank line is harmless
                if len(row) != len(header):
                    raise error(
                        f"{error.at(path, reader.line_num)}: {len(row)} tab-separated columns, the header has "
                        f"{len(header)} ({', '.join(header)})"
                    )
                yield reader.line_num, row
    except UnicodeDecodeError:
        raise error(first_bad_utf8_line(path)) from None
    if header is None:
        raise error(f"{path}: empty file (expected a header line)")


def _csv_problem(place: str, exc: csv.Error) -> str:
    if "field larger than field limit" in str(exc):
        return (
            f"{place}: a field is longer than {csv.field_size_limit():,} characters (the csv field limit); "
            "is a tab or newline missing? Split or shorten that text"
        )
    return f"{place}: unreadable TSV row ({exc})"


def read_tsv(path: str | Path, required: tuple[str, ...] = ()) -> Table:
    """Read a header + rows TSV into memory (see iter_tsv); the required columns must be in the header."""
    rows = iter_tsv(path)
    _, header = next(rows)
    table = Table(Path(path), header, list(rows))
    for name in required:
        table.column(name)
    if not table.rows:
        raise DataFormatError(f"{path}: no data rows after the header")
    return table


def read_jsonl(path: str | Path, error: type[DataFormatError] = DataFormatError) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) from a JSON-lines file, gzipped if the name ends in .gz; blank lines are
    skipped, anything else that is not a JSON object (or holds what read_json refuses) is an `error` naming the
    line."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise error(f"{error.at(path, line_no)}: not valid JSON ({exc.msg})") from None
                except (ValueError, RecursionError) as exc:  # a number of thousands of digits; nesting past a parser
                    raise error(f"{error.at(path, line_no)}: {_unreadable_json(line, exc)}") from None
                if not isinstance(obj, dict):
                    raise error(f"{error.at(path, line_no)}: expected a JSON object, got {type(obj).__name__}")
                if "\\u" in line and (problem := lone_surrogate(line, obj)):
                    raise error(f"{error.at(path, line_no)}: {problem}")
                yield line_no, obj
    except UnicodeDecodeError:
        raise error(first_bad_utf8_line(path)) from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise error(f"{path}: unreadable ({exc})") from exc


def read_json(path: str | Path, error: type[Exception] = DataFormatError):
    """A JSON document; a syntax error, bytes that are not UTF-8 (a binary file), nesting deeper than the parser
    follows, a number of more digits than Python reads or a lone surrogate (a string that is no text) is an `error`
    naming the file (and the line or the field)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where(path, exc.lineno)}: not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): not a JSON file"
        ) from None
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits; nesting past a parser
        raise error(f"{path}: {_unreadable_json(text, exc)}") from None
    if problem := lone_surrogate(text, document):
        raise error(f"{path}: {problem}")
    return document


# A JSON escape of half of a surrogate pair (\ud800-\udfff): valid JSON, which Python reads into a string that is no
# text (a tokenizer refuses it with its own words; writing it as UTF-8 fails wherever it is written).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate(raw: str, value) -> str | None:
    """Where in `value` (a JSON document, read from `raw`) a string or key holds half of a surrogate pair alone, and
    what it is, in a message ('scores[3].dataset: ...'); None when none does (a pair, one character, is fine)."""
    if not _SURROGATE_ESCAPE.search(raw):  # a lone surrogate can come only from an escape: most documents stop here
        return None
    try:
        place, char = _first(value, _surrogate_in)
    except RecursionError:
        return "nested deeper than a JSON reader follows; not a file matryoshka2d wrote"
    if not place:
        return None
    return (
        f"{place}: holds '\\u{ord(char):04x}', half of a surrogate pair standing alone (a JSON escape of no "
        "character), which is not text: remove it or write the whole pair"
    )


def _surrogate_in(value):
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return value[exc.start]
    return None


def _unreadable_json(text: str, exc: Exception) -> str:
    """Why valid JSON syntax could not be read into Python: nesting deeper than the parser follows, or an integer
    of more digits than Python converts (named with its field)."""
    if isinstance(exc, RecursionError):
        return "nested deeper than a JSON reader follows; not a file matryoshka2d wrote"
    place, digits = _first_long(json.loads(text, parse_int=_int_or_long))
    return (
        f"{place}: a whole number of {digits} digits, more than Python reads ({sys.get_int_max_str_digits()}): "
        "not a number matryoshka2d writes"
    )


class _LongNumber:
    """A JSON integer with more digits than Python converts, kept as its length so that its field can be named."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))


def _int_or_long(text: str):
    try:
        return int(text)
    except ValueError:
        return _LongNumber(text)


def _first_long(value) -> tuple[str, int]:
    """(where, digits) of the first _LongNumber in `value`, in the file's order ('scores[3].layer')."""
    return _first(value, lambda item: item.digits if isinstance(item, _LongNumber) else None)


def _first(value, found, place: str = "") -> tuple[str, object]:
    """(where, what) of the first item or key of a JSON document, in the file's order ('scores[3].layer'), for which
    `found` gives something other than None; ('', None) when there is none."""
    if (what := found(value)) is not None:
        return place or "the document", what
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{place}[{key}]" if isinstance(key, int) else f"{place}.{key}" if place else str(key)
        if isinstance(key, str) and (what := found(key)) is not None:
            return f"{inner} (the key)", what
        if (deeper := _first(item, found, inner))[0]:
            return deeper
    return "", None


# ---- the inputs of `encode` and `search --queries`: a file or standard input, one text a line ----------------


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


def input_state(binary, path: str) -> tuple[int, int, int, int] | None:
    """(device, inode, size, modification time in ns) of an input opened by open_input, to tell later whether it
    changed while it was read (`changed_since`); None for standard input, spooled to a file of our own."""
    if path == "-":
        return None
    st = os.fstat(binary.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def changed_since(binary, path: str, state: tuple[int, int, int, int] | None) -> str | None:
    """What happened to the input `path` since `state` (input_state when it was opened), or None if nothing did:
    its name given to another file, its size, its modification time (written to in place, even at the same size)."""
    if state is None:
        return None
    try:
        named = os.stat(path)
    except OSError:
        return "it was removed"
    if (named.st_dev, named.st_ino) != state[:2]:
        return "another file was put in its place"
    now = os.fstat(binary.fileno())
    if now.st_size != state[2]:
        return f"its size went from {state[2]:,} to {now.st_size:,} bytes"
    if now.st_mtime_ns != state[3]:
        return "it was written to (its modification time changed)"
    return None


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
