"""Peer run: ESE trained by its authors' own code (angle-emb 0.6.1, AnglE.fit(apply_ese=True)).

    ANGLE_VENV/bin/python benchmarks/peer_angle_ese.py --model-dir MINILM_FOLDER \\
        --data ../shared/data/nli/train_triplets.tsv --output runs/protocol-cpu150/angle-emb-ese
        [--steps N] [--batch-size 32] [--lr 5e-5] [--seed 42] [--warmup-ratio 0.1]

ANGLE_VENV: a virtualenv of its own, made with `python3.11 -m venv ANGLE_VENV && ANGLE_VENV/bin/pip install
torch==2.13.0 && ANGLE_VENV/bin/pip install angle-emb==0.6.1` (docs/reproduction.md).

Runs in its own virtualenv (angle-emb 0.6.1 pins transformers 5.3.0 and peft 0.18.1), so it does not import
matryoshka2d: the backbone folder is given with --model-dir (`matryoshka2d.models.backbones.minilm_dir()`, the local
all-MiniLM-L6-v2). The reference row for our `ese` method.

What angle-emb is asked to do, exactly:

    angle = AnglE(MODEL_DIR, pooling_strategy="avg")          # mean pooling; max_length left at 512
    angle.fit(
        train_ds,                                             # datasets.Dataset, columns query/positive/negative
        batch_size=32, learning_rate=5e-5, warmup_steps=int(0.1 * steps), output_dir=OUTPUT,
        save_strategy="no",                                   # no checkpoint-N folders inside OUTPUT
        apply_ese=True,                                       # -> AngleESETrainer
        trainer_kwargs={"ese_compression_size": 128, "ese_kl_temperature": 1.0},   # = its defaults
        argument_kwargs={"max_steps": steps, "seed": 42, "report_to": "none"},
    )

Everything else is angle-emb's (or its TrainingArguments') default: AngleLoss for format C triplets
(cosine_w 0, ibn_w 1, cln_w 1, angle_w 0.02, taus 20), apply_ese_pca True, filter_duplicate True,
padding 'longest', epochs 1 (max_steps overrides), logging_steps 10, HF defaults for the optimizer
(adamw_torch_fused, weight decay 0.0, betas 0.9/0.999, eps 1e-8), linear schedule, max_grad_norm 1.0.

What differs from our trainer (`matryoshka2d train --method ese --loss angle`, same data, steps, batch size, lr):
- batch order: HF Trainer's RandomSampler seeded with 42, not our seeded permutation; the batches differ;
- the collator drops a triplet whose anchor, positive or negative tokenizes to ids already seen in the batch
  (filter_duplicate), so some batches have fewer than 32 triplets; our `ese` default keeps every row (the
  `ese-angle-emb` preset filters the same way: `filter_duplicates: true`);
- weight decay 0.0 (HF default) against our default 0.01 (0.0 in the `ese-angle-emb` preset); the rest of the
  optimizer and schedule are alike;
- max length 512 (angle-emb default) against our 256; no NLI sentence here is longer than 141 tokens;
- the shallow layers are angle-emb's: hidden_states[0 .. N-2], i.e. the embedding output and layers 1..N-2
  (layer N-1 not trained on its own), weights 1/(1+ln(1+i)), their sum divided by N-1 (our `ese-angle-emb`
  preset reproduces this; our `ese` defaults follow the paper instead);
- fit() wraps the backbone in torch.compile after building the Trainer, which trains the unwrapped module,
  so nothing is compiled.

Saved into --output: the trained transformers model and tokenizer (save_pretrained), modules.json,
sentence_bert_config.json and 1_Pooling/ copied from --model-dir (mean pooling, for our evaluator), and
peer_run.json, written last. `seconds` is the wall time of the whole fit() call (Trainer set-up, the
training loop and its final save).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import math
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import angle_emb
import datasets
import torch
import transformers
from angle_emb import AnglE

ST_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling", "2_Normalize")


def header() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "\n".join(
        [
            f"date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
            f"machine: {cpu}, {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), angle-emb {angle_emb.__version__}, "
            f"transformers {transformers.__version__}, datasets {datasets.__version__}",
            "command: " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        ]
    )


def read_triplets(path: str) -> dict[str, list[str]]:
    """The TSV (header anchor, positive, negative) as angle-emb's format C columns query, positive, negative."""
    columns: dict[str, list[str]] = {"query": [], "positive": [], "negative": []}
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        head = next(rows)
        if [h.strip().lower() for h in head[:3]] != ["anchor", "positive", "negative"]:
            raise SystemExit(f"{path}: expected a header anchor<TAB>positive<TAB>negative, got {head}")
        for number, row in enumerate(rows, start=2):
            if not row:
                continue
            if len(row) < 3:
                raise SystemExit(f"{path}:{number}: expected 3 columns, got {len(row)}")
            for name, text in zip(columns, row[:3], strict=True):
                columns[name].append(text)
    if not columns["query"]:
        raise SystemExit(f"{path}: no triplets")
    return columns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="the backbone folder (the local all-MiniLM-L6-v2)")
    parser.add_argument("--data", required=True, help="TSV with header anchor, positive, negative")
    parser.add_argument("--output", required=True)
    parser.add_argument("--steps", type=int, help="default: one epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--warmup-ratio", type=float, default=0.1)
    args = parser.parse_args()
    print(header(), flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    model_dir, out = Path(args.model_dir), Path(args.output)
    train_ds = datasets.Dataset.from_dict(read_triplets(args.data))
    steps = args.steps or math.ceil(len(train_ds) / args.batch_size)
    warmup_steps = int(args.warmup_ratio * steps)
    print(f"{len(train_ds)} triplets, {steps} steps of {args.batch_size}, warm-up {warmup_steps} steps", flush=True)

    transformers.set_seed(args.seed)
    angle = AnglE(str(model_dir), pooling_strategy="avg")
    start = time.perf_counter()
    angle.fit(
        train_ds,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=warmup_steps,
        output_dir=str(out),
        save_strategy="no",
        apply_ese=True,
        trainer_kwargs={"ese_compression_size": 128, "ese_kl_temperature": 1.0},
        argument_kwargs={"max_steps": steps, "seed": args.seed, "report_to": "none"},
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    # the trained module itself (fit() leaves angle.backbone wrapped in torch.compile; the pooler holds the original)
    model = angle.pooler.model
    model.save_pretrained(str(out))
    angle.tokenizer.save_pretrained(str(out))
    for name in ST_FILES:
        source = model_dir / name
        if source.is_dir():
            shutil.copytree(source, out / name, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy2(source, out / name)
    summary = {
        "peer": "angle-emb 0.6.1 AnglE.fit(apply_ese=True), ESE defaults",
        "steps": steps,
        "batch_size": args.batch_size,
        "device": str(next(model.parameters()).device),
        "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / steps, 4),
    }
    (out / "peer_run.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
