"""The one writer (docs/reliability.md, rule 2): every file or folder any command writes, replaces or deletes goes
through this module.

Three guarantees follow from writing only here:

* **Nothing read is written over.** `main` opens a `command_scope` with the command's inputs (every option that
  names what it reads; a folder stands for every file in it). Each write resolves its destination through every
  link and is refused (`OutputError`, exit 2 naming the output option) when the destination *is* an input (the same
  path, or the same file by device and inode: a hard link counts), *holds* one, or, for an output filled as a
  whole or a single output file, *lies inside* an input folder. A folder of named result files may lie inside a
  folder the command reads (`eval --output RUN/sts` is the documented layout), never be or hold an input.
* **Links are replaced, never written through.** A file is written to a hidden temporary file beside its
  destination and moved into place with `os.replace`, so a symbolic link (or a hard link) standing in the
  destination's place is replaced by the new file and what it pointed at is untouched. A folder that is a link is
  refused, never followed for deletion or filled.
* **A kill leaves the old file or the new one**, never a half (the rename is atomic).

Library callers outside a command get the last two; `command_scope` adds the first. Tests enumerate every
command and check that each file it leaves came from here (`committed`, and no write-mode `open` outside the
temporary names this module makes: `is_writer_temporary`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

TEMPORARY_MARK = ".m2d-tmp-"  # every temporary name this module makes holds it (tests look for it)
MAX_WALKED = 50_000  # files of an input folder compared by inode (a data folder of more is compared by path)
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: temporary files get the mode a plain open() would have given the file


class OutputError(ValueError):
    """A destination that overlaps an input, is a link where a folder must be, or cannot be written."""


@dataclass
class _Input:
    option: str
    given: Path
    resolved: Path
    is_dir: bool


@dataclass
class CommandScope:
    """The inputs of the command running now and where it writes (see `command_scope`)."""

    output_option: str
    output: Path | None = None  # the output as given (absolute, links not followed): folders below it are its own
    inputs: list[_Input] = field(default_factory=list)
    own_folders: list[Path] = field(default_factory=list)  # may lie inside an input (see allow_folder)
    identities: dict[tuple[int, int], list[tuple[str, Path]]] = field(default_factory=dict)
    committed: list[Path] = field(default_factory=list)

    def add_input(self, option: str, path: str | os.PathLike) -> None:
        given = Path(path).expanduser()
        resolved = given.resolve()
        item = _Input(option, given, resolved, resolved.is_dir())
        self.inputs.append(item)
        for file in _files_of(resolved):
            with contextlib.suppress(OSError):
                st = file.stat()
                self.identities.setdefault((st.st_dev, st.st_ino), []).append((option, file))


_scope: contextvars.ContextVar[CommandScope | None] = contextvars.ContextVar("matryoshka2d_output_scope", default=None)


def _files_of(path: Path) -> Iterator[Path]:
    """`path` itself when it is a file, else the files in it (links not followed), at most MAX_WALKED."""
    if path.is_file():
        yield path
        return
    if not path.is_dir():
        return
    seen = 0
    for root, _dirs, files in os.walk(path, followlinks=False):
        here = Path(root)
        for name in files:
            seen += 1
            if seen > MAX_WALKED:
                return
            yield here / name


@contextlib.contextmanager
def command_scope(
    output_option: str, inputs: Iterable[tuple[str, str | os.PathLike | None]], output=None, own_folders=()
):
    """While the block runs, every write is checked against `inputs` ((option, path) pairs; None is skipped).
    `output`: where the command writes (a folder below it that is a link is refused); `own_folders`: folders of
    named result files or caches the command keeps, which may lie inside a folder it reads (their own earlier
    files are not inputs)."""
    scope = CommandScope(output_option, output=Path(output).expanduser().absolute() if output else None)
    scope.own_folders = [Path(f).expanduser().resolve() for f in own_folders if f]
    for option, path in inputs:
        if path is not None and str(path) != "":
            scope.add_input(option, path)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def current_scope() -> CommandScope | None:
    return _scope.get()


def allow_folder(folder: str | os.PathLike) -> None:
    """A cache the command keeps by design inside a folder it reads (the ONNX graphs in a model's `onnx-serve/`):
    files may be written inside it; it still may not be, or hold, an input. No-op outside a command."""
    scope = _scope.get()
    if scope is not None:
        scope.own_folders.append(Path(folder).expanduser().resolve())


def check_apart(output, flag: str, inputs, whole_folder: bool = True) -> None:
    """Rule 2 for one output and its inputs ((option, path) pairs), outside or inside a command: refused when the
    output is, holds or (`whole_folder`) lies inside an input, links followed and hard links counted."""
    with command_scope(flag, inputs, own_folders=() if whole_folder else [Path(output).expanduser().parent]):
        check_destination(output, flag, whole_folder=whole_folder)


def _shown(option: str | None, given: Path, resolved: Path) -> str:
    link = f" (-> {resolved})" if given.absolute() != resolved else ""
    return f"{option + ' ' if option else ''}{given}{link}"


def check_destination(
    dest: str | os.PathLike, option: str | None = None, whole_folder: bool = False, results_folder: bool = False
) -> Path:
    """Refuse `dest` (OutputError) when, links followed, it is an input of the running command (by path, or by
    device and inode), holds one, or lies inside an input folder (a file of one of the command's own folders, a
    results folder or a cache, may: `eval --output RUN/sts`). `results_folder`: `dest` is a folder the command
    writes named result files into, which may hold what it reads (pick writes beside its results) but may not be
    an input folder itself. Returns `dest` as given."""
    dest = Path(dest)
    scope = _scope.get()
    if scope is None:
        return dest
    option = option or scope.output_option
    target = dest.expanduser().resolve()
    identity = None
    with contextlib.suppress(OSError):
        st = target.stat()
        identity = (st.st_dev, st.st_ino)
    inside_allowed = any(target.is_relative_to(f) for f in scope.own_folders)
    for item in scope.inputs:
        how = None
        if results_folder and not item.is_dir:
            continue  # a results folder may hold the result files it reads (pick writes beside them)
        if target == item.resolved:
            how = "is"
        elif results_folder:
            continue
        elif item.resolved.is_relative_to(target):
            how = "holds"
        elif item.is_dir and target.is_relative_to(item.resolved) and not inside_allowed:
            how = "is inside"
        if how:
            _refuse(option, dest, target, how, item.option, item.given, item.resolved)
    # The same file by device and inode: a hard link, or a link to a file inside an input folder. A file of the
    # command's own folder written again under its own name (eval's results.json in RUN/sts) is not refused.
    own_again = inside_allowed and not dest.is_symlink()
    if results_folder and target.is_dir():
        return dest
    for source_option, source in scope.identities.get(identity, []) if identity is not None else []:
        if _identity(source) != identity:
            continue  # the input file was replaced since the command started, and its inode number reused
        if not (own_again and source.absolute() == target):
            _refuse(option, dest, target, "is", source_option, source, source.resolve())
    return dest


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _refuse(option, dest, target, how, source_option, source, source_resolved):
    why = {
        "is": "writing there would replace what the command reads",
        "holds": "writing there (or --overwrite) could delete or replace what the command reads",
        "is inside": "the output would be written into the folder the command reads",
    }[how]
    same_file = how == "is" and source_resolved != target
    what = " (the same file under another name: a hard link)" if same_file else ""
    raise OutputError(
        f"{_shown(option, dest, target)} {how} {_shown(source_option, source, source_resolved)}{what}: {why}; "
        f"nothing was written: choose another {option}"
    )


def _temporary_beside(dest: Path, suffix: str = "") -> Path:
    """A new hidden name in `dest`'s folder (same file system, so os.replace is atomic), ending in `suffix`
    (a writer such as savefig or np.save reads the format from it)."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name[:40]}{TEMPORARY_MARK}", suffix=suffix, dir=dest.parent)
    os.close(fd)
    os.chmod(name, 0o666 & ~_UMASK)
    return Path(name)


def _links_below_output(path: Path) -> None:
    """A folder strictly below the command's output that is a link (a `checkpoints/` or `teacher-targets/` made a
    link to another run's) is refused: writing or deleting through it would reach the other run. Folders at or
    above the output (a `runs/` link of the user's) are the user's layout and are followed."""
    scope = _scope.get()
    if scope is None or scope.output is None:
        return
    path = path.expanduser().absolute()
    if not path.is_relative_to(scope.output) or path == scope.output:
        return
    step = scope.output
    for part in path.relative_to(scope.output).parts:
        step = step / part
        _refuse_link(step, "writes")


def _parent_ready(dest: Path, option: str | None) -> None:
    _links_below_output(dest.parent)
    make_folder(dest.parent, option, check=False)


def _commit(tmp: Path, dest: Path) -> None:
    os.replace(tmp, dest)
    sys.audit("matryoshka2d.write", str(dest.absolute()))  # tests check that every file a command leaves came here
    scope = _scope.get()
    if scope is not None:
        scope.committed.append(dest.absolute())


@contextlib.contextmanager
def writing(dest: str | os.PathLike, option: str | None = None, suffix: str | None = None) -> Iterator[Path]:
    """For a writer that takes a path (np.save, faiss.write_index, safetensors, savefig, onnx.save): yields a
    temporary path beside `dest` to write, then moves it into place; nothing is left when the block fails."""
    dest = check_destination(dest, option)
    _parent_ready(dest, option)
    tmp = _temporary_beside(dest, dest.suffix if suffix is None else suffix)
    try:
        yield tmp
        _commit(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def open_for_writing(dest: str | os.PathLike, mode: str = "w", option: str | None = None, **kwargs):
    """A file object on a temporary file beside `dest`, moved into place when the block ends without error."""
    if mode not in ("w", "wb", "x", "xb"):
        raise ValueError(f"open_for_writing writes a new file; mode {mode!r} is not one of w, wb")
    if mode == "w" and "encoding" not in kwargs:
        kwargs["encoding"] = "utf-8"
    with writing(dest, option) as tmp, tmp.open(mode.replace("x", "w"), **kwargs) as f:
        yield f


def write_bytes(dest: str | os.PathLike, data: bytes, option: str | None = None) -> Path:
    with open_for_writing(dest, "wb", option) as f:
        f.write(data)
    return Path(dest)


def write_text(dest: str | os.PathLike, text: str, option: str | None = None) -> Path:
    with open_for_writing(dest, "w", option, newline="") as f:
        f.write(text)
    return Path(dest)


def write_json(dest: str | os.PathLike, obj, option: str | None = None, indent: int | None = 2) -> Path:
    return write_text(dest, json.dumps(obj, indent=indent) + "\n", option)


def open_for_append(dest: str | os.PathLike, option: str | None = None):
    """A log the command keeps adding to (a run's train_log.jsonl): opened without following a link in its place
    (a link there is refused)."""
    dest = check_destination(dest, option)
    if dest.is_symlink():
        raise OutputError(
            f"{dest} is a symbolic link (-> {os.readlink(dest)}); matryoshka2d appends only to a file of its own, "
            "never through a link: remove the link"
        )
    _parent_ready(dest, option)
    sys.audit("matryoshka2d.append", str(dest.absolute()))  # announced, like a commit (tests watch both)
    fd = os.open(dest, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")


def _refuse_link(path: Path, what: str) -> None:
    if path.is_symlink():
        raise OutputError(
            f"{path} is a symbolic link (-> {os.readlink(path)}): matryoshka2d never {what} through a link, which "
            "could reach another run's or model's files; remove the link (or choose another output)"
        )


def make_folder(path: str | os.PathLike, option: str | None = None, check: bool = True, own: bool = False) -> Path:
    """Create a folder to write into (and its parents). `own`: a folder of the command's own inside its output
    (checkpoints/, teacher-targets/): a link in its place is refused, as is any link below the command's output."""
    path = Path(path)
    if check:
        check_destination(path, option, whole_folder=True)
    if own:
        _refuse_link(path, "fills a folder")
    _links_below_output(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{path} is a file, not a folder; choose another output") from None
    return path


def remove_tree(path: str | os.PathLike, option: str | None = None) -> None:
    """Delete a folder the command owns (old checkpoints, a temporary build). A link is refused, never followed;
    links inside the folder are removed as links (shutil.rmtree does not follow them)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    _refuse_link(path, "deletes")
    _links_below_output(path)
    check_destination(path, option, whole_folder=True)
    shutil.rmtree(path)


def remove_file(path: str | os.PathLike, option: str | None = None) -> None:
    """Delete a file the command owns; a link in its place is removed, never what it points at."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{path} is a folder, not a file the command wrote")
    if path.is_symlink():
        path.unlink()
        return
    check_destination(path, option)
    path.unlink(missing_ok=True)


def move_into_place(source: str | os.PathLike, dest: str | os.PathLike, option: str | None = None) -> Path:
    """Rename a file or folder the command wrote (a temporary build) to its final name, atomically. A folder in
    the way must have been removed first (remove_tree)."""
    source, dest = Path(source), Path(dest)
    check_destination(dest, option, whole_folder=source.is_dir())
    if source.is_dir() and dest.is_symlink():
        _refuse_link(dest, "replaces a folder")
    _commit(source, dest)
    return dest


def temporary_folder(parent: str | os.PathLike, name: str) -> Path:
    """A new, empty folder `parent/.NAME.m2d-tmp-XXXX` to build into before `move_into_place` (which checks the
    destination: the parent may well hold an input, as `runs/` holds the model an export reads)."""
    make_folder(parent, check=False)
    folder = tempfile.mkdtemp(prefix=f".{name}{TEMPORARY_MARK}", dir=parent)
    os.chmod(folder, 0o777 & ~_UMASK)
    return Path(folder)


def check_writable(folder: str | os.PathLike, option: str) -> None:
    """Refuse, before any work, an output folder that cannot be written: the folder, or the nearest folder above
    it that exists, must take a new file (tried, since permission bits do not stop root; a read-only mount or an
    immutable folder does)."""
    path = Path(folder).expanduser()
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise OutputError(f"{option} {folder}: {probe} is a link to nothing ({os.readlink(probe)})")
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OutputError(f"{option} {folder}: {probe} is a file, not a folder; choose another {option}")
    if (problem := writing_problem(probe)) is not None:
        raise OutputError(
            f"{option} {folder}: {probe} cannot be written ({problem}); nothing was done: choose a "
            f"folder that can be written for {option}"
        )


def writing_problem(folder: str | os.PathLike) -> str | None:
    """Why nothing can be written into the existing `folder`, or None: found by trying (a permission check does
    not see a read-only mount or an immutable folder, and root passes it everywhere). The probe is a new empty file
    under this module's temporary name, removed at once."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".probe{TEMPORARY_MARK}", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return None


def is_writer_temporary(path: str | os.PathLike) -> bool:
    """Whether `path` is, or lies inside, a temporary name this module made."""
    return any(TEMPORARY_MARK in part for part in Path(path).parts)


__all__ = [
    "TEMPORARY_MARK",
    "CommandScope",
    "OutputError",
    "allow_folder",
    "check_apart",
    "check_destination",
    "check_writable",
    "command_scope",
    "current_scope",
    "is_writer_temporary",
    "make_folder",
    "move_into_place",
    "open_for_append",
    "open_for_writing",
    "remove_file",
    "remove_tree",
    "temporary_folder",
    "write_bytes",
    "write_json",
    "write_text",
    "writing",
    "writing_problem",
]
