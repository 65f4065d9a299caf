"""The recipes of `distill`: what it runs when no option says otherwise (docs/distill.md measured each), and the
line it prints saying what it chose and why.
"""

from __future__ import annotations

import math

from matryoshka2d.models.query_record import QUERY_MODES

QUERY_LR, QUERY_EPOCHS = 2e-4, 3.0  # SciFact half B: 95.5% of flat nDCG@10 with 3 layers (63 minutes here)
PASSAGE_TOKENS = 48  # query mode: BEIR documents cut into claim-sized passages (80% -> 89% of flat with 2 epochs)
# static mode (layer 0: a token table and a head, nothing else learns): SciFact half B 92.2% of flat, STS-B 76.65
# after 3 epochs (88.8%, 76.47 after 1); a table wants a rate far above a transformer's, and no weight decay, which
# would pull the rows of rare tokens towards zero between the steps that see them
STATIC_LR, STATIC_EPOCHS, STATIC_WEIGHT_DECAY = 3e-3, 3.0, 0.0
# shared mode: minilm-l6 ran 3.5 epochs of 37,276 texts (2,041 steps), mpnet-base 5 epochs of 10,000 (785 steps)
SHARED_STEPS, SHARED_MAX_EPOCHS = 2000, 5.0
SHARED_LR = {6: 1e-4, 12: 3e-4}  # depth of the measured teacher -> its rate: minilm-l6, mpnet-base
RECIPE_CHOICES = ("lr", "epochs", "passage_tokens", "weight_decay")  # what it may choose: the options not given


def recipe(mode: str, num_layers: int, width: int, texts: int, batch_size: int, choose=RECIPE_CHOICES, widths=None):
    """The values of the measured recipe for the options in `choose`, and one line saying what was chosen and why.

    - query mode: lr 2e-4 and 3 epochs, BEIR documents as passages of 48 tokens (and, always unless --widths is
      given, the loss on the full width, the one the teacher's index holds): docs/distill.md's SciFact recipe.
    - static mode (layer 0 as a query encoder for the teacher's index): lr 3e-3, 3 epochs, no weight decay, the
      same passages and the same full-width loss: docs/distill.md's static run.
    - shared mode: about 2,000 steps (rounded to half an epoch, at most 5 epochs), and the learning rate measured
      on the teacher of the nearest depth (1e-4 for 6 layers, 3e-4 for 12): minilm-l6's 3.5 epochs of 37,276
      texts at 1e-4 and mpnet-base's 5 epochs of 10,000 at 3e-4 both come out of this rule. A 12-layer model's
      layer-3 exit has a quarter of the network to learn with, and gained nothing at (3,768) with minilm's rate.
    """
    values, why = {}, []
    steps_per_epoch = max(1, math.ceil(texts / batch_size))
    if mode in QUERY_MODES:
        lr, epochs = (QUERY_LR, QUERY_EPOCHS) if mode == "query" else (STATIC_LR, STATIC_EPOCHS)
        if "lr" in choose:
            values["lr"] = lr
            why.append(f"lr {rate(lr)}")
        if "epochs" in choose:
            values["epochs"] = epochs
            steps = math.ceil(epochs * steps_per_epoch)
            why.append(f"{epochs:g} epochs = {steps:,} steps of {batch_size} over {texts:,} texts")
        if mode == "static" and "weight_decay" in choose:
            values["weight_decay"] = STATIC_WEIGHT_DECAY
            why.append("no weight decay")
        if "passage_tokens" in choose:
            values["passage_tokens"] = PASSAGE_TOKENS
            why.append(f"BEIR documents as passages of {PASSAGE_TOKENS} tokens, about a claim")
        source = "SciFact recipe" if mode == "query" else "static run on SciFact"
        why = [f"{', '.join(why)} (docs/distill.md's {source})"] if why else []
        if why and list(widths or [width]) == [width]:
            why.append(f"the loss on the full width {width}, the one an index of the teacher holds")
    else:
        if "epochs" in choose:
            epochs = min(SHARED_MAX_EPOCHS, max(0.5, round(2 * SHARED_STEPS / steps_per_epoch) / 2))
            values["epochs"] = epochs
            steps = math.ceil(epochs * steps_per_epoch)
            why.append(
                f"{epochs:g} epochs = {steps:,} steps of {batch_size} over {texts:,} texts "
                f"(about {SHARED_STEPS:,} steps, at most {SHARED_MAX_EPOCHS:g} epochs)"
            )
        if "lr" in choose:
            depth = min(SHARED_LR, key=lambda d: (abs(d - num_layers), d))
            values["lr"] = SHARED_LR[depth]
            why.append(f"lr {rate(SHARED_LR[depth])} (measured on a {depth}-layer teacher; this one has {num_layers})")
    line = f"distill recipe (--mode {mode}): " + "; ".join(why) if why else ""
    return values, line


def rate(value: float) -> str:
    """A learning rate as the docs write it: 2e-4."""
    return f"{value:.0e}".replace("e-0", "e-")
