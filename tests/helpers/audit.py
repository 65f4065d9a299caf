"""One Python audit hook for the tests that watch what the package opens and writes (issue 52): every `open`
(`(path, mode, flags)`, made through Python; Rust and C++ code raises no event) and the one writer's own events,
`matryoshka2d.write` (a file moved into place) and `matryoshka2d.append` (a log opened for appending).

A hook cannot be removed once added, so this one is added once, for the whole process, and records only inside
`recording()`."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

_RECORDING: list[list[tuple[str, tuple]]] = []
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _hook(event: str, args) -> None:
    if _RECORDING and event in ("open", "matryoshka2d.write", "matryoshka2d.append"):
        for events in _RECORDING:
            events.append((event, args))


sys.addaudithook(_hook)


@contextlib.contextmanager
def recording():
    """Yields the list the block's events go into: (event, args)."""
    events: list[tuple[str, tuple]] = []
    _RECORDING.append(events)
    try:
        yield events
    finally:
        _RECORDING.remove(events)


def opens(events) -> list[tuple[str, object, int]]:
    """(absolute path, mode, flags) of every open by name (an open file descriptor has no name)."""
    found = []
    for event, args in events:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            found.append((os.path.abspath(os.fsdecode(args[0])), args[1], args[2] or 0))
    return found


def writes(mode, flags: int) -> bool:
    """Whether an open of this mode (builtin open) or these flags (os.open) may write."""
    return any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE_FLAGS)


def opened_for_writing(events) -> list[Path]:
    return [Path(path) for path, mode, flags in opens(events) if writes(mode, flags)]


def announced(events, kind: str) -> list[str]:
    """The paths of the writer's `matryoshka2d.<kind>` events ('write' or 'append')."""
    return [args[0] for event, args in events if event == f"matryoshka2d.{kind}"]


def opened_under(events, *folders: Path) -> list[str]:
    """The paths opened (for reading or writing) that are, or lie in, one of `folders` (links resolved)."""
    roots = [Path(folder).resolve() for folder in folders]
    return [path for path, _, _ in opens(events) if any(Path(path).resolve().is_relative_to(r) for r in roots)]
