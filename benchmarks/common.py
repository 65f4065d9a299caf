"""What every benchmark prints first: the machine, the software and the exact command."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

# As matryoshka2d.paths finds it: MATRYOSHKA2D_DATA if set, else shared/data beside the checkout.
DEFAULT_DATA = Path(
    os.environ.get("MATRYOSHKA2D_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)


CHECKOUT = Path(__file__).resolve().parents[1]
CHECKOUT_SRC = CHECKOUT / "src"
# Where a benchmark writes what it keeps by default (servers' logs, cached vectors): runs/ of the checkout, which
# .gitignore leaves out.
CHECKOUT_RUNS = CHECKOUT / "runs"


def checkout_env(src: Path | str | None = None) -> dict:
    """The environment of a child process that runs this checkout's matryoshka2d (or the one in `src`, a source
    tree such as a worktree of an older commit) with one thread per library (an installed copy of another version
    comes after it on the path)."""
    first = str(src if src is not None else CHECKOUT_SRC)
    path = os.pathsep.join(p for p in (first, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB, NaN once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def stop_process(process: subprocess.Popen, grace_s: float = 30) -> int:
    """SIGTERM, then SIGKILL after `grace_s` seconds; the exit code (negative: the signal that ended it)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def header() -> str:
    import torch
    import transformers

    lines = [
        f"date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}",
        "command: " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    ]
    return "\n".join(lines)


def sts_sentences(data_dir: Path, limit: int) -> list[str]:
    """The first `limit` distinct sentences of the STS-B test and dev sets (raw text)."""
    seen: dict[str, None] = {}
    for name in ("stsb_test.tsv", "stsb_dev.tsv", "sickr_test.tsv"):
        with (data_dir / "sts" / "raw" / name).open(encoding="utf-8") as f:
            rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            next(rows)
            for row in rows:
                seen.update(dict.fromkeys(row[:2]))
                if len(seen) >= limit:
                    return list(seen)[:limit]
    return list(seen)


def to_device(features: dict, device: str) -> dict:
    """sentence-transformers' tokenize() output with its tensors on `device` (other entries left as they are)."""
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in features.items()}
