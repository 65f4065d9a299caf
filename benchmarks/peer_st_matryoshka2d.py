"""Peer run: sentence-transformers' own Matryoshka2dLoss, trained the way our trainer trains.

    python benchmarks/peer_st_matryoshka2d.py --data ../shared/data/nli/train_triplets.tsv --output runs/st-2dmse
        [--steps N] [--batch-size 32] [--device cpu|cuda]

Same backbone (minilm-l6), same batches in the same order (our trainer's seeded permutation), AdamW with the
library trainer's weight decay (0.0), linear warm-up/decay and clipping; only the loss differs:
Matryoshka2dLoss(MultipleNegativesRankingLoss) with its defaults (one random prior layer and one random dim per
step, KL temperature 0.3) over the nested dims 384 ... 8. The model is saved with model.save(), so it can be
scored with `matryoshka2d eval sts`.
Prints samples/second next to the number of steps so that it can be compared with our `2dmse` + `infonce`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import Matryoshka2dLoss, MultipleNegativesRankingLoss
from tqdm.auto import tqdm

from common import header, to_device
from matryoshka2d.cells import nested_dims
from matryoshka2d.models.backbones import minilm_dir
from matryoshka2d.training.data import read_training_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--steps", type=int, help="default: one epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (run our trainer on the same one)")
    args = parser.parse_args()
    print(header())

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    data = read_training_data(args.data)
    if data.kind != "triplets":
        raise SystemExit("this peer run uses MultipleNegativesRankingLoss on (anchor, positive, negative) triplets")
    model = SentenceTransformer(str(minilm_dir()), device=args.device)
    hidden = model.get_embedding_dimension()
    loss_fn = Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), sorted(nested_dims(hidden), reverse=True))
    steps_per_epoch = math.ceil(len(data) / args.batch_size)
    total = args.steps or steps_per_epoch
    # Weight decay 0: SentenceTransformerTrainer takes HF TrainingArguments, whose weight_decay defaults to 0.0
    # (transformers training_args.py); the `st-matryoshka2d` preset uses the same.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = int(0.1 * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / (warmup + 1) if s < warmup else max(0.0, (total - s) / max(1, total - warmup)),
    )
    model.train()
    # Seeded again here, at the first step: loading the model draws from Python's `random`, and the
    # `st-matryoshka2d` preset (draws: python) draws the library's layers and widths from random.Random(seed)
    # in the library's order, so both runs train the same cells at every step.
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    samples, start = 0, time.perf_counter()
    for step in tqdm(range(total), desc="st Matryoshka2dLoss"):
        epoch, position = divmod(step, steps_per_epoch)
        order = np.random.default_rng([args.seed, epoch]).permutation(len(data))
        idx = order[position * args.batch_size : (position + 1) * args.batch_size]
        columns, _ = data.rows(idx)
        features = [to_device(model.tokenize(col), args.device) for col in columns]
        loss = loss_fn(features, labels=None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        samples += len(idx)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out = Path(args.output)
    model.save(str(out))
    summary = {
        "peer": "sentence-transformers Matryoshka2dLoss(MultipleNegativesRankingLoss)",
        "steps": total,
        "batch_size": args.batch_size,
        "device": args.device,
        "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / total, 4),
        "samples_per_second": round(samples / seconds, 2),
    }
    (out / "peer_run.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
