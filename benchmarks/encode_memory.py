"""Peak memory (RSS) of `matryoshka2d encode` on N input lines: the streaming command against the in-memory way
(read every line, encode them all, then numpy.save), each in its own child process, side by side.

    OMP_NUM_THREADS=1 python benchmarks/encode_memory.py --lines 5000 20000 --model minilm-l6

The lines are distinct sentences of the shared NLI training triplets (anchor, positive, negative columns in file
order; past the file's 37,730 distinct sentences they repeat with " (2)", " (3)", ... appended), so
deduplication does not shrink the work. Peak RSS is the child's ru_maxrss (os.wait4), in MB.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DEFAULT_DATA, checkout_env, header

IN_MEMORY = """
import sys, numpy as np, torch
torch.set_num_threads(1)
from matryoshka2d.models.encoder import ElasticEncoder
texts = open(sys.argv[1], encoding="utf-8").read().split("\\n")[:-1]
np.save(sys.argv[2], ElasticEncoder(sys.argv[3], device="cpu").encode(texts, batch_size=64))
"""


def sentences(data_dir: Path, n: int) -> list[str]:
    """N distinct lines: the file's distinct sentences in order, then again with " (2)", " (3)", ... appended."""
    seen: dict[str, None] = {}
    with (data_dir / "nli" / "train_triplets.tsv").open(encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(rows)
        for row in rows:
            seen.update(dict.fromkeys(t.replace("\n", " ") for t in row[:3]))
            if len(seen) >= n:
                break
    base = list(seen)
    return [base[i % len(base)] + (f" ({i // len(base) + 1})" if i >= len(base) else "") for i in range(n)]


def run(command: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one child process."""
    env = checkout_env()
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    err = child.stderr.read().decode()
    child.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:  # a negative code is the signal that ended it (e.g. -9: killed from outside)
        raise SystemExit(f"{' '.join(command)} failed with exit code {code}:\n{err[-2000:]}")
    return seconds, usage.ru_maxrss / 1024  # Linux reports KB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, nargs="+", default=[5000, 20000])
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--modes", nargs="+", choices=["stream", "in-memory"], default=["stream", "in-memory"])
    args = parser.parse_args()
    print(header())
    print(f"model: {args.model}; input: distinct sentences of {args.data_dir / 'nli' / 'train_triplets.tsv'}")
    print(f"{'lines':>8} {'mode':>10} {'seconds':>9} {'peak RSS MB':>12} {'KB/line':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lines:
            src = Path(tmp) / f"in-{n}.txt"
            src.write_text("\n".join(sentences(args.data_dir, n)) + "\n", encoding="utf-8")
            for mode in args.modes:
                out = Path(tmp) / f"out-{mode}-{n}.npy"
                if mode == "stream":
                    command = [sys.executable, "-m", "matryoshka2d.cli", "encode", "--model", args.model]
                    command += ["--device", "cpu", "--input", str(src), "--output", str(out)]
                else:
                    command = [sys.executable, "-c", IN_MEMORY, str(src), str(out), args.model]
                seconds, rss = run(command)
                print(f"{n:>8} {mode:>10} {seconds:>9.1f} {rss:>12.0f} {rss * 1024 / n:>8.2f}", flush=True)
                out.unlink()


if __name__ == "__main__":
    main()
