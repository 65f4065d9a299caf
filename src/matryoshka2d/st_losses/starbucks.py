"""StarbucksLoss: Starbucks Representation Learning, SRL (Zhuang et al., arXiv 2410.13230) in
sentence-transformers' trainer."""

from __future__ import annotations

from typing import Any

from torch import nn

from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.method_loss import MethodLoss


class StarbucksLoss(MethodLoss):
    method_name = "starbucks"

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None = None,
        preset: str | None = None,
        seed: int | None = None,
        exit_heads: ExitHeads | None = None,
        **options: Any,
    ) -> None:
        """The wrapped loss on a fixed list of (layer, dim) sizes every step, small to large, plus a KL term from
        the full size to each smaller one, as `matryoshka2d train --method starbucks` trains.

        Args:
            model: the SentenceTransformer being trained (a Transformer first).
            loss: the loss each size gets; default `TaskLoss(model, "angle")`, the loss `train` picks for triplets
                (ielab/Starbucks trains MultipleNegativesRankingLoss: pass it, or use preset "starbucks-paper").
            preset: "starbucks-paper" for the KL as ielab/Starbucks' STS code computes it.
            seed: unused (Starbucks draws nothing); kept for a common signature.
            exit_heads: heads trained along (`st_losses.exit_heads_for(model)`): every shallow view goes through
                its exit's head; `st_losses.save_with_exit_heads` writes the model with them.
            options: any option of `matryoshka2d.methods.Starbucks`: sizes (default: the paper's six sizes scaled
                to the backbone, e.g. (1,32) (2,32) (3,64) (4,128) (5,256) (6,384) for 6 x 384), kl_weight=1,
                kl_temperature=0.3, kl="similarity", kl_factor="T2", kl_detach=True, kl_scale_logits=True,
                kl_normalize=False, kl_teacher="largest-listed".

        Inputs: whatever the wrapped loss takes.
        """
        super().__init__(model, loss, preset, seed, options, exit_heads)

    @property
    def citation(self) -> str:
        return """
@article{zhuang2024starbucks,
    title={Starbucks: Improved Training for 2D Matryoshka Embeddings},
    author={Shengyao Zhuang and Shuai Wang and Bevan Koopman and Guido Zuccon},
    journal={arXiv preprint arXiv:2410.13230},
    year={2024}
}
"""
