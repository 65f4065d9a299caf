"""The one writer's temporary names: every file it writes first, every folder it builds in, and what each stands
for.

* **Names.** Each holds TEMPORARY_MARK (`.NAME.m2d-tmp-XXXX`), beside what it will replace (the same file system,
  so the final rename is atomic); tests look for the mark.
* **What a temporary name stands for.** A message never names a temporary path: `user_path` gives the path the
  user asked for (the output a staging folder is built for, the file a temporary file will become), and
  `user_text` puts it in place of every temporary path a message holds (an OSError raised by a library writing
  into a staging folder, a safetensors or tokenizers error).
* **Whose folder it is.** A staging folder has an owner file beside it (`.NAME.m2d-tmp-XXXX.owner`, written
  before the folder is made and removed after it), saying which process builds it: a folder whose process is gone
  (killed during an export, a save, a checkpoint) is `stale` and the next staging in the same place removes it.
  A folder without an owner file, or whose process lives, is never removed.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path

TEMPORARY_MARK = ".m2d-tmp-"  # every temporary name the writer makes holds it (tests look for it)
OWNER_SUFFIX = ".owner"
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: temporary files and folders get the mode a plain open() or mkdir would have given

# A temporary path (as given, and absolute) -> the path the user named. A command's own names live in its scope
# until it ends (its error is reported after its temporary files are gone); these are library callers'.
OUTSIDE_COMMANDS: dict[str, Path] = {}


def stand_for(temporary: str | os.PathLike, path: str | os.PathLike, names: dict[str, Path]) -> None:
    """Messages name `path` (and what lies below it) where they would name `temporary`."""
    for key in {str(temporary), str(Path(temporary).absolute())}:
        names[key] = Path(path)


def forget(temporary: str | os.PathLike, names: dict[str, Path]) -> None:
    """`temporary` is gone (moved into place, or removed)."""
    for key in {str(temporary), str(Path(temporary).absolute())}:
        names.pop(key, None)


def user_path(path: str | os.PathLike, names: dict[str, Path]) -> Path:
    """`path` as the user knows it: a temporary path (or a path inside a staging folder) becomes the path it stands
    for; any other path is itself."""
    text = str(path)
    for key in sorted(names, key=len, reverse=True):
        if text == key or text.startswith(key + os.sep):
            return user_path(str(names[key]) + text[len(key) :], names)
    return Path(path)


def user_text(text: str, names: dict[str, Path]) -> str:
    """`text` (a message) with every temporary path it names replaced by the path that path stands for."""
    for key in sorted(names, key=len, reverse=True):
        if key in text:
            text = text.replace(key, str(user_path(key, names)))
    return text


def is_writer_temporary(path: str | os.PathLike) -> bool:
    """Whether `path` is, or lies inside, a temporary name the writer made."""
    return any(TEMPORARY_MARK in part for part in Path(path).parts)


# ---- owners of staging folders ---------------------------------------------------------------------------------------


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """When process `pid` started (its start time in clock ticks since boot, /proc/PID/stat's 22nd field), so that
    a process id reused by another process is not taken for the owner; None where the system does not say."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    """Which process ids this process sees (containers on one machine may share a folder but not their ids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _owner() -> dict:
    pid = os.getpid()
    place = {"boot": _boot_id(), "host": socket.gethostname(), "pid_namespace": _pid_namespace()}
    return {"pid": pid, "started": _started(pid), **place}


def _alive(owner: dict) -> bool:
    """Whether the process that wrote `owner` may still be building its folder (when in doubt, it may)."""
    if owner.get("host") != socket.gethostname() or owner.get("pid_namespace") != _pid_namespace():
        return True  # another machine's (or container's) process, on a shared file system: nothing here can tell
    if owner.get("boot") is not None and owner.get("boot") != _boot_id():
        return False  # the machine restarted since
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    started = _started(pid)
    return started is None or owner.get("started") in (None, started)


def new_staging_folder(parent: Path, name: str) -> Path:
    """Make `parent/.NAME.m2d-tmp-XXXX`, empty, with its owner file beside it (written first: a kill in between
    leaves an owner file without a folder, which `stale` finds too)."""
    while True:
        folder = parent / f".{name}{TEMPORARY_MARK}{secrets.token_hex(4)}"
        owner = folder.with_name(folder.name + OWNER_SUFFIX)
        try:
            fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**_owner(), "folder": folder.name}, f)
        try:
            folder.mkdir(mode=0o777 & ~_UMASK)
        except FileExistsError:
            owner.unlink()
            continue
        except OSError:
            owner.unlink()
            raise
        return folder


def owner_file(folder: Path) -> Path:
    return folder.with_name(folder.name + OWNER_SUFFIX)


def stale(parent: Path) -> list[tuple[Path, Path]]:
    """(folder, owner file) of every staging folder in `parent` whose owner file is the writer's (its name, a
    regular file naming the folder beside it) and whose process is gone: what a killed command left."""
    found = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    for entry in entries:
        if TEMPORARY_MARK not in entry.name or not entry.name.endswith(OWNER_SUFFIX):
            continue
        if not entry.is_file(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_size > 4096:
            continue
        try:
            owner = json.loads(Path(entry.path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        folder = Path(entry.path[: -len(OWNER_SUFFIX)])
        if not isinstance(owner, dict) or owner.get("folder") != folder.name or _alive(owner):
            continue
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            continue  # not a folder the writer made: left alone
        found.append((folder, Path(entry.path)))
    return found


__all__ = [
    "OUTSIDE_COMMANDS",
    "TEMPORARY_MARK",
    "forget",
    "is_writer_temporary",
    "new_staging_folder",
    "owner_file",
    "stale",
    "stand_for",
    "user_path",
    "user_text",
]
