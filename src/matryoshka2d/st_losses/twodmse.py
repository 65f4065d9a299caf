"""TwoDMSELoss: 2D Matryoshka Sentence Embeddings (Li et al., arXiv 2402.14776v1) as its paper writes it, in
sentence-transformers' trainer. The library's own Matryoshka2dLoss is its code's reading (two views, a KL of
feature softmaxes); preset "st-matryoshka2d" gives that reading here, "2dmse-authors" angle-emb's."""

from __future__ import annotations

from torch import nn

from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.method_loss import MethodLoss, method_arguments, records_given_arguments


class TwoDMSELoss(MethodLoss):
    """2D Matryoshka Sentence Embeddings (2DMSE): each step a random shallow layer n (1..N-1) and a random width d
    below D; the wrapped loss on (N, D), (n, D), (N, d) and (n, d), plus the KL of layer n's in-batch similarity
    distribution towards the last layer's at both widths (eqs. 2-7, the last layer detached), as `matryoshka2d train
    --method 2dmse` trains it (the same `matryoshka2d.methods.TwoDMSE`).

    Args:
        model: the SentenceTransformer being trained; at least 2 layers.
        loss: the loss each view gets. Default: None, `TaskLoss(model, "angle")`, the loss `matryoshka2d train`
            picks for triplets.
        dims: the widths d is drawn from, each below the model's width D. Default: None, the paper's geometric
            series 8, 16, 32, ... below D.
        full_weight: the weight of (N, D). Default: 1.0.
        shallow_weight: the weight of (n, D). Default: 1.0.
        last_small_weight: the weight of (N, d). Default: 1.0.
        shallow_small_weight: the weight of (n, d). Default: 1.0.
        kl_weight: the weight of the KL term; 0 turns it off. Default: 1.0.
        kl_temperature: the KL's temperature (the paper gives none; sentence-transformers' Matryoshka2dLoss
            uses 0.3). Default: 0.3.
        shallow_weighting: "uniform", or "inverse" (layer n's two views divided by n, the authors' code).
            Default: "uniform".
        kl: "similarity" (in-batch similarity distributions) or "features" (a softmax over each text's numbers,
            the authors' and sentence-transformers' code). Default: "similarity".
        kl_widths: "both" (at D and at d) or "full" (at D only). Default: "both".
        kl_factor: the KL times "T2" or "T". Default: "T2".
        kl_detach: the last layer gets no gradient from the KL. Default: True.
        kl_normalize: compare unit vectors (True), the pooled ones (False), or follow the model ("auto").
            Default: False.
        min_layer: the smallest n drawn (0: the embedding output, as sentence-transformers draws). Default: 1.
        views: "paper" (the four views) or "st" (sentence-transformers' two: the last layer at one random width,
            layer n at another). Default: "paper".
        draws: "numpy" (a generator per step) or "python" (with views="st": one `random.Random(seed)` drawn in
            sentence-transformers' order, step for step its Matryoshka2dLoss). Default: "numpy".
        preset: one of our recipes, whose method options replace the defaults of the arguments not given:
            "2dmse-paper", "2dmse-authors" (angle-emb 0.3.8-0.3.10), "2dmse-angle-0.3" or "st-matryoshka2d"
            (sentence-transformers' Matryoshka2dLoss reading). Default: None.
        seed: the seed of the layer and width draws. Default: None, drawn from Python's `random` at the first step,
            which the trainer's seed has set; step s draws from its own generator of (seed, s).
        exit_heads: heads trained along (`st_losses.exit_heads_for(model)`): every shallow view goes through its
            exit's head; `st_losses.save_with_exit_heads` writes the model with them. Default: None.

    Inputs:
        | Texts | Labels |
        |---|---|
        | what the wrapped loss takes: (anchor, positive, negative), (anchor, positive), ... | the wrapped loss's |

    Requirements:
        1. A SentenceTransformer whose first module is a Transformer, with at least 2 layers.
        2. A wrapped loss that neither embeds by itself (not the `Cached...` losses) nor picks widths or layers
           (not `MatryoshkaLoss`, `Matryoshka2dLoss` or `AdaptiveLayerLoss`: wrap their inner loss).
        3. Batches of at least one row; the similarity KL compares texts within a batch, so it needs two or more.

    Example:
        ```python
        from datasets import Dataset
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        from matryoshka2d.st_losses import TwoDMSELoss

        model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
        triplets = Dataset.from_dict({
            "anchor": ["A man is playing a guitar.", "A woman is reading."],
            "positive": ["Someone plays music.", "A person reads a book."],
            "negative": ["A cat sleeps.", "A car drives by."],
        })
        loss = TwoDMSELoss(model, MultipleNegativesRankingLoss(model), kl_temperature=0.3)
        SentenceTransformerTrainer(model=model, train_dataset=triplets, loss=loss).train()
        ```

    References:
        - Li, Li, Li, Xie and Li, "2D Matryoshka Sentence Embeddings", arXiv 2402.14776v1
          (https://arxiv.org/abs/2402.14776v1), sec. 3, eqs. 2-7.
        - The authors' code: angle-emb (https://github.com/SeanLee97/AnglE/blob/main/README_2DMSE.md), 0.3.x's
          `AngleTDMSETrainer`; sentence-transformers' `Matryoshka2dLoss`.
    """

    method_name = "2dmse"

    @records_given_arguments
    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None = None,
        *,
        dims: list[int] | None = None,
        full_weight: float = 1.0,
        shallow_weight: float = 1.0,
        last_small_weight: float = 1.0,
        shallow_small_weight: float = 1.0,
        kl_weight: float = 1.0,
        kl_temperature: float = 0.3,
        shallow_weighting: str = "uniform",
        kl: str = "similarity",
        kl_widths: str = "both",
        kl_factor: str = "T2",
        kl_detach: bool = True,
        kl_normalize: bool | str = False,
        min_layer: int = 1,
        views: str = "paper",
        draws: str = "numpy",
        preset: str | None = None,
        seed: int | None = None,
        exit_heads: ExitHeads | None = None,
    ) -> None:
        super().__init__(model, loss, method_arguments(locals()), preset, seed, exit_heads)

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
