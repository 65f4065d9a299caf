"""Where shared data lives: a path the user gives, else $MATRYOSHKA2D_DATA, else ../shared/data."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir(user: str | os.PathLike | None = None) -> Path:
    """Resolve the data directory; the error names every place that was tried."""
    tried = []
    candidates = [user] if user else [os.environ.get("MATRYOSHKA2D_DATA"), Path.cwd().parent / "shared" / "data"]
    candidates.append(Path(__file__).resolve().parents[3] / "shared" / "data")  # a checkout next to shared/
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        if path.is_dir():
            return path
        tried.append(str(path))
        if user:
            break
    raise FileNotFoundError(
        f"Data directory not found (tried {', '.join(tried)}); set MATRYOSHKA2D_DATA, or pass --data-dir to the "
        "commands that have it (eval, demo)"
    )


def sts_file(name: str, variant: str = "raw") -> Path:
    """One file of the shared STS data, e.g. sts_file("stsb_dev.tsv")."""
    return data_dir() / "sts" / variant / name


def sts_dev_file() -> Path:
    """STS-B dev: the only STS data a training run may use (for its dev score); the default --eval-file."""
    return sts_file("stsb_dev.tsv")
