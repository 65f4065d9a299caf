"""Processes the tests start and watch (Linux: /proc)."""

import os
import time
from pathlib import Path


def idle(argv: list[str]) -> int:
    """A stand-in for the command in a worker of `train --processes`: write this process's pid, then wait to be
    stopped."""
    folder = Path(argv[0])
    (folder / f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
