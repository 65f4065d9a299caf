"""Ends what is left of a local Ray instance once the build that started it is gone, even by `kill -9`.

Ray ties its head processes (GCS, raylet) to the process that started them, but its agents (dashboard and
runtime-env) and workers are the raylet's children: when it dies the agents report to the GCS, which is gone too,
and retry for 1-2 minutes before they exit. `watch` starts this file as a small process of its own (its own
session, so a Ctrl-C of the build does not stop it; stdlib only, so it loads no torch) that notes every process
descended from the build, every POLL_S seconds, and holds the read end of a pipe from the build. The pipe closes
when the build ends, however it ends; the watchdog then notes, once more, what the noted processes that still
run have started since its last look, kills every process it noted that still runs (the same pid and start time:
a reused pid is left alone), and exits. Ray's processes name neither the build nor the node
in a way that lasts (they rewrite their command lines), so descent is what is followed. Linux only (it reads
/proc); elsewhere nothing is started.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PROC = Path("/proc")
POLL_S = 0.5


def watch() -> subprocess.Popen | None:
    """Start the watchdog of this process's descendants; it has noted those that run now when this returns.
    Close its stdin (or end this process) to set it off."""
    if not (PROC / "self" / "stat").exists():
        return None
    command = [sys.executable, "-I", str(Path(__file__)), str(os.getpid())]
    dog = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    dog.stdout.read(1)  # its first look is taken
    dog.stdout.close()
    return dog


def _started(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a process, from /proc/<pid>/stat; None when it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[1]), fields[19]) if fields[0] != "Z" else None


def _still_runs(pid: int, start: str) -> bool:
    """The process noted with this start time runs yet (not another one that reuses its pid)."""
    return (_started(pid) or (0, None))[1] == start


def descendants(*roots: int) -> dict[int, str]:
    """pid -> start time of every running process descended from one of `roots` (one pass over /proc)."""
    children, start = defaultdict(list), {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (known := _started(int(entry.name))) is not None:
            children[known[0]].append(int(entry.name))
            start[int(entry.name)] = known[1]
    found, stack = {}, list(roots)
    while stack:
        for child in children[stack.pop()]:
            if child not in found:
                found[child] = start[child]
                stack.append(child)
    return found


def main(argv: list[str]) -> None:
    parent = int(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seen = descendants(parent)
    sys.stdout.write("w")
    sys.stdout.close()
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], POLL_S)
        if readable and not os.read(stdin, 1 << 16):  # the build's end of the pipe is closed
            break
        seen.update(descendants(parent))
    # A process that a noted one started since the last look is still its child (only the build is gone):
    # one last look from every noted process that still runs catches it without waiting for the next poll.
    seen.update(descendants(*(pid for pid, start in seen.items() if _still_runs(pid, start))))
    for pid, start in seen.items():
        if pid != os.getpid() and _still_runs(pid, start):
            with contextlib.suppress(OSError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
