"""The protocol of record through sentence-transformers' own trainer: our losses (matryoshka2d.st_losses) next to
the library's Matryoshka2dLoss, on the batches `matryoshka2d train` sees.

    python benchmarks/st_trainer_protocol.py --loss ese|starbucks|2dmse|st-matryoshka2d \
        --data ../shared/data/nli/train_triplets.tsv --output runs/st-ese [--steps 150] [--resume]

`SentenceTransformerTrainer` with `SentenceTransformerTrainingArguments` set to the protocol (minilm-l6, batch 32,
lr 5e-5, seed 42) and to what `matryoshka2d train` uses where the library's defaults differ: 10% linear warm-up,
then linear decay (HF's default has no warm-up), weight decay 0.01 (HF: 0.0), gradient clipping at 1.0 (both).
The rows arrive in our trainer's order (the permutation of (seed, epoch) our `Trainer.batch_indices` draws),
through a sequential batch sampler given as `batch_sampler`, so both runs train on the same batches; what still
differs is the dropout masks (our trainer reseeds them per step) and HF's warm-up formula (step / warmup against
our (step + 1) / (warmup + 1)).

Losses: ese = ESELoss(model, TaskLoss(model, "angle")), starbucks = StarbucksLoss(...), 2dmse = TwoDMSELoss(...),
each with `train --method`'s defaults and the loss `train` picks for triplets; st-matryoshka2d = the library's
Matryoshka2dLoss(MultipleNegativesRankingLoss) over the nested dims, the peer of the time-per-step line.

Writes the model (model.save) and st_run.json: seconds per step (the median over steps after the first, and the
mean), the machine and the command. Saves a checkpoint every 25 steps; --resume goes on from the last one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import Matryoshka2dLoss, MultipleNegativesRankingLoss
from torch.utils.data import BatchSampler, SequentialSampler
from transformers import TrainerCallback

from common import header
from matryoshka2d.cells import nested_dims
from matryoshka2d.models.backbones import minilm_dir
from matryoshka2d.st_losses import ESELoss, StarbucksLoss, TaskLoss, TwoDMSELoss
from matryoshka2d.training.data import read_training_data

OURS = {"ese": ESELoss, "starbucks": StarbucksLoss, "2dmse": TwoDMSELoss}


def make_loss(name: str, model: SentenceTransformer):
    if name == "st-matryoshka2d":
        dims = sorted(nested_dims(model.get_embedding_dimension()), reverse=True)
        return Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), dims)
    return OURS[name](model, TaskLoss(model, "angle"))


def ordered_rows(path: str, steps: int, batch_size: int, seed: int) -> Dataset:
    """The rows of `steps` batches in `matryoshka2d train`'s order (training/trainer.py, Trainer.batch_indices)."""
    data = read_training_data([path])
    if data.kind != "triplets":
        raise SystemExit(f"{path}: the protocol trains on (anchor, positive, negative) triplets, got {data.kind}")
    per_epoch = math.ceil(len(data) / batch_size)
    indices = []
    for step in range(steps):
        epoch, position = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(len(data))
        indices.extend(order[position * batch_size : (position + 1) * batch_size])
    anchor, positive, negative = data.rows(np.asarray(indices))[0]
    return Dataset.from_dict({"anchor": list(anchor), "positive": list(positive), "negative": list(negative)})


def in_order(dataset, batch_size: int, drop_last: bool, **_) -> BatchSampler:
    """The rows as given: the dataset is already in the order of our trainer's batches."""
    return BatchSampler(SequentialSampler(range(len(dataset))), batch_size, drop_last)


class StepClock(TrainerCallback):
    """Wall time of every optimizer step (forward, backward, clipping, AdamW, schedule)."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", required=True, choices=[*OURS, "st-matryoshka2d"])
    parser.add_argument("--data", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--resume", action="store_true", help="go on from the last checkpoint under --output")
    parser.add_argument("--no-save", action="store_true", help="time the steps only; keep no model")
    args = parser.parse_args()
    started = header()
    print(started)
    out = Path(args.output)
    if (out / "st_run.json").exists():
        raise SystemExit(f"{out}: finished already (st_run.json); choose another --output")
    if out.exists() and not args.resume and any(out.iterdir()):
        raise SystemExit(f"{out} exists; --resume goes on from its last checkpoint")
    torch.manual_seed(args.seed)
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    training = SentenceTransformerTrainingArguments(
        output_dir=str(out / "checkpoints"),
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        max_steps=args.steps,
        warmup_steps=int(0.1 * args.steps),
        lr_scheduler_type="linear",
        weight_decay=0.01,
        max_grad_norm=1.0,
        seed=args.seed,
        batch_sampler=in_order,
        save_strategy="no" if args.no_save else "steps",
        save_steps=25,
        save_total_limit=1,
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        dataloader_drop_last=False,
        disable_tqdm=False,
    )
    clock = StepClock()
    trainer = SentenceTransformerTrainer(
        model=model,
        args=training,
        train_dataset=ordered_rows(args.data, args.steps, args.batch_size, args.seed),
        loss=make_loss(args.loss, model),
        callbacks=[clock],
    )
    resume = args.resume and any((out / "checkpoints").glob("checkpoint-*"))
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if resume else None)
    seconds = time.perf_counter() - start
    steps = clock.seconds[1:] or clock.seconds
    summary = {
        "loss": args.loss,
        "steps": args.steps,
        "steps_timed": len(steps),
        "resumed": resume,
        "batch_size": args.batch_size,
        "seconds": round(seconds, 1),
        "seconds_per_step_median": round(statistics.median(steps), 4),
        "seconds_per_step_mean": round(statistics.fmean(steps), 4),
        "torch_threads": torch.get_num_threads(),
        "header": started,
    }
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_save:
        model.save(str(out))
    (out / "st_run.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
