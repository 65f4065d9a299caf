"""The one writer (docs/reliability.md, rule 1): every file or folder any command writes, replaces or deletes goes
through this package.

Its guarantees follow from writing only here:

* **Nothing read is written over.** `main` opens a `command_scope` with the command's inputs (every option that
  names what it reads; a folder stands for every file in it). Each write resolves its destination through every
  link and is refused (`OutputError`, exit 2 naming the output option) when the destination *is* an input (the same
  path, or the same file or folder by device and inode: a hard link, a bind mount), *holds* one, or, for an output
  filled as a whole or a single output file, *lies inside* an input folder, under any name of either (the whole
  chain of folders is compared by identity). A folder of named result files may lie inside a folder the command
  reads (`eval --output RUN/sts` is the documented layout), never be or hold an input. A tree is removed only when
  nothing in it is an input and no file system is mounted in it.
* **Only files and folders are written.** A destination that is a device, a pipe, a socket or standard output
  (`/dev/null`, a FIFO, `/dev/stdout`) is refused, never replaced.
* **Links are replaced, never written through.** A file is written to a hidden temporary file beside its
  destination and moved into place with `os.replace`, so a symbolic link (or a hard link) standing in the
  destination's place is replaced by the new file and what it pointed at is untouched. A folder that is a link is
  refused, never followed for deletion or filled.
* **A kill leaves the old file or the new one**, never a half (the rename is atomic); a staging folder a killed
  command left is removed by the next staging in the same place (`staging.stale`).
* **A failure leaves what was there**: a full disk, a size limit or a folder that refuses renames is one
  `OutputError` naming the output (never a temporary name, `staging.user_path`); the temporary file or folder goes,
  and a command's result set is put back as it was (`CommandScope.keep_whole`). An output folder that cannot be
  written (read-only, immutable, append-only, full) is refused before any work (`check_writable`).

Library callers outside a command get all but the comparison with inputs and the result set. Tests enumerate
every command and check that each file it leaves came from here (`committed`, and no write-mode `open` outside the
temporary names this package makes: `is_writer_temporary`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from matryoshka2d.outputs.disk import folder_flags, identity, mounts_at_or_below, space_problem
from matryoshka2d.outputs.failures import failure_message, storage
from matryoshka2d.outputs.scope import (
    CommandScope,
    OutputError,
    allow_folder,
    check_apart,
    check_destination,
    command_scope,
    current_scope,
    made_folder,
    names_now,
    naming,
    user_path,
    user_text,
)
from matryoshka2d.outputs.staging import (
    _UMASK,
    OUTSIDE_COMMANDS,
    TEMPORARY_MARK,
    forget,
    is_writer_temporary,
    new_staging_folder,
    owner_file,
    stale,
    stand_for,
)


def _temporary_beside(dest: Path, suffix: str = "") -> Path:
    """A new hidden name in `dest`'s folder (same file system, so os.replace is atomic), ending in `suffix`
    (a writer such as savefig or np.save reads the format from it)."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name[:40]}{TEMPORARY_MARK}", suffix=suffix, dir=dest.parent)
    os.close(fd)
    os.chmod(name, 0o666 & ~_UMASK)
    stand_for(name, dest, names_now())
    return Path(name)


def _gone(temporary: Path) -> None:
    """A temporary path is gone: a library caller's name is forgotten (a command's stays until it ends)."""
    if current_scope() is None:
        forget(temporary, OUTSIDE_COMMANDS)


def _links_below_output(path: Path) -> None:
    """A folder strictly below the command's output that is a link (a `checkpoints/` or `teacher-targets/` made a
    link to another run's) is refused: writing or deleting through it would reach the other run. Folders at or
    above the output (a `runs/` link of the user's) are the user's layout and are followed."""
    scope = current_scope()
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
    scope = current_scope()
    if scope is not None:
        scope.before_replacing(dest)
    os.replace(tmp, dest)
    sys.audit("matryoshka2d.write", str(dest.absolute()))  # tests check that every file a command leaves came here
    if scope is not None:
        scope.committed.append(dest.absolute())


@contextlib.contextmanager
def writing(dest: str | os.PathLike, option: str | None = None, suffix: str | None = None) -> Iterator[Path]:
    """For a writer that takes a path (np.save, faiss.write_index, safetensors, savefig, onnx.save): yields a
    temporary path beside `dest` to write, then moves it into place; nothing is left when the block fails, and a
    failure of the storage (a full disk, a size limit) is one OutputError naming `dest`."""
    dest = check_destination(dest, option)
    if dest.is_dir() and not dest.is_symlink():
        raise OutputError(f"{naming(dest, option)} is a folder, where a file is written: give a file's path")
    _parent_ready(dest, option)
    with storage(dest, option, "making a temporary file to write"):
        tmp = _temporary_beside(dest, dest.suffix if suffix is None else suffix)
    ours = lambda path: is_writer_temporary(path) or Path(path).absolute() == dest.absolute()  # noqa: E731
    try:
        with storage(dest, option, "writing", ours):
            yield tmp
            _commit(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        _gone(tmp)


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
    with storage(dest, option, "opening the log"):
        fd = os.open(dest, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")


def _refuse_link(path: Path, what: str) -> None:
    if path.is_symlink():
        raise OutputError(
            f"{user_path(path)} is a symbolic link (-> {os.readlink(path)}): matryoshka2d never {what} through a "
            "link, which could reach another run's or model's files; remove the link (or choose another output)"
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
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    try:
        with storage(path, option, "making the folder"):
            path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise OutputError(
            f"{naming(blocking, option)} is a file, not a folder; choose another output"
            if blocking.is_file()
            else f"{naming(blocking, option)} is not a folder; choose another output"
        ) from None
    for folder in reversed(missing):
        made_folder(folder)
    return path


def _removable_tree(path: Path, option: str | None) -> None:
    """Refuse to delete a tree that holds a file system mounted in it (or is one: what lies there is another
    place's), or, in a command, an input folder under any name (a bind mount of the model inside the output). A
    file is only unlinked, so a hard link to an input leaves the input whole."""
    mounted = mounts_at_or_below(path)
    if mounted:
        where = " inside it" if mounted[0] != path.resolve() else ""
        raise OutputError(
            f"{naming(path, option)}: {mounted[0]} is a mount point{where}; matryoshka2d never deletes across a "
            "mount (what is mounted there belongs elsewhere, and may be a folder the command reads under a second "
            "name): unmount it or choose another output"
        )
    scope = current_scope()
    if scope is None or not scope.inputs:
        return
    folders = {item.identity: item for item in scope.inputs if item.is_dir and item.identity is not None}
    for root, dirs, _files in os.walk(path, followlinks=False):
        for name in dirs:
            here = Path(root) / name
            item = folders.get(identity(here)) if not here.is_symlink() else None
            if item is not None:
                raise OutputError(
                    f"{naming(path, option)} holds {user_path(here)}, which is {item.option} {item.given} under "
                    "another name; deleting it would delete what the command reads: nothing was deleted, choose "
                    "another output"
                )


def remove_tree(path: str | os.PathLike, option: str | None = None) -> None:
    """Delete a folder the command owns (old checkpoints, a temporary build). A link is refused, never followed;
    links inside the folder are removed as links (shutil.rmtree does not follow them); a tree holding an input
    under any name, or a mount point, is refused. A staging folder's owner file goes with it."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        _owner_gone(path)
        return
    _refuse_link(path, "deletes")
    _links_below_output(path)
    check_destination(path, option, whole_folder=True)
    _removable_tree(path, option)
    with storage(path, option, "removing the folder", removing=True):
        shutil.rmtree(path)
    _owner_gone(path)


def _owner_gone(folder: Path) -> None:
    if is_writer_temporary(folder.name):
        with contextlib.suppress(OSError):
            owner_file(folder).unlink(missing_ok=True)
        _gone(folder)


def remove_file(path: str | os.PathLike, option: str | None = None) -> None:
    """Delete a file the command owns; a link in its place is removed, never what it points at."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{naming(path, option)} is a folder, not a file the command wrote")
    if path.is_symlink():
        path.unlink()
        return
    check_destination(path, option)
    with storage(path, option, "removing the file", removing=True):
        path.unlink(missing_ok=True)


def move_into_place(source: str | os.PathLike, dest: str | os.PathLike, option: str | None = None) -> Path:
    """Rename a file or folder the command wrote (a temporary build) to its final name, atomically. A folder in
    the way must have been removed first (remove_tree)."""
    source, dest = Path(source), Path(dest)
    check_destination(dest, option, whole_folder=source.is_dir())
    if source.is_dir() and dest.is_symlink():
        _refuse_link(dest, "replaces a folder")
    if source.is_dir() and dest.is_dir() and mounts_at_or_below(dest):
        raise OutputError(f"{naming(dest, option)} is a mount point: a folder cannot be renamed onto it")
    with storage(dest, option, "moving the finished files into place"):
        _commit(source, dest)
    _owner_gone(source)
    return dest


def temporary_folder(parent: str | os.PathLike, name: str, stands_for: str | os.PathLike | None = None) -> Path:
    """A new, empty folder `parent/.NAME.m2d-tmp-XXXX` to build into before `move_into_place` (which checks the
    destination: the parent may well hold an input, as `runs/` holds the model an export reads). Messages name
    `stands_for` (by default `parent/NAME`) where they would name it. Staging folders left in `parent` by a killed
    command (their owner process gone) are removed first; nothing else is."""
    parent = Path(parent)
    make_folder(parent, check=False)
    for folder, owner in stale(parent):
        with contextlib.suppress(OutputError, OSError):  # what cannot be removed is left as it was
            remove_tree(folder)
            with contextlib.suppress(OSError):
                owner.unlink(missing_ok=True)
    with storage(parent / name, None, "making a staging folder"):
        folder = new_staging_folder(parent, name)
    stand_for(folder, stands_for if stands_for is not None else parent / name, names_now())
    return folder


def staged_for(temporary: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Messages name `dest` where they would name `temporary` (a folder inside a staging folder that will become
    `dest`), as `temporary_folder`'s `stands_for` does for the staging folder itself."""
    stand_for(temporary, dest, names_now())


def check_writable(folder: str | os.PathLike, option: str) -> None:
    """Refuse, before any work, an output folder that cannot be written: the folder, or the nearest folder above
    it that exists, must take a new file that can be renamed and removed (its flags, its file system's state and a
    try: permission bits do not stop root, a read-only mount, an immutable, append-only or full folder do)."""
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
    """Why nothing can be written into the existing `folder`, or None: its flags (append-only: a file made there
    could never be renamed into place nor removed), its file system (read-only, full), then a try (a permission
    check does not see everything, and root passes it everywhere): a new empty file under a temporary name,
    removed at once."""
    flags = folder_flags(folder)
    if flags:
        return f"the folder is {' and '.join(flags)}: files are written under a temporary name and renamed"
    if (problem := space_problem(folder)) is not None:
        return problem
    try:
        fd, name = tempfile.mkstemp(prefix=f".probe{TEMPORARY_MARK}", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    try:
        os.unlink(name)
    except OSError as exc:
        return f"a file made there cannot be removed ({exc.strerror})"
    return None


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
    "failure_message",
    "is_writer_temporary",
    "make_folder",
    "move_into_place",
    "naming",
    "open_for_append",
    "open_for_writing",
    "remove_file",
    "remove_tree",
    "staged_for",
    "temporary_folder",
    "user_path",
    "user_text",
    "write_bytes",
    "write_json",
    "write_text",
    "writing",
    "writing_problem",
]
