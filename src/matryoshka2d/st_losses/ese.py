"""ESELoss: Espresso Sentence Embeddings (Li et al., arXiv 2402.14776v2) in sentence-transformers' trainer."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from matryoshka2d.methods.ese import ESE
from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.method_loss import MethodLoss, method_arguments, records_given_arguments

# The paper's compression width (ESE sec. 4, "k is set to 128"), `train --method ese`'s default.
PAPER_K = inspect.signature(ESE).parameters["k"].default


class ESELoss(MethodLoss):
    """Espresso Sentence Embeddings: a model whose shallow layers and whose first k numbers are embeddings of their
    own, trained as `matryoshka2d train --method ese` trains it (the same `matryoshka2d.methods.ESE`).

    Learn-to-express: the wrapped loss at every shallow layer i at width k, weighted 1/(1 + ln i), plus the last
    layer at k and at full width D (ESE eq. 2, with angle-emb's (N, D) term). Learn-to-compress (`beta` > 0): at each
    of those layers the first k numbers are aligned, with MSE + KL, to a PCA target of the batch (eqs. 3-6). The
    total is alpha * express + beta * compress (eq. 7).

    Args:
        model: the SentenceTransformer being trained.
        loss: the loss each (layer, width) view gets, e.g. `MultipleNegativesRankingLoss(model)`,
            `CoSENTLoss(model)` or `TaskLoss(model, "cosent")`. Default: None, `TaskLoss(model, "angle")`, the loss
            `matryoshka2d train` picks for triplets.
        k: the compression width, the width of every shallow view. Default: None, the paper's 128, or the model's
            embedding width when it has fewer numbers.
        alpha: the weight of learn-to-express. Default: 1.0.
        beta: the weight of learn-to-compress; 0 turns it off. Default: 0.0 (the ablation in docs/reproduction.md
            picked it; the paper's is 1.0, preset "ese-paper").
        layers: which layers are shallow: "paper" (layers 1..N-1, weights 1/(1 + ln i)) or "angle-emb" (the
            embedding output and layers 1..N-2, weights 1/(1 + ln(1 + i)), as the authors' code). Default: "paper".
        shallow_mean: divide the shallow sum by the number of shallow layers (the authors' code). Default: False.
        compress_target: "dependency" (the paper's and the authors' target X A_k) or "scaled" (ours: the same
            direction, each row rescaled to the norm of its own first k numbers). Default: "scaled".
        pca: the SVD of the target, "exact" (torch.linalg.svd) or "lowrank" (torch.svd_lowrank, the authors').
            Default: "exact".
        pca_sign: "fixed" (each singular vector turned so that its largest entry is positive, scikit-learn's
            svd_flip) or "raw" (as the SVD returns them). Default: "fixed".
        kl_temperature: the temperature of the compression KL. Default: 1.0.
        kl_factor: the KL times "T2" (Hinton et al.'s distillation) or "T" (the authors' code); the same at T = 1.
            Default: "T2".
        full_loss: the last layer at full width, (N, D), which the paper's eq. 2 leaves out. Default: True.
        dynamic_weights: learn the shallow layers' weights (softmax over logits starting at the fixed weights).
            Default: False.
        preset: one of our recipes, whose method options replace the defaults of the arguments not given:
            "ese-paper" (the paper's equations) or "ese-angle-emb" (angle-emb 0.6.1's AngleESETrainer); each preset
            file cites its source. Default: None.
        seed: unused: ESE draws nothing (kept for the signature the three losses share). Default: None.
        exit_heads: heads trained along (`st_losses.exit_heads_for(model)`): every shallow view goes through its
            exit's head; `st_losses.save_with_exit_heads` writes the model with them. Default: None.

    Inputs:
        | Texts | Labels |
        |---|---|
        | what the wrapped loss takes: (anchor, positive, negative), (anchor, positive), ... | the wrapped loss's |

    Requirements:
        1. A SentenceTransformer whose first module is a Transformer: the loss reads every layer's hidden states
           (a query/document Router trains each side as a model of its own).
        2. A wrapped loss that neither embeds by itself (not the `Cached...` losses) nor picks widths or layers
           (not `MatryoshkaLoss`, `Matryoshka2dLoss` or `AdaptiveLayerLoss`: wrap their inner loss).
        3. Batches of at least one row.

    Example:
        ```python
        from datasets import Dataset
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        from matryoshka2d.st_losses import ESELoss

        model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
        triplets = Dataset.from_dict({
            "anchor": ["A man is playing a guitar.", "A woman is reading."],
            "positive": ["Someone plays music.", "A person reads a book."],
            "negative": ["A cat sleeps.", "A car drives by."],
        })
        loss = ESELoss(model, MultipleNegativesRankingLoss(model), k=128, beta=1.0)
        SentenceTransformerTrainer(model=model, train_dataset=triplets, loss=loss).train()
        ```

    References:
        - Li, Li, Li, Xie and Li, "ESE: Espresso Sentence Embeddings", arXiv 2402.14776v2
          (https://arxiv.org/abs/2402.14776), sec. 3.2-3.4 and sec. 4.
        - The authors' code: angle-emb (https://github.com/SeanLee97/AnglE/blob/main/README_ESE.md), 0.6.1's
          `AngleESETrainer` in `angle_emb/angle.py`.
    """

    method_name = "ese"

    @records_given_arguments
    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None = None,
        *,
        k: int | None = None,
        alpha: float = 1.0,
        beta: float = 0.0,
        layers: str = "paper",
        shallow_mean: bool = False,
        compress_target: str = "scaled",
        pca: str = "exact",
        pca_sign: str = "fixed",
        kl_temperature: float = 1.0,
        kl_factor: str = "T2",
        full_loss: bool = True,
        dynamic_weights: bool = False,
        preset: str | None = None,
        seed: int | None = None,
        exit_heads: ExitHeads | None = None,
    ) -> None:
        super().__init__(model, loss, method_arguments(locals()), preset, seed, exit_heads)

    def fit_to_model(self, options: dict[str, Any], hidden: int) -> dict[str, Any]:
        """k left unset: the paper's 128, or the model's whole width when it is narrower."""
        if options.get("k") is None:
            return {**options, "k": min(PAPER_K, hidden)}
        return options

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
