"""What every benchmark prints first: the machine, the software and the exact command."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

# As matryoshka2d.paths finds it: MATRYOSHKA2D_DATA if set, else shared/data beside the checkout.
DEFAULT_DATA = Path(
    os.environ.get("MATRYOSHKA2D_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)


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
