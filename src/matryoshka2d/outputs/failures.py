"""How a failure of the storage is said: one OutputError (or, for what reached the command line, one line) naming the
place the user gave, what the storage refused, what was left, and what to do; never a temporary name of the writer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from matryoshka2d.outputs.disk import STORAGE_FULL, storage_failure
from matryoshka2d.outputs.scope import CommandScope, OutputError, naming, user_path, user_text
from matryoshka2d.outputs.staging import is_writer_temporary


@contextlib.contextmanager
def storage(dest: Path, option: str | None, doing: str, ours=None, removing: bool = False) -> Iterator[None]:
    """An error of the storage while `doing` (a full disk, a size limit, a refused rename; `disk.storage_failure`)
    becomes one OutputError naming the destination as the user gave it; any other error passes unchanged."""
    try:
        yield
    except OutputError:
        raise
    except Exception as exc:
        what = storage_failure(exc, ours or (lambda path: True))
        if what is None:
            raise
        raise OutputError(f"{naming(dest, option)}: {doing} failed ({what}); {after_failure(what, removing)}") from exc


def after_failure(what: str, removing: bool = False) -> str:
    """What a failed write left, and what to do: make room when the storage was full, else write elsewhere."""
    room = "make room (free space, a larger quota or file size limit)"
    full = any(os.strerror(code) in what for code in STORAGE_FULL)
    if removing:  # a deletion stopped half-way cannot be undone
        return f"part of it may be gone already: {room if full else 'check what is left'}"
    todo = room if full else "choose a place that can be written"
    return f"what was there is left as it was and nothing of the attempt remains: {todo}"


def failure_message(exc: BaseException, scope: CommandScope | None = None) -> str | None:
    """The one line for an error that ended a command (`scope`, its writer's scope), in the paths the user gave: a
    failure of the storage (a full disk, a size limit, a refused rename, from Python or from a library's own writer
    such as safetensors') names the file being written, or the command's output when the error names none; an
    OutputError, ValueError, TypeError or OSError is its own text with the writer's temporary paths replaced by what
    they stand for. None for any other error (a fault of the toolkit, whose traceback is shown)."""
    output = scope.output if scope is not None else None

    def ours(path) -> bool:
        where = Path(path).absolute()
        return is_writer_temporary(where) or (output is not None and where.is_relative_to(output))

    what = None if isinstance(exc, OutputError) else storage_failure(exc, ours)
    if what is None:
        return user_text(str(exc), scope) if isinstance(exc, (ValueError, TypeError, OSError)) else None
    named = getattr(exc, "filename", None)
    place = user_path(named, scope) if named is not None else scope.output_given if scope is not None else None
    if place is None:
        return f"writing failed ({what}); {after_failure(what)}"
    option = scope.output_option if output is not None and Path(place).absolute().is_relative_to(output) else None
    return f"{option + ' ' if option else ''}{place}: writing failed ({what}); {after_failure(what)}"


__all__ = ["after_failure", "failure_message", "storage"]
