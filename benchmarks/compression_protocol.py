"""The compression protocol (issue 5): the dimensionality paper's Table 3 and the Starbucks SMAE ablation, for
minilm-l6 on the shared NLI data.

    python benchmarks/compression_protocol.py [--steps N] [--out runs/compression] [--data-dir ../shared/data]
    python benchmarks/compression_protocol.py --steps 50 --dry-run      # print the commands only

Part A, for each loss of the dimensionality paper (--losses; sec. 5 and Tables 1-3):
  simcse   unsupervised SimCSE on the sentences of nli/train_triplets.tsv;
  softmax  Sentence-BERT's softmax classifier on the 3-way NLI pairs (nli/*_pairs.tsv, RTE's 2-way set left out);
the STS 7-set average (STS12-16, STS-B, SICK-R; Spearman x 100) at d = 128, 64, 32, 16, 8 (--dims) of
  end-to-end    the model trained with a D -> d tanh pooler (two-step's line-2 run),
  two-step      Algorithm 1: best encoder among the candidate pooler sizes + the d pooler fine-tuned on it,
  pca / isomap / lle   the model trained without a pooler (`plain`, full width), reduced after the fact by a
                reducer fitted on the first 2,000 distinct training sentences,
  truncation    that same model, first d numbers.
Part B (Starbucks Table 1 and Figure 5): SRL fine-tuning (`--method starbucks`, AnglE loss on the NLI triplets,
as benchmarks/train_protocol.sh) from minilm-l6 and from an SMAE pre-trained minilm-l6 (corpus: the NLI
triplet sentences and the classification *training* sentences), scored at every Starbucks size and averaged.

--steps N caps every training run at N optimizer steps (default: one epoch each, a long run on a CPU), and
--pretrain-steps the SMAE run (default: --steps). Finished parts are reused and killed training runs resume,
so the script can be stopped and started again. The tables go to stdout and OUT/compression_report.md/.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from common import DEFAULT_DATA, header
from matryoshka2d.result_files import read_result_record

BIN = Path(sys.executable).parent / "matryoshka2d"
CANDIDATES = "384,256,128,64,32,16,8"  # D and the halvings down to 8, as the paper's Figure 4 range
STARBUCKS_SIZES = [(1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 384)]  # default_sizes(6, 384)
PRETRAIN_FILES = ["nli/train_triplets.tsv", "classification/sst2_train.tsv", "classification/trec_train.tsv"]
PRETRAIN_FILES += ["classification/mrpc_train.tsv"]


class Runner:
    def __init__(self, dry_run: bool):
        self.dry_run = dry_run

    def __call__(self, args: list[str], done: Path) -> None:
        """Run a command unless `done` exists (a finished result); training commands resume by themselves."""
        if done.exists():
            print(f"== done already: {done}", flush=True)
            return
        print("== " + " ".join(shlex.quote(str(a)) for a in args), flush=True)
        if not self.dry_run:
            subprocess.run([str(a) for a in args], check=True)


def training_data(data: Path, loss: str) -> list[str]:
    if loss == "simcse":
        return [str(data / "nli" / "train_triplets.tsv")]
    pairs = sorted(p for p in (data / "nli").glob("*_pairs.tsv") if not p.name.startswith("rte_"))
    return [str(p) for p in pairs]


def sts(run: Runner, model: Path | str, out: Path, data: Path, layers: str, dims: str, extra=()) -> Path:
    args = [BIN, "eval", "sts", "--model", model, "--data-dir", data, "--layers", layers, "--dims", dims]
    run([*args, *extra, "--output", out, "--quiet"], out / "results.json")
    return out / "results.json"


def averages(results: Path) -> dict[tuple[int, int], float]:
    if not results.is_file():
        return {}
    average = read_result_record(results, kinds=("grid",))[2]["average"]  # the one reader of result files (rule 6)
    return {(r["layer"], r["dim"]): r["spearman"] for r in average}


def part_a(run: Runner, loss: str, args, data: Path, dims: list[int]) -> dict:
    root = args.out / loss
    files = training_data(data, loss)
    common = ["--batch-size", args.batch_size, "--seed", args.seed] + (["--steps", args.steps] if args.steps else [])
    dims_text = ",".join(map(str, dims))
    # The paper's baseline: the model trained at full width without a pooler (for truncation and the reducers).
    full = root / "full"
    train = [BIN, "train", "--model", "minilm-l6", "--method", "plain", "--loss", loss, "--data", *files]
    run([*train, *common, "--output", full, "--resume"], full / "matryoshka2d.json")
    two = root / "two-step"
    cmd = [BIN, "two-step", "--model", "minilm-l6", "--target-dim", dims_text, "--candidate-dims", args.candidates]
    cmd += ["--loss", loss, "--data", *files, *common, "--output", two, "--quiet"]
    run(cmd, two / "two_step.json")

    rows: dict[str, dict[int, float]] = {}
    for name, folder in (("end-to-end", "runs/pooler-{d}"), ("two-step", "two-step-d{d}")):
        rows[name] = {}
        for d in dims:
            model = two / folder.format(d=d)
            result = sts(run, model, root / "sts" / f"{name}-{d}", data, "6", str(d))
            rows[name][d] = averages(result).get((6, d))
    for reducer in args.reducers:
        extra = ["--reducer", reducer]  # fitted on DATA/nli/train_triplets.tsv, the default corpus
        result = sts(run, full, root / "sts" / reducer, data, "6", dims_text, extra)
        rows[reducer] = {d: averages(result).get((6, d)) for d in dims}
    result = sts(run, full, root / "sts" / "truncation", data, "6", dims_text + ",384")
    rows["truncation (first d of the full model)"] = {d: averages(result).get((6, d)) for d in dims}
    rows["full model, 384 dims (reference)"] = {d: averages(result).get((6, 384)) for d in dims}
    two_step_json = two / "two_step.json"
    opt = json.loads(two_step_json.read_text())["opt"] if two_step_json.is_file() else None
    return {"loss": loss, "data": files, "opt": opt, "rows": rows}


def part_b(run: Runner, args, data: Path) -> dict:
    root = args.out / "starbucks"
    common = ["--batch-size", args.batch_size, "--seed", args.seed] + (["--steps", args.steps] if args.steps else [])
    pretrain_steps = args.pretrain_steps or args.steps
    smae = root / "smae"
    cmd = [BIN, "pretrain", "--method", "smae", "--model", "minilm-l6", "--data", *[data / f for f in PRETRAIN_FILES]]
    cmd += ["--batch-size", args.batch_size, "--seed", args.seed, "--output", smae, "--resume", "--quiet"]
    run([*cmd, *(["--steps", pretrain_steps] if pretrain_steps else [])], smae / "matryoshka2d.json")
    triplets = data / "nli" / "train_triplets.tsv"
    rows = {}
    for name, start in (("SRL from minilm-l6", "minilm-l6"), ("SMAE + SRL", smae)):
        out = root / ("srl" if start == "minilm-l6" else "smae-srl")
        train = [BIN, "train", "--model", start, "--method", "starbucks", "--loss", "angle", "--data", triplets]
        run([*train, *common, "--output", out, "--resume"], out / "matryoshka2d.json")
        result = sts(run, out, root / "sts" / out.name, data, "1-6", "32,64,128,256,384")
        avg = averages(result)
        rows[name] = {f"({n},{d})": avg.get((n, d)) for n, d in STARBUCKS_SIZES}
    return {"sizes": [list(s) for s in STARBUCKS_SIZES], "rows": rows}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(parts: list[dict], starbucks: dict | None, dims: list[int], args) -> str:
    lines = [f"steps per training run: {args.steps or 'one epoch'}; batch {args.batch_size}; seed {args.seed}", ""]
    for part in parts:
        lines += [
            f"## STS 7-set average (Spearman x 100), minilm-l6 trained with {part['loss']}, layer 6",
            "",
            f"training data: {', '.join(Path(f).name for f in part['data'])}; two-step opt = {part['opt']}",
            "",
            "| method | " + " | ".join(f"d={d}" for d in dims) + " |",
            "|---|" + "---:|" * len(dims),
        ]
        for name, values in part["rows"].items():
            lines.append(f"| {name} | " + " | ".join(fmt(values.get(d)) for d in dims) + " |")
        lines.append("")
    if starbucks:
        sizes = [f"({n},{d})" for n, d in starbucks["sizes"]]
        lines += [
            "## STS 7-set average at the Starbucks sizes (layer, dim), SRL with and without SMAE pre-training",
            "",
            "| model | " + " | ".join(sizes) + " | mean |",
            "|---|" + "---:|" * (len(sizes) + 1),
        ]
        for name, values in starbucks["rows"].items():
            known = [values[s] for s in sizes if values.get(s) is not None]
            mean = sum(known) / len(known) if len(known) == len(sizes) else None
            lines.append(f"| {name} | " + " | ".join(fmt(values.get(s)) for s in sizes) + f" | {fmt(mean)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="optimizer steps of every training run (default: one epoch)")
    parser.add_argument("--pretrain-steps", type=int, help="steps of the SMAE pre-training (default: --steps)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path("runs/compression"))
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--losses", default="simcse,softmax", help="part A losses (comma list; '' to skip)")
    parser.add_argument("--dims", default="128,64,32,16,8")
    parser.add_argument("--candidates", default=CANDIDATES, help="two-step candidate pooler sizes")
    parser.add_argument("--reducers", default="pca,isomap,lle")
    parser.add_argument("--skip-starbucks", action="store_true", help="leave out part B")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    args.reducers = [r for r in args.reducers.split(",") if r]
    dims = [int(d) for d in args.dims.split(",") if d]
    print(header(), flush=True)
    run = Runner(args.dry_run)
    data = args.data_dir.resolve()
    parts = [part_a(run, loss, args, data, dims) for loss in args.losses.split(",") if loss]
    starbucks = None if args.skip_starbucks else part_b(run, args, data)
    text = report(parts, starbucks, dims, args)
    print("\n" + text)
    if not args.dry_run:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compression_report.md").write_text(header() + "\n\n" + text)
        summary = {"parts": parts, "starbucks": starbucks, "steps": args.steps, "batch_size": args.batch_size}
        (args.out / "compression_report.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
