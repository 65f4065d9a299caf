"""Time per training step of our sentence-transformers losses against the library's own Matryoshka2dLoss, on the
same batches, step by step in turns, so that whatever else the machine does slows every loss alike.

    python benchmarks/st_loss_step_time.py --data ../shared/data/nli/train_triplets.tsv [--steps 20]

Each loss trains its own copy of minilm-l6 (SentenceTransformer) with the step SentenceTransformerTrainer runs:
loss(features, labels), backward, clipping at 1.0, AdamW; the batch (32 triplets in `matryoshka2d train`'s order)
is tokenized once, outside the timed span, as the trainer's collator does it before the step. Step s of every loss
runs before step s + 1 of any, in an order rotated each step. Losses: ESELoss and StarbucksLoss over our angle loss
(the protocol's), TwoDMSELoss over it, and Matryoshka2dLoss(MultipleNegativesRankingLoss) over the nested dims.
Prints the median seconds per step after the first of each, and each ratio to Matryoshka2dLoss.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sentence_transformers import SentenceTransformer

from common import header
from matryoshka2d.models.backbones import minilm_dir
from st_trainer_protocol import make_loss, ordered_rows

LOSSES = ("st-matryoshka2d", "ese", "starbucks", "2dmse")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    args = parser.parse_args()
    print(header())
    rows = ordered_rows(args.data, args.steps, args.batch_size, seed=42)
    runs = {}
    for name in args.losses:
        torch.manual_seed(42)
        model = SentenceTransformer(str(minilm_dir()), device="cpu")
        model.train()
        loss = make_loss(name, model)
        optimizer = torch.optim.AdamW(list(loss.parameters()), lr=5e-5, weight_decay=0.01)
        runs[name] = (model, loss, optimizer, [])
    for step in range(args.steps):
        batch = rows[step * args.batch_size : (step + 1) * args.batch_size]
        order = args.losses[step % len(args.losses) :] + args.losses[: step % len(args.losses)]
        for name in order:
            model, loss, optimizer, seconds = runs[name]
            features = [model.tokenize(batch[column]) for column in ("anchor", "positive", "negative")]
            start = time.perf_counter()
            value = loss(features, None)
            value.backward()
            torch.nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
        print(f"step {step + 1}: " + ", ".join(f"{n} {runs[n][3][-1]:.2f} s" for n in args.losses), flush=True)
    reference = statistics.median(runs["st-matryoshka2d"][3][1:]) if "st-matryoshka2d" in runs else None
    print("\n| loss | median s/step (steps 2..) | mean | vs Matryoshka2dLoss |\n|---|---:|---:|---:|")
    for name in args.losses:
        timed = runs[name][3][1:]
        ratio = f"{statistics.median(timed) / reference:.3f}x" if reference else "-"
        print(f"| {name} | {statistics.median(timed):.3f} | {statistics.fmean(timed):.3f} | {ratio} |")


if __name__ == "__main__":
    main()
