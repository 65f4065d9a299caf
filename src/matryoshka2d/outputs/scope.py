"""The command running now, as the one writer sees it: what it reads (every write is checked against it, by path
and by identity along the whole chain of folders), where it writes, and what it has written, so that a failure
puts its result files back as they were.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from matryoshka2d.outputs.disk import Identity, chain, identity, kind_of
from matryoshka2d.outputs.staging import OUTSIDE_COMMANDS, TEMPORARY_MARK
from matryoshka2d.outputs.staging import user_path as _user_path
from matryoshka2d.outputs.staging import user_text as _user_text

MAX_WALKED = 50_000  # files of an input folder compared by inode (a data folder of more is compared by path)


class OutputError(ValueError):
    """A destination that overlaps an input, is a link where a folder must be, or cannot be written."""


@dataclass
class _Input:
    option: str
    given: Path
    resolved: Path
    is_dir: bool
    identity: Identity | None  # the folder or file itself, whatever name it is reached by (a bind mount)
    above: list[Identity]  # every folder above it: an output that is one of them holds the input


@dataclass
class CommandScope:
    """The inputs of the command running now and where it writes (see `command_scope`)."""

    output_option: str
    output: Path | None = None  # the output as given (absolute, links not followed): folders below it are its own
    output_given: Path | None = None  # the output as the user wrote it (messages name it so)
    inputs: list[_Input] = field(default_factory=list)
    own_folders: list[Path] = field(default_factory=list)  # may lie inside an input (see allow_folder)
    identities: dict[Identity, list[tuple[str, Path]]] = field(default_factory=dict)
    committed: list[Path] = field(default_factory=list)
    result_set: set[Path] = field(default_factory=set)  # files put back as they were when the command fails
    journal: list[tuple[Path, Path | None]] = field(default_factory=list)  # (result file, its previous version)
    made: list[Path] = field(default_factory=list)  # folders the command created (removed again if left empty)
    names: dict[str, Path] = field(default_factory=dict)  # its temporary paths -> what each stands for (kept)

    def add_input(self, option: str, path: str | os.PathLike) -> None:
        given = Path(path).expanduser()
        resolved = given.resolve()
        item = _Input(option, given, resolved, resolved.is_dir(), identity(resolved), chain(resolved.parent))
        self.inputs.append(item)
        for file in _files_of(resolved):
            with contextlib.suppress(OSError):
                st = file.stat()
                self.identities.setdefault((st.st_dev, st.st_ino), []).append((option, file))

    def keep_whole(self, paths: Iterable[str | os.PathLike]) -> None:
        """These files are one set (a results folder's results.json, .md, .csv and heatmap): if the command fails
        after writing some of them, each is put back as it was (or removed, when it was new)."""
        self.result_set.update(Path(p).expanduser().absolute() for p in paths)

    def before_replacing(self, dest: Path) -> None:
        """Called before `dest` is replaced: a file of the result set keeps its previous version (a hard link
        beside it, no copy), once, until the command ends."""
        dest = dest.absolute()
        if dest not in self.result_set or any(done == dest for done, _ in self.journal):
            return
        previous = None
        if os.path.lexists(dest):
            previous = dest.with_name(f".{dest.name[:40]}{TEMPORARY_MARK}before-{secrets.token_hex(4)}")
            try:
                os.link(dest, previous, follow_symlinks=False)
            except OSError:
                return  # a file system without hard links: replaced without a way back, as outside a command
        self.journal.append((dest, previous))

    def finish(self, failed: bool) -> None:
        """The command ended: the previous versions go, or (`failed`) come back, and the folders it made and left
        empty are removed; nothing here raises (the command's own error is the one reported)."""
        for dest, previous in reversed(self.journal):
            with contextlib.suppress(OSError):
                if not failed:
                    if previous is not None:
                        os.unlink(previous)
                elif previous is not None:
                    os.replace(previous, dest)
                else:
                    os.unlink(dest)  # new in this run
        if failed:
            for folder in reversed(self.made):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when empty


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
    files are not inputs). When the block fails, the result set (`CommandScope.keep_whole`) is put back."""
    scope = CommandScope(output_option, output=Path(output).expanduser().absolute() if output else None)
    scope.output_given = Path(output) if output else None
    scope.own_folders = [Path(f).expanduser().resolve() for f in own_folders if f]
    for option, path in inputs:
        if path is not None and str(path) != "":
            scope.add_input(option, path)
    token = _scope.set(scope)
    try:
        yield scope
    except BaseException:
        scope.finish(failed=True)
        raise
    else:
        scope.finish(failed=False)
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


def made_folder(folder: Path) -> None:
    """`folder` was created by the running command (removed again if the command fails and leaves it empty)."""
    scope = _scope.get()
    if scope is not None:
        scope.made.append(folder)


def names_now() -> dict[str, Path]:
    """Where a new temporary name is recorded: the running command's scope (kept until it ends, so that its error,
    reported once its temporary files are gone, can still be said in the user's paths), else the library's."""
    scope = _scope.get()
    return scope.names if scope is not None else OUTSIDE_COMMANDS


def user_path(path: str | os.PathLike, scope: CommandScope | None = None) -> Path:
    """`path` as the user named it: a temporary path of the writer becomes the path it stands for."""
    scope = scope or _scope.get()
    return _user_path(path, {**OUTSIDE_COMMANDS, **(scope.names if scope else {})})


def user_text(text: str, scope: CommandScope | None = None) -> str:
    """A message with every temporary path of the writer in it replaced by the path it stands for."""
    scope = scope or _scope.get()
    return _user_text(text, {**OUTSIDE_COMMANDS, **(scope.names if scope else {})})


def check_apart(output, flag: str, inputs, whole_folder: bool = True) -> None:
    """Rule 1 for one output and its inputs ((option, path) pairs), outside or inside a command: refused when the
    output is, holds or (`whole_folder`) lies inside an input, links followed, hard links and second names of a
    folder (a bind mount) counted."""
    with command_scope(flag, inputs, own_folders=() if whole_folder else [Path(output).expanduser().parent]):
        check_destination(output, flag, whole_folder=whole_folder)


def naming(dest: str | os.PathLike, option: str | None = None) -> str:
    """`dest` as a message names it: the path the user gave (never a temporary one), after the option it came
    from (given, or the command's output option when it lies in the command's output)."""
    shown = user_path(dest)
    scope = _scope.get()
    if option is None and scope is not None and scope.output is not None:
        where = shown.expanduser().absolute()
        if where.is_relative_to(scope.output) or any(where.is_relative_to(f) for f in scope.own_folders):
            option = scope.output_option
    return f"{option} {shown}" if option else str(shown)


def _shown(option: str | None, given: Path, resolved: Path) -> str:
    link = f" (-> {resolved})" if given.absolute() != resolved else ""
    return f"{option + ' ' if option else ''}{user_path(given)}{link}"


def refuse_what_is_no_file(dest: Path, option: str | None) -> None:
    """A destination that is (links followed) a device, a pipe, a socket or standard output is refused: the writer
    replaces what stands at a path by renaming a finished file onto it, which would replace the device (as root,
    `--output /dev/null` the system's own) or the link to it, never write to it."""
    what = kind_of(dest)
    if what is None:
        return
    link = f" (-> {os.readlink(dest)})" if dest.is_symlink() else ""
    raise OutputError(
        f"{naming(dest, option)}{link} is {what}, not a file or folder: matryoshka2d writes a finished file into "
        "place, which would replace it rather than write to it; nothing was done: give a path of a file or folder "
        "(to read the output, write it to a file and read that file)"
    )


def check_destination(
    dest: str | os.PathLike, option: str | None = None, whole_folder: bool = False, results_folder: bool = False
) -> Path:
    """Refuse `dest` (OutputError) when it is a device, a pipe or standard output (always), or when, links followed,
    it is an input of the running command (by path, or by device and inode: a hard link, a bind mount), holds one
    (an input folder is inside it, under any name of either), or lies inside an input folder (a file of one of the
    command's own folders, a results folder or a cache, may: `eval --output RUN/sts`). `results_folder`: `dest` is
    a folder the command writes named result files into, which may hold what it reads (pick writes beside its
    results) but may not be an input folder itself. Returns `dest` as given."""
    dest = Path(dest)
    scope = _scope.get()
    refuse_what_is_no_file(dest, option or (scope.output_option if scope else None))
    if scope is None:
        return dest
    option = option or scope.output_option
    target = dest.expanduser().resolve()
    target_identity = identity(target)
    above = chain(target)  # target itself (when it exists) and every folder above it, by identity
    inside_allowed = any(target.is_relative_to(f) for f in scope.own_folders)
    for item in scope.inputs:
        how = None
        if results_folder and not item.is_dir:
            continue  # a results folder may hold the result files it reads (pick writes beside them)
        same_folder = item.is_dir and target_identity is not None and target_identity == item.identity
        if target == item.resolved or same_folder:
            how = "is"
        elif results_folder:
            continue
        elif item.resolved.is_relative_to(target) or (target_identity is not None and target_identity in item.above):
            how = "holds"
        elif item.is_dir and not inside_allowed and (target.is_relative_to(item.resolved) or item.identity in above):
            how = "is inside"
        if how:
            _refuse(option, dest, target, how, item)
    # The same file by device and inode: a hard link, or a link to a file inside an input folder. A file of the
    # command's own folder written again under its own name (eval's results.json in RUN/sts) is not refused.
    own_again = inside_allowed and not dest.is_symlink()
    if results_folder and target.is_dir():
        return dest
    for source_option, source in scope.identities.get(target_identity, []) if target_identity is not None else []:
        if identity(source) != target_identity:
            continue  # the input file was replaced since the command started, and its inode number reused
        if not (own_again and source.absolute() == target):
            _refuse(option, dest, target, "is", _Input(source_option, source, source.resolve(), False, None, []))
    return dest


def _refuse(option, dest, target, how, item: _Input):
    why = {
        "is": "writing there would replace what the command reads",
        "holds": "writing there (or --overwrite) could delete or replace what the command reads",
        "is inside": "the output would be written into the folder the command reads",
    }[how]
    by_path = {"is": target == item.resolved, "holds": item.resolved.is_relative_to(target)}.get(how)
    if by_path is None:
        by_path = target.is_relative_to(item.resolved)
    if how == "is" and not item.is_dir and not by_path:
        what = " (the same file under another name: a hard link)"
    elif not by_path:
        what = {
            "is": " (the same folder under another name: a bind mount or another mount of it)",
            "holds": " (a folder above it seen under another name: a bind mount or another mount of it)",
            "is inside": " (seen under another name: a bind mount or another mount of it)",
        }[how]
    else:
        what = ""
    raise OutputError(
        f"{_shown(option, dest, target)} {how} {_shown(item.option, item.given, item.resolved)}{what}: {why}; "
        f"nothing was written: choose another {option}"
    )


__all__ = [
    "MAX_WALKED",
    "CommandScope",
    "OutputError",
    "allow_folder",
    "check_apart",
    "check_destination",
    "command_scope",
    "current_scope",
    "made_folder",
    "names_now",
    "naming",
    "refuse_what_is_no_file",
    "user_path",
    "user_text",
]
