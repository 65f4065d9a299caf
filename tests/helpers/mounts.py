"""Folders as a user may find them, made for real where the tests run as root: a second name of a folder (a bind
mount), a folder that refuses the writer (immutable, append-only, on a full file system). Each is undone when the
block ends; where it cannot be made (not root, no `mount` or `chattr`), the test is skipped with the reason."""

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def _run(*command) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True)


def _needs(tool: str, why: str) -> None:
    if os.geteuid() != 0 or shutil.which(tool) is None:
        pytest.skip(f"{why} needs root and `{tool}`")


@contextlib.contextmanager
def bind_mount(source: Path, target: Path):
    """`target` becomes a second name of the folder `source` (mount --bind): the same folder, with another path
    and no link anywhere (Path.resolve keeps the two apart)."""
    _needs("mount", "a bind mount")
    target.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "--bind", source, target)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        if _run("umount", target).returncode != 0:
            _run("umount", "-l", target)


@contextlib.contextmanager
def chattr(folder: Path, flag: str):
    """`folder` with the inode flag `flag` ('i' immutable, 'a' append-only), which root's writes obey too."""
    _needs("chattr", f"chattr +{flag}")
    done = _run("chattr", f"+{flag}", folder)
    if done.returncode != 0:
        pytest.skip(f"chattr +{flag} is not supported here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        _run("chattr", f"-{flag}", folder)


@contextlib.contextmanager
def small_file_system(folder: Path, size: str = "1m"):
    """`folder` as the mount point of a new tmpfs of `size` bytes (a small disk a write can fill)."""
    _needs("mount", "a small file system")
    folder.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        if _run("umount", folder).returncode != 0:
            _run("umount", "-l", folder)


def fill(folder: Path, name: str = "filler") -> Path:
    """Write zeros into `folder/name` until its file system has no byte left."""
    path = folder / name
    block = bytes(64 * 1024)
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    for size in (4096, 512, 1):  # the last partial blocks
        with path.open("ab", buffering=0) as f, contextlib.suppress(OSError):
            while f.write(bytes(size)):
                pass
    return path


@contextlib.contextmanager
def refusing(folder: Path, how: str):
    """`folder` (created, empty) as a folder the writer cannot use: 'immutable' (nothing can be made there),
    'append-only' (files can be made but never renamed or removed) or 'full' (a file system with no byte free;
    it then holds the filler file). Yields what the folder holds when nothing was left in it."""
    folder.mkdir(parents=True, exist_ok=True)
    if how == "immutable" and os.geteuid() != 0:  # permission bits stop a user (not root, whom only chattr stops)
        folder.chmod(0o555)
        try:
            yield []
        finally:
            folder.chmod(0o755)
        return
    if how == "full":
        with small_file_system(folder, "256k"):
            fill(folder)
            yield sorted(os.listdir(folder))
        return
    with chattr(folder, {"immutable": "i", "append-only": "a"}[how]):
        yield []


HOW_A_FOLDER_REFUSES = ("immutable", "append-only", "full")
