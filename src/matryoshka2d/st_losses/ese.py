"""ESELoss: Espresso Sentence Embeddings (Li et al., arXiv 2402.14776v2) in sentence-transformers' trainer."""

from __future__ import annotations

from typing import Any

from torch import nn

from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.method_loss import MethodLoss


class ESELoss(MethodLoss):
    method_name = "ese"

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None = None,
        preset: str | None = None,
        seed: int | None = None,
        exit_heads: ExitHeads | None = None,
        **options: Any,
    ) -> None:
        """Learn-to-express (the wrapped loss at every shallow layer at width k, weights 1/(1+ln i), plus the
        last layer at k and at full width) and learn-to-compress (the first k numbers aligned to a PCA target
        with MSE + KL, weight `beta`), as `matryoshka2d train --method ese` trains.

        Args:
            model: the SentenceTransformer being trained (a Transformer first, as AdaptiveLayerLoss needs).
            loss: the loss each view gets, e.g. `MultipleNegativesRankingLoss(model)`, `CoSENTLoss(model)` or
                ours, `TaskLoss(model, "angle")`, which is the default (the loss `train` picks for triplets).
            preset: the method options of one of our recipes: "ese-paper" (the paper's equations) or
                "ese-angle-emb" (angle-emb 0.6.1's AngleESETrainer); each preset file cites its source.
            seed: unused by ESE (it draws nothing); kept for a common signature.
            exit_heads: heads trained along (`st_losses.exit_heads_for(model)`): every shallow view goes through
                its exit's head; `st_losses.save_with_exit_heads` writes the model with them.
            options: any option of `matryoshka2d.methods.ESE` (k=128, alpha=1, beta=0, layers="paper",
                shallow_mean=False, compress_target="scaled", pca="exact", pca_sign="fixed", kl_temperature=1,
                kl_factor="T2", full_loss=True, dynamic_weights=False), overriding the preset's.

        Inputs: whatever the wrapped loss takes (triplets, pairs, scored pairs).
        """
        super().__init__(model, loss, preset, seed, options, exit_heads)

    @property
    def citation(self) -> str:
        return """
@article{li2024ese,
    title={ESE: Espresso Sentence Embeddings},
    author={Xianming Li and Zongxi Li and Jing Li and Haoran Xie and Qing Li},
    journal={arXiv preprint arXiv:2402.14776},
    year={2024}
}
"""
