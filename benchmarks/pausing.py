"""Other processes of the machine stopped while a span is timed, and always continued after it.

A timed span on a shared machine measures the share of a core the scheduler gave the server; stopping the other
work (SIGSTOP) for the span only, and continuing it (SIGCONT) right after, measures the server. Nothing is stopped
unless a user names what: `python` (every other Python process) or a pkill -f pattern. This process, every process
it started (the servers under test, their workers) and the processes that started it (a shell, `timeout`, whose
command lines hold the pattern too) are never stopped, whatever the pattern matches.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
from contextlib import contextmanager, suppress
from pathlib import Path

EVERY_PYTHON = "python"  # the name a user gives for every other Python process on the machine
SHOWN_COMMAND_CHARS = 100  # of each stopped process's command line, in what is printed


def this_process_line() -> set[int]:
    """This process, its descendants and its ancestors, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    mine, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in mine} - mine
        mine |= more
        grew = bool(more)
    ancestor = parents.get(os.getpid(), 0)
    while ancestor > 1 and ancestor not in mine:
        mine.add(ancestor)
        ancestor = parents.get(ancestor, 0)
    return mine


def command_line(pid: int) -> str:
    """A process's command line as one string ('' once it has exited)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Pause:
    """What `option` names, stopped for each timed span (`with pause.span():`) and continued after it, also on
    errors, SIGINT, SIGTERM and SIGHUP once `guard()` is called. Each time the set of stopped processes changes, it is
    printed: their ids and command lines."""

    def __init__(self, option: str, pattern: str | None = None):
        self.option, self.pattern = option, pattern
        self.stopped: list[int] = []
        self.shown: set[int] | None = None

    def describe(self) -> str:
        """One line for the run's header: what is stopped during timed spans."""
        if not self.pattern:
            return f"{self.option}: not given, no other process is stopped during timed spans"
        if self.pattern == EVERY_PYTHON:
            what = "every other Python process"
        else:
            what = f"the processes `pkill -f {self.pattern!r}` matches"
        return f"{self.option}: {what} stopped during each timed span (this process and its own line excepted)"

    def matching(self) -> dict[int, str]:
        """The processes the pattern names now, by id, with their command lines."""
        mine = this_process_line()
        if self.pattern == EVERY_PYTHON:
            found = []
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) > 1:
                    try:
                        program = (entry / "cmdline").read_bytes().split(b"\0")[0]
                    except OSError:
                        continue
                    if b"python" in program.rsplit(b"/", 1)[-1]:
                        found.append(int(entry.name))
        else:
            listed = subprocess.run(["pgrep", "-f", self.pattern], capture_output=True, text=True, check=False)
            found = [int(pid) for pid in listed.stdout.split()]
        return {pid: command_line(pid) for pid in sorted(found) if pid not in mine and pid > 1}

    def stop(self) -> None:
        if not self.pattern:
            return
        found = self.matching()
        self.show(found)
        self.stopped = list(found)  # before the first signal: an interrupt from here on continues all of them
        for pid in self.stopped:
            with suppress(OSError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        stopped, self.stopped = self.stopped, []
        for pid in stopped:
            with suppress(OSError):
                os.kill(pid, signal.SIGCONT)

    def show(self, found: dict[int, str]) -> None:
        if set(found) == self.shown:
            return
        self.shown = set(found)
        if not found:
            print(f"{self.option} {self.pattern!r}: no process matches; none stopped", flush=True)
            return
        listed = "; ".join(f"{pid} {command[:SHOWN_COMMAND_CHARS]}" for pid, command in found.items())
        print(f"{self.option} {self.pattern!r}: stopping {len(found)} during timed spans: {listed}", flush=True)

    @contextmanager
    def span(self):
        self.stop()
        try:
            yield
        finally:
            self.resume()

    def guard(self) -> None:
        """Continue what is stopped when this process ends: at exit and on SIGINT, SIGTERM and SIGHUP."""
        atexit.register(self.resume)

        def on_signal(signum, _frame):
            self.resume()
            sys.exit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
