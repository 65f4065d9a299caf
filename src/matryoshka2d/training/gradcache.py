"""Gradient accumulation that keeps the whole batch's objective: gradient caching.

Splitting a batch into micro-batches and adding up each micro-batch's loss changes the objective of every
loss that compares rows with each other: in-batch negatives see only the micro-batch, and so do the KL over
in-batch similarity distributions and ESE's PCA target. Gradient caching (Gao et al. 2021, "Scaling Deep
Contrastive Learning Batch Size under Memory Limited Setup"; sentence-transformers 6.2
`base/losses/gradcache.py`, `CachedLossMixin.forward_cached`, used by CachedMultipleNegativesRankingLoss and
CachedGISTEmbedLoss) computes the same gradient as one pass over the whole batch, in three steps:

1. embed every micro-batch without an autograd graph, saving the random state right before each forward
   (`RandContext` in the same file) so that dropout can draw the same masks again;
2. compute the method's loss over the whole batch on those embeddings, as leaves that require grad, and
   backpropagate: this gives d(loss)/d(embedding) for every row (the "gradient cache") and, directly, the
   gradients of the method's and the task loss's own parameters (ESE's layer weights, the softmax head);
3. run each micro-batch again, with graph, under its saved random state, and backpropagate the surrogate
   <embedding, cached gradient>, whose gradient with respect to the weights is the micro-batch's share of the
   whole-batch gradient (`_backward_hook` in the same file).

Only one micro-batch's activations are alive at a time. The cost is a second forward pass per micro-batch.
With several processes, each micro-batch's rows are gathered as in a plain step, so the whole-batch loss is
the same in every process and each process replays its own rows.
"""

from __future__ import annotations

import numpy as np
import torch


class RandomState:
    """The torch random state (CPU, and the CUDA device the model runs on) at one moment, to run code again
    with the same random draws. `with state:` restores it inside torch.random.fork_rng, so the outer stream
    goes on as if nothing had run (sentence-transformers' RandContext does the same)."""

    def __init__(self, device: torch.device):
        self.devices = [device] if device.type == "cuda" else []
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self._fork = None

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=self.devices)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(state, device)

    def __exit__(self, *exc):
        fork, self._fork = self._fork, None
        return fork.__exit__(*exc)


def accumulate(trainer, step: int, micro_batches: list) -> tuple[torch.Tensor, dict]:
    """Gradients of the whole batch's loss, added to `.grad`, computed micro-batch by micro-batch; returns the
    whole batch's loss and its parts. `trainer` gives the pieces of a plain step: `start_step`, `embed`,
    `gather`, `objective` and `backward` (matryoshka2d.training.trainer.Trainer)."""
    plan = trainer.start_step(step)
    device = trainer.encoder.device
    states, leaves = [], []
    for features, _, _ in micro_batches:  # 1. embed without a graph, remembering the random state
        states.append(RandomState(device))
        with torch.no_grad():
            per_column = trainer.embed(features, plan)
        # fp32 leaves: the cached gradients stay fp32 whatever the autocast precision of the forward
        mine = [{layer: t.detach().float().requires_grad_() for layer, t in pooled.items()} for pooled in per_column]
        leaves.append(mine)
    whole = [trainer.gather(plan, mine, rows) for mine, (_, _, rows) in zip(leaves, micro_batches, strict=True)]
    per_column = [
        {layer: torch.cat([part[c][layer] for part in whole]) for layer in plan.layers} for c in range(len(whole[0]))
    ]
    labels = [labels for _, labels, _ in micro_batches]
    labels = None if labels[0] is None else np.concatenate(labels)
    loss, parts = trainer.objective(plan, per_column, labels)  # 2. the whole batch's loss
    trainer.backward(loss)  # the gradient cache on the leaves (scaled like the loss under fp16)
    for (features, _, _), state, mine in zip(micro_batches, states, leaves, strict=True):  # 3. replay
        cached = [(layer, pooled[layer].grad) for pooled in mine for layer in plan.layers]
        if all(grad is None for _, grad in cached):
            continue  # a process's stand-in rows (parallel.Processes.own_rows): nothing of it is in the loss
        with state:
            again = trainer.embed(features, plan)
        outputs = [pooled[layer] for pooled in again for layer in plan.layers]
        surrogate = sum(
            (out.float() * grad).sum() for out, (_, grad) in zip(outputs, cached, strict=True) if grad is not None
        )
        surrogate.backward()  # not trainer.backward: the cached gradients are already scaled
    return loss, parts
