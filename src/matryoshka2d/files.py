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
import os
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


class OutsideFolderError(ValueError):
    """A record, manifest or modules.json names a path that leaves the folder it describes."""


def confinement(folder: str | Path) -> tuple[Path, Path | None]:
    """(the folder, resolved; the blobs folder its links may reach, or None). A Hugging Face cache snapshot,
    `.../models--ORG--NAME/snapshots/REV/`, holds links into `../../blobs`: it is a folder users have, so a link
    from it into its own repository's `blobs/` stays inside, on purpose; nothing else outside the folder does."""
    try:
        real = Path(folder).resolve()
    except (RuntimeError, OSError) as exc:  # the folder itself a loop of links
        raise OutsideFolderError(f"{folder}: cannot be resolved ({exc}); not a folder matryoshka2d can read") from None
    blobs = real.parent.parent / "blobs"
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real, (blobs.resolve() if blobs.is_dir() else None)
    return real, None


def stays_inside(path: Path, folder: str | Path) -> bool:
    """Whether `path` (a name under `folder`), links followed, lies in the folder (or its snapshot's blobs/)."""
    real, blobs = confinement(folder)
    try:
        target = Path(path).resolve()
    except (RuntimeError, OSError):  # a loop of links leads nowhere inside the folder
        return False
    return target.is_relative_to(real) or (blobs is not None and target.is_relative_to(blobs))


def _loops(path: Path) -> bool:
    try:
        path.resolve(strict=False)
    except (RuntimeError, OSError):
        return True
    return False


def inside(folder: str | Path, name, named_by: str | Path, field: str, folder_itself: bool = False) -> Path:
    """`folder / name` for a path that a file inside `folder` names (a record, a manifest, a sentence-transformers
    modules.json, a Router's router_config.json): the one place such a path is resolved. Refused
    (OutsideFolderError, before anything there is opened, whatever it holds) unless it is a plain relative name that
    stays inside the folder: an absolute path, `..`, or a symbolic link (of the name or of a folder on its way) that
    resolves outside would let a planted folder read, apply or test the contents of any file of the machine. A
    Hugging Face cache snapshot's links into its blobs/ stay inside (`confinement`). `named_by` is the file that
    names the path, `field` the field that holds it; `folder_itself` accepts "" (sentence-transformers' path of a
    module stored at the folder's top)."""
    folder = Path(folder)
    refused = f"{named_by}: {field} names {name!r}, which"
    what = "only a file inside the folder, or a folder in it, may be named there"
    if not isinstance(name, str) or (not name and not folder_itself) or "\0" in name:
        raise OutsideFolderError(f"{refused} is not a name of a file inside {folder}; {what}")
    if Path(name).is_absolute() or ".." in Path(name).parts or name.startswith("~"):
        raise OutsideFolderError(f"{refused} leaves {folder} (an absolute path or '..'); {what}")
    path = folder / name
    if not stays_inside(path, folder):
        raise OutsideFolderError(f"{refused} leaves {folder} through a symbolic link; {what}")
    return path


class ConfinedFolder:
    """The one reader of a folder the toolkit knows (a model, a pair, a static cell, exit heads, a query encoder,
    an index, a run, a graph cache, teacher targets): made before anything in the folder is opened, it refuses a
    folder holding a symbolic link that leaves it (`check_links`: a file the library behind a reader opens by a
    fixed name, such as a tokenizer's, could otherwise be read from anywhere), and `path` resolves every name a
    file of the folder gives through `inside`. The refusal says only that a path leaves the folder, never what
    lies outside (no content oracle)."""

    def __init__(self, folder: str | Path, kind: str = "model", check: bool = True):
        self.folder = Path(folder)
        self.kind = kind
        if check:
            self.check_links()

    def check_links(self) -> None:
        if not self.folder.is_dir():
            return
        for root, dirs, files in os.walk(self.folder, followlinks=False):
            for name in sorted(dirs + files):
                entry = Path(root) / name
                if entry.is_symlink() and _loops(entry):
                    raise OutsideFolderError(
                        f"{entry} is a symbolic link that loops (it leads back to itself): the {self.kind} folder "
                        f"{self.folder} is read only through links that reach a file; nothing in it was read"
                    )
                if entry.is_symlink() and not stays_inside(entry, self.folder):
                    raise OutsideFolderError(
                        f"{entry} is a symbolic link that leaves the {self.kind} folder {self.folder}: the folder is "
                        "read only inside itself (a Hugging Face cache snapshot may link into its own blobs/); "
                        "nothing in it was read: put the file itself in the folder"
                    )

    def path(self, name, named_by: str | Path | None = None, field: str = "a file name", folder_itself=False) -> Path:
        return inside(self.folder, name, named_by or self.folder, field, folder_itself)

    def read_json(self, name: str, error: type[Exception] | None = None, named_by=None, field: str = "a file name"):
        return read_json(self.path(name, named_by, field), error or DataFormatError)

    def read_bytes(self, name: str, named_by=None, field: str = "a file name") -> bytes:
        return self.path(name, named_by, field).read_bytes()

    def read_text(self, name: str, named_by=None, field: str = "a file name") -> str:
        return self.path(name, named_by, field).read_text(encoding="utf-8")


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
    skipped, anything else that is not a JSON object is an `error` naming the line."""
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
                if not isinstance(obj, dict):
                    raise error(f"{error.at(path, line_no)}: expected a JSON object, got {type(obj).__name__}")
                yield line_no, obj
    except UnicodeDecodeError:
        raise error(first_bad_utf8_line(path)) from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise error(f"{path}: unreadable ({exc})") from exc


def read_beir(path: str | Path, titles: bool) -> Iterator[tuple[int, str, str]]:
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


def read_json(path: str | Path, error: type[Exception] = DataFormatError):
    """A JSON document; a syntax error, bytes that are not UTF-8 (a binary file) or nesting deeper than the parser
    follows is an `error` naming the file (and the line)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise error(f"{where(path, exc.lineno)}: not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): not a JSON file"
        ) from None
    except RecursionError:
        raise error(f"{path}: nested deeper than a JSON reader follows; not a file matryoshka2d wrote") from None
    except ValueError:  # an integer of thousands of digits: past Python's conversion limit, named with its field
        place, digits = _first_long(json.loads(path.read_text(encoding="utf-8"), parse_int=_int_or_long))
        raise error(
            f"{path}: {place}: a whole number of {digits} digits, more than Python reads "
            f"({sys.get_int_max_str_digits()}): not a number matryoshka2d writes"
        ) from None


class _LongNumber:
    """A JSON integer with more digits than Python converts, kept as its length so that its field can be named."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))


def _int_or_long(text: str):
    try:
        return int(text)
    except ValueError:
        return _LongNumber(text)


def _first_long(value, place: str = "") -> tuple[str, int]:
    """(where, digits) of the first _LongNumber in `value`, in the file's order ('scores[3].layer')."""
    if isinstance(value, _LongNumber):
        return place or "the document", value.digits
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{place}[{key}]" if isinstance(key, int) else f"{place}.{key}" if place else str(key)
        if (found := _first_long(item, inner))[0] != "":
            return found
    return "", 0


# ---- result files of `matryoshka2d eval`: results.json (a grid) and cascade.json -----------------------------
# One reader (rule 6): `pick`, `report` and the model card read them through `read_result_record`, which checks
# every field they use and names the file and the field of the first that is wrong. A score is a JSON number (a
# boolean or a string is not); NaN or inf is a score that could not be computed (a correlation of constant
# vectors), which pick names and leaves out. A cell's average must be the mean of its per-dataset scores.


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
