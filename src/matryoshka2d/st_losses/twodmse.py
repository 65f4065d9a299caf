"""TwoDMSELoss: 2D Matryoshka Sentence Embeddings (Li et al., arXiv 2402.14776v1) as its paper writes it, in
sentence-transformers' trainer. The library's own Matryoshka2dLoss is its code's reading (two views, a KL of
feature softmaxes); preset "st-matryoshka2d" gives that reading here, "2dmse-authors" angle-emb's."""

from __future__ import annotations

from typing import Any

from torch import nn

from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.method_loss import MethodLoss


class TwoDMSELoss(MethodLoss):
    method_name = "2dmse"

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None = None,
        preset: str | None = None,
        seed: int | None = None,
        exit_heads: ExitHeads | None = None,
        **options: Any,
    ) -> None:
        """Each step a random shallow layer n (1..N-1) and a random width d (8, 16, ... below D): the wrapped
        loss on (N, D), (n, D), (N, d), (n, d), plus the KL of layer n's in-batch similarity distribution towards
        the last layer's at both widths (eq. 6, the last layer detached), as `train --method 2dmse` trains.

        Args:
            model: the SentenceTransformer being trained (a Transformer first).
            loss: the loss each view gets; default `TaskLoss(model, "angle")`, the loss `train` picks for triplets.
            preset: "2dmse-paper", "2dmse-authors" (angle-emb 0.3.8-0.3.10), "2dmse-angle-0.3" or "st-matryoshka2d"
                (sentence-transformers' Matryoshka2dLoss reading, draws in its order).
            seed: the seed of the layer and width draws; by default drawn from Python's `random` at the first
                step, which the trainer's seed has set. Step s draws from its own generator (seed, s).
            exit_heads: heads trained along (`st_losses.exit_heads_for(model)`): every shallow view goes through
                its exit's head; `st_losses.save_with_exit_heads` writes the model with them.
            options: any option of `matryoshka2d.methods.TwoDMSE` (dims, the four view weights, kl_weight=1,
                kl_temperature=0.3, shallow_weighting="uniform", kl="similarity", kl_widths="both",
                kl_factor="T2", kl_detach=True, kl_normalize=False, min_layer=1, views="paper", draws="numpy").

        Inputs: whatever the wrapped loss takes.
        """
        super().__init__(model, loss, preset, seed, options, exit_heads)

    @property
    def citation(self) -> str:
        return """
@misc{li20242d,
    title={2D Matryoshka Sentence Embeddings},
    author={Xianming Li and Zongxi Li and Jing Li and Haoran Xie and Qing Li},
    year={2024},
    eprint={2402.14776},
    archivePrefix={arXiv},
    primaryClass={cs.CL}
}
"""
