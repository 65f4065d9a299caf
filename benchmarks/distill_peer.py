"""Peer run (issue 42, item 4): sentence-transformers' own SentenceTransformerTrainer with its EmbedDistillLoss
(sentence_transformers.sentence_transformer.losses.EmbedDistillLoss, 6.2: embedding matching to precomputed teacher
vectors, the EmbedDistill/LEAF recipe) training the same query encoder as `matryoshka2d distill --mode query`: the
same start (the teacher's first n layers and the same Dense head), the same texts, the same teacher targets, the
same batch size, learning rate, warm-up, schedule, weight decay, clipping and number of steps; both scored the same
way; wall time per step side by side.

    # 0. ours: any `matryoshka2d distill --mode query ... --output RUN` (finished)
    # 1. here: the start, the texts and the targets of RUN, for the peer (no training)
    python benchmarks/distill_peer.py prepare --run RUN --output PREP [--steps N]
    # 2. in a virtualenv with sentence-transformers[train] and WITHOUT matryoshka2d (the peer's own)
    V/bin/python benchmarks/distill_peer.py train --prep PREP --output PEER
    # 3. here: both scored the same way: STS 7-set at (n, width), and SciFact half B against the teacher's index
    python benchmarks/distill_peer.py score --run RUN --peer PEER --dataset-dir HALVES [--split half_b] --output OUT

`prepare` builds matryoshka2d's DistillTrainer on RUN's recorded configuration (so the texts are read, cut and
filtered exactly as the run read them, and the head gets the same closed-form start), saves that start as a
sentence-transformers folder (the first n layers, the head of layer n as a Dense module, Normalize), the texts
(checked against the sha256 the run's targets recorded) and the run's targets, and peer.json with the run's
hyperparameters. `train` loads them with sentence-transformers and `datasets` alone. The loss is the same term:
1 - cos(student, teacher) on the full width (EmbedDistillLoss distance_metric="cosine"; our recipe's loss is `cos`
on the full width too); what differs is everything else the two trainers do (data order, batching, the loop).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np


def prepare(args) -> None:
    from common import header
    from matryoshka2d.training import exit_heads
    from matryoshka2d.training.config import TrainConfig
    from matryoshka2d.training.distill import DistillTrainer
    from matryoshka2d.training.targets import TeacherTargets

    print(header())
    run, out = Path(args.run), Path(args.output)
    record = json.loads((run / "matryoshka2d.json").read_text(encoding="utf-8"))
    distill = record.get("distill") or {}
    if distill.get("mode") != "query":
        raise SystemExit(f"{run}: not a finished `distill --mode query` run (no distill record of mode query)")
    config = TrainConfig.from_dict({**record["training"], "output": str(out / "unused-run-folder")})
    trainer = DistillTrainer(config)  # reads the texts as the run did; the recipe is applied again, identically
    texts = trainer.data.columns[0]
    targets = TeacherTargets(run).load(texts, distill["teacher_weights_sha256"], trainer.encoder.hidden_size)
    exit_heads.fit_at_start(trainer)  # the run's closed-form start (a no-op for --exit-heads identity/keep)
    layer = distill["layer"]
    start = out / "start"
    trainer.encoder.save(start, keep_layers=layer, metadata={"distill": distill})
    (out / "texts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts), encoding="utf-8")
    np.save(out / "targets.npy", np.asarray(targets, dtype=np.float32))
    settings = {
        "steps": args.steps or record["steps"],
        "batch_size": config.batch_size,
        "lr": config.lr,
        "warmup_ratio": config.warmup_ratio,
        "lr_schedule": config.lr_schedule,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "seed": config.seed,
        "layer": layer,
        "width": trainer.encoder.hidden_size,
        "texts": len(texts),
        "run": str(run.resolve()),
    }
    (out / "peer.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    print(
        f"{len(texts)} texts, targets {targets.shape}, start {start} (layer {layer}); settings -> {out / 'peer.json'}"
    )


def train(args) -> None:
    import importlib.util

    if importlib.util.find_spec("matryoshka2d") is not None:
        raise SystemExit("matryoshka2d can be imported here: run the peer in a virtualenv of its own")
    import platform

    import sentence_transformers
    import torch
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import EmbedDistillLoss

    torch.set_num_threads(1)
    prep, out = Path(args.prep), Path(args.output)
    settings = json.loads((prep / "peer.json").read_text(encoding="utf-8"))
    print(
        f"{platform.processor() or platform.machine()}, python {platform.python_version()}, torch {torch.__version__} "
        f"(1 thread), sentence-transformers {sentence_transformers.__version__}; matryoshka2d not importable"
    )
    print("command:", " ".join(sys.argv))
    texts = [json.loads(line) for line in (prep / "texts.jsonl").read_text(encoding="utf-8").splitlines()]
    targets = np.load(prep / "targets.npy")
    data = Dataset.from_dict({"text": texts, "label": targets.tolist()})
    model = SentenceTransformer(str(prep / "start"), device="cpu")
    loss = EmbedDistillLoss(model, distance_metric="cosine")
    schedule = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}[settings["lr_schedule"]]
    training = SentenceTransformerTrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=settings["steps"],
        per_device_train_batch_size=settings["batch_size"],
        learning_rate=settings["lr"],
        warmup_ratio=settings["warmup_ratio"],
        lr_scheduler_type=schedule,
        weight_decay=settings["weight_decay"],
        max_grad_norm=settings["max_grad_norm"],
        seed=settings["seed"],
        logging_steps=max(1, settings["steps"] // 20),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=args.quiet,
    )
    trainer = SentenceTransformerTrainer(model=model, args=training, train_dataset=data, loss=loss)
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    model.save(str(out))
    meta = json.loads((prep / "start" / "matryoshka2d.json").read_text(encoding="utf-8"))
    meta["distill"] = {
        **meta["distill"],
        "trained_by": f"sentence-transformers {sentence_transformers.__version__} "
        "SentenceTransformerTrainer + EmbedDistillLoss(cosine) (benchmarks/distill_peer.py)",
    }
    (out / "matryoshka2d.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    shutil.rmtree(out / "trainer", ignore_errors=True)
    peer = {
        **settings,
        "peer_seconds": seconds,
        "peer_seconds_per_step": seconds / settings["steps"],
        "peer_train_loss": result.training_loss,
        "log": [h for h in trainer.state.log_history if "loss" in h],
    }
    (out / "peer.json").write_text(json.dumps(peer, indent=2), encoding="utf-8")
    steps, per_step = settings["steps"], seconds / settings["steps"]
    print(
        f"{steps} steps of {settings['batch_size']} in {seconds:.1f} s ({per_step:.3f} s a step), "
        f"mean training loss {result.training_loss:.4f} -> {out}"
    )


def score(args) -> None:
    from common import header
    from matryoshka2d.cli import main as cli

    print(header())
    run, peer, out = Path(args.run), Path(args.peer), Path(args.output)
    settings = json.loads((peer / "peer.json").read_text(encoding="utf-8"))
    layer, width = settings["layer"], settings["width"]
    record = json.loads((run / "matryoshka2d.json").read_text(encoding="utf-8"))
    if record["steps"] != settings["steps"]:
        raise SystemExit(
            f"{run} trained {record['steps']} steps and the peer {peer} {settings['steps']}: compare at the same steps "
            f"(prepare --steps {record['steps']}, or a run of {settings['steps']} steps)"
        )
    teacher = record["distill"]["teacher"]
    peer_record = json.loads((peer / "matryoshka2d.json").read_text(encoding="utf-8"))["distill"]
    if "weights_sha256" not in peer_record:  # `train` ran without matryoshka2d: state the folder's own checksum and
        from matryoshka2d.models.encoder import ElasticEncoder  # width, as distill does after saving, so that
        from matryoshka2d.models.query_record import record_own_identity  # eval retrieval takes it as a query encoder

        record_own_identity(peer, ElasticEncoder(str(peer), device="cpu"))
    rows = {}
    for name, folder in (("matryoshka2d distill", run), ("sentence-transformers EmbedDistillLoss", peer)):
        sts = out / f"sts-{folder.name}"
        if not (sts / "results.json").is_file():
            command = ["eval", "sts", "--model", str(folder), "--layers", str(layer), "--dims", str(width)]
            assert (
                cli([*command, "--output", str(sts), "--quiet", *(["--datasets", *args.sts] if args.sts else [])]) == 0
            )
        rows[name] = {"sts": _sts_average(sts / "results.json")}
    retrieval = out / "retrieval"
    if not (retrieval / "cascade.json").is_file():
        command = [
            "eval",
            "retrieval",
            "--model",
            teacher,
            "--dataset-dir",
            str(args.dataset_dir),
            "--split",
            args.split,
        ]
        command += ["--query-model", str(run), str(peer), "--output", str(retrieval), "--quiet"]
        assert cli(command) == 0
    result = json.loads((retrieval / "cascade.json").read_text(encoding="utf-8"))
    by_model = {}
    for row in result["rows"]:
        for name, folder in (("matryoshka2d distill", run), ("sentence-transformers EmbedDistillLoss", peer)):
            if row["mode"].startswith(f"query encoder {folder} ("):
                by_model[name] = row
        if row["mode"].startswith("flat"):
            by_model["the teacher (flat)"] = row
    lines = [
        f"{settings['texts']:,} texts, {settings['steps']:,} steps of {settings['batch_size']}, lr {settings['lr']:g}, "
        f"the same start, texts and targets (benchmarks/distill_peer.py)",
        "",
        f"| student (layer {layer}) | STS {'+'.join(args.sts) if args.sts else '7-set'} ({layer},{width}) | "
        f"nDCG@10 {args.split} | share of flat | s/step |",
        "|---|---:|---:|---:|---:|",
    ]
    flat = _ndcg(by_model.get("the teacher (flat)"))
    per_step = {
        "matryoshka2d distill": record.get("seconds_per_step"),
        "sentence-transformers EmbedDistillLoss": settings.get("peer_seconds_per_step"),
    }
    for name, values in rows.items():
        ndcg = _ndcg(by_model.get(name))
        share = f"{100 * ndcg / flat:.1f}%" if ndcg is not None and flat else "-"
        step = per_step.get(name)
        lines.append(
            f"| {name} | {values['sts']:.2f} | {ndcg if ndcg is None else round(ndcg, 2)} | {share} | "
            f"{step if step is None else round(step, 3)} |"
        )
    lines.append(f"| the teacher {teacher}, flat | - | {flat if flat is None else round(flat, 2)} | 100% | - |")
    text = "\n".join(lines)
    print(text)
    (out / "peer.md").write_text(header() + "\n\n" + text + "\n", encoding="utf-8")


def _sts_average(path: Path) -> float:
    """The primary metric averaged over the STS sets at the one cell evaluated (results.json of `eval sts`)."""
    result = json.loads(path.read_text(encoding="utf-8"))
    return float(result["average"][0][result["metric"]])


def _ndcg(row: dict | None) -> float | None:
    return None if row is None else float(row.get("ndcg@10", row.get("ndcg_at_10", float("nan"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--run", required=True, help="a finished `distill --mode query` run folder")
    p.add_argument("--output", required=True)
    p.add_argument(
        "--steps",
        type=int,
        help="the peer's steps (default: the run's); with a run of the same options and `--steps N`, both can train "
        "side by side, one core each",
    )
    p = sub.add_parser("train")
    p.add_argument("--prep", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--quiet", action="store_true")
    p = sub.add_parser("score")
    p.add_argument("--run", required=True)
    p.add_argument("--peer", required=True)
    p.add_argument("--dataset-dir", type=Path, required=True)
    p.add_argument("--split", default="half_b")
    p.add_argument("--sts", nargs="+", help="STS sets (default: the 7-set)")
    p.add_argument("--output", required=True)
    args = parser.parse_args()
    {"prepare": prepare, "train": train, "score": score}[args.step](args)


if __name__ == "__main__":
    main()
