"""What the file system says about a place the one writer is asked to write: which folder a path is whatever name
it goes by (device and inode, so a bind mount or any second name of a folder is the folder), what kind of thing
stands there (a device, a pipe, standard output), which folders are mount points, whether a folder takes new files
that can be renamed and removed (append-only and immutable flags, a read-only mount, a full file system), and
whether an error raised while writing is the storage refusing (a full disk, a file too large, a quota).

Nothing here writes; `matryoshka2d.outputs` decides what to refuse.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
import sys
from pathlib import Path

Identity = tuple[int, int]  # (st_dev, st_ino): one file or folder whatever name it is reached by

# The errors a write meets when the storage, not the data, refuses it. A full disk, a quota and a size limit are
# always about the output; the others are when they name the file being written (or name none).
STORAGE_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
STORAGE_REFUSED = (*STORAGE_FULL, errno.EROFS, errno.EIO, errno.EPERM, errno.EACCES)

# FS_IOC_GETFLAGS is _IOR('f', 1, long) in linux/fs.h: read direction (2) in bits 30-31, the argument's size in
# bits 16-29, the type 'f' and number 1 below; the flags are FS_IMMUTABLE_FL and FS_APPEND_FL of the same header.
_FS_IOC_GETFLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
_FLAGS = {0x00000010: "immutable (chattr +i)", 0x00000020: "append-only (chattr +a)"}


def identity(path: str | os.PathLike) -> Identity | None:
    """(device, inode) of what `path` leads to, links followed; None when nothing is there."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def chain(path: Path) -> list[Identity]:
    """The identities of `path` (when it exists) and of every folder above it: a folder seen under another name
    (a bind mount of it or of a folder above it) is found in the chain whatever its path."""
    found = []
    for step in (path, *path.parents):
        if (ident := identity(step)) is not None:
            found.append(ident)
    return found


_STANDARD = {0: "standard input", 1: "standard output", 2: "standard error"}
_DESCRIPTOR = re.compile(r"/(?:proc/(?:self|thread-self|\d+)(?:/task/\d+)?|dev)/fd/(\d+)")


def descriptor(path: str | os.PathLike) -> int | None:
    """The file descriptor `path` names, directly or through its links (`/dev/stdout` -> `/proc/self/fd/1`,
    `/dev/fd/2`), or None: such a path is an open file of a process, whatever it leads to (a terminal, a pipe, a
    file the shell redirected into), never a place to put a file."""
    hop = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit of links followed in one path
        if (match := _DESCRIPTOR.fullmatch(hop)) is not None:
            return int(match[1])
        if not os.path.islink(hop):
            return None
        hop = os.path.normpath(os.path.join(os.path.dirname(hop), os.readlink(hop)))
    return None


def kind_of(path: str | os.PathLike) -> str | None:
    """What stands at `path`, links followed, when it is neither a regular file nor a folder (nor nothing): a file
    descriptor (`/dev/stdout`), a character device, a pipe, a socket, a block device; said to be the command's
    standard output or error when it is (a terminal, `/dev/pts/0`)."""
    if (fd := descriptor(path)) is not None:
        standard = f": the command's {_STANDARD[fd]}" if fd in _STANDARD else ""
        return f"an open file descriptor ({fd}{standard})"
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    kinds = (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISFIFO, "a pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISBLK, "a block device"),
    )
    what = next((name for test, name in kinds if test(st.st_mode)), "not a regular file")
    for fd, name in ((1, "standard output"), (2, "standard error")):
        try:
            std = os.fstat(fd)
        except OSError:
            continue
        if (std.st_dev, std.st_ino) == (st.st_dev, st.st_ino):
            return f"{what}: the command's {name}"
    return what


def mount_points() -> list[Path]:
    """Every mount point of this process's view (/proc/self/mountinfo: bind mounts included, which the device
    number alone does not show); empty where the system does not say."""
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:  # the fifth field is the mount point, with space, tab, newline and \ escaped in octal
            found.append(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])))
    return found


def mounts_at_or_below(folder: Path) -> list[Path]:
    """The mount points that are `folder` (links resolved) or lie inside it."""
    real = folder.resolve()
    return [m for m in mount_points() if m.is_relative_to(real)]


def folder_flags(folder: str | os.PathLike) -> list[str]:
    """The inode flags of `folder` that stop the writer (it makes a temporary file and renames it; an immutable
    folder takes nothing, an append-only one takes files that can never be renamed or removed); empty where the
    file system keeps no such flags."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return []
    try:
        import fcntl

        raw = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(struct.calcsize("l")))
    except (OSError, ImportError):
        return []
    finally:
        os.close(fd)
    flags = int.from_bytes(raw[:4], sys.byteorder)
    return [name for bit, name in _FLAGS.items() if flags & bit]


def space_problem(folder: str | os.PathLike) -> str | None:
    """Why `folder`'s file system takes no new data, or None: read-only, no byte free (root may use the blocks
    kept for it), no file slot free."""
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return None
    if vfs.f_flag & getattr(os, "ST_RDONLY", 1):
        return os.strerror(errno.EROFS)
    free = vfs.f_bfree if os.geteuid() == 0 else vfs.f_bavail
    if vfs.f_blocks and free == 0:
        return f"{os.strerror(errno.ENOSPC)}: its file system is full"
    if vfs.f_files and vfs.f_favail == 0:
        return f"{os.strerror(errno.ENOSPC)}: its file system has no free inode"
    return None


def storage_failure(exc: BaseException, ours=lambda path: True) -> str | None:
    """What the storage refused, when `exc` is a write meeting a full disk, a size limit, a quota, a read-only or
    failing disk, or a refusal to create or rename (`[Errno 28]`, safetensors' `SafetensorError: ... No space left
    on device (os error 28)`, a C++ writer's text); None otherwise. An OSError naming a file that `ours(path)` does
    not claim (an input read) is not a write failure."""
    if isinstance(exc, OSError) and exc.errno is not None:
        named = [f for f in (exc.filename, exc.filename2) if f is not None]
        if exc.errno in STORAGE_FULL or (exc.errno in STORAGE_REFUSED and all(ours(f) for f in named)):
            return exc.strerror or os.strerror(exc.errno)
        return None
    text = str(exc)
    return next((os.strerror(code) for code in STORAGE_FULL if os.strerror(code) in text), None)


__all__ = [
    "STORAGE_FULL",
    "chain",
    "descriptor",
    "folder_flags",
    "identity",
    "kind_of",
    "mount_points",
    "mounts_at_or_below",
    "space_problem",
    "storage_failure",
]
