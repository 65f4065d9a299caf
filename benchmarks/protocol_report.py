"""Score every model of the training protocol on the STS grid and print the comparison table.

    python benchmarks/protocol_report.py [--runs runs/protocol] [--data-dir ../shared/data]

For RAW (untouched minilm-l6) and each trained folder under --runs, runs `matryoshka2d eval sts` once
(results cached in <run>/sts/results.json) and prints: the 7-set average at the last layer and full width,
the shallow average (ESE's ≺Avg: layers 1..N-1 at full width) and the cells (1,64), (2,128), (3,128), (5,384),
(6,64). A model folder with exit heads is scored through them (`eval sts` uses a folder's heads).
A separately trained model has only its own layers, so it reports only the cells it has.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import DEFAULT_DATA, header
from matryoshka2d.result_files import read_result_record

CELLS = [(1, 64), (2, 128), (3, 128), (5, 384), (6, 64)]
ORDER = [
    "raw",
    "plain",
    "plain-old-angle",
    "mrl",
    "2dmse",
    "2dmse-infonce",
    "2dmse-paper",
    "2dmse-angle-0.3",
    "2dmse-authors",
    "2dmse-dedup",
    "2dmse-wd-exempt",
    "2dmse-heads",
    "st-matryoshka2d",
    "st-matryoshka2d-seed43",
    "st-recipe",
    "ese",
    "ese-heads",
    "ese-paper",
    "ese-compress-scaled",
    "ese-compress-paper",
    "ese-angle-emb",
    "angle-emb-ese",
    "starbucks",
    "starbucks-paper",
    "st-ese",
    "st-starbucks",
    "st-2dmse",
    "st-st-matryoshka2d",
    "starbucks-heads",
    "separate-1-64",
    "separate-2-128",
    "separate-3-128",
    "separate-3-128-heads",
]


def scored(model: str, out: Path, data_dir: Path) -> dict:
    results = out / "results.json"
    if not results.is_file():
        cmd = [
            str(Path(sys.executable).parent / "matryoshka2d"),
            "eval",
            "sts",
            "--model",
            model,
            "--data-dir",
            str(data_dir),
            "--output",
            str(out),
            "--quiet",
        ]
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return read_result_record(results, kinds=("grid",))[2]  # the one reader of result files (rule 6)


def describe(run: Path) -> str:
    meta_file = run / "matryoshka2d.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        heads = ", exit heads" if (run / "exit_heads.safetensors").is_file() else ""
        return f"{meta['method']['method']} + {meta['loss']}, {meta['steps']} steps{heads}"
    peer = run / "peer_run.json"
    if peer.is_file():
        info = json.loads(peer.read_text())
        return f"{info['peer']}, {info['steps']} steps"
    st_run = run / "st_run.json"  # benchmarks/st_trainer_protocol.py: our loss in sentence-transformers' trainer
    if st_run.is_file():
        info = json.loads(st_run.read_text())
        return f"SentenceTransformerTrainer + {info['loss']} loss (matryoshka2d.st_losses), {info['steps']} steps"
    return "untouched backbone"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs/protocol"))
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--also", nargs="*", default=[], metavar="NAME=DIR", help="more trained folders to score")
    args = parser.parse_args()
    print(header())
    runs = {"raw": ("minilm-l6", args.runs / "raw")}
    records = ("matryoshka2d.json", "peer_run.json", "st_run.json")
    found = [p for p in sorted(args.runs.iterdir()) if any((p / record).is_file() for record in records)]
    found.sort(key=lambda p: ORDER.index(p.name) if p.name in ORDER else len(ORDER))
    for run in found:
        runs[run.name] = (str(run), run)
    for item in args.also:
        name, _, folder = item.partition("=")
        runs[name] = (folder, Path(folder))
    rows = []
    for name, (model, run) in runs.items():
        result = scored(model, run / "sts", args.data_dir)
        avg = {(r["layer"], r["dim"]): r["spearman"] for r in result["average"]}
        summary = result["summary"]
        last = max(n for n, _ in avg)
        full = (last, max(d for _, d in avg))
        rows.append(
            (
                name,
                describe(run),
                avg.get(full) if last == 6 else None,
                summary.get("shallow_average") if last == 6 else None,
                [avg.get(c) for c in CELLS],
            )
        )
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(
        "\n| model | training | avg (6,384) | shallow avg (1-5, 384) | "
        + " | ".join(f"({n},{d})" for n, d in CELLS)
        + " |"
    )
    print("|---|---|---:|---:|" + "---:|" * len(CELLS))
    for name, what, full, shallow, cells in rows:
        print(f"| {name} | {what} | {fmt(full)} | {fmt(shallow)} | " + " | ".join(fmt(v) for v in cells) + " |")


if __name__ == "__main__":
    main()
