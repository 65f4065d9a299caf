"""StarbucksLoss: Starbucks Representation Learning, SRL (Zhuang et al., arXiv 2410.13230) in
sentence-transformers' trainer."""

from __future__ import annotations

from torch import nn

from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.method_loss import MethodLoss, method_arguments, records_given_arguments


class StarbucksLoss(MethodLoss):
    """Starbucks Representation Learning (SRL): the wrapped loss on a fixed list of (layer, dim) sizes every step,
    small to large, plus a KL term from the full size to each smaller one, as `matryoshka2d train --method
    starbucks` trains it (the same `matryoshka2d.methods.Starbucks`).

    Args:
        model: the SentenceTransformer being trained.
        loss: the loss each size gets. Default: None, `TaskLoss(model, "angle")`, the loss `matryoshka2d train`
            picks for triplets (the authors train `MultipleNegativesRankingLoss`: pass it, with preset
            "starbucks-paper").
        sizes: the (layer, dim) sizes, growing in depth and width together (sorted by layer, each at least as wide
            as the one before). Default: None, the paper's six sizes for BERT-base, (2,32) (4,64) (6,128) (8,256)
            (10,512) (12,768), scaled to the model's depth and width and ending at its full size: (1,32) (2,32)
            (3,64) (4,128) (5,256) (6,384) for 6 layers x 384.
        kl_weight: the weight of the KL term; 0 turns it off. Default: 1.0.
        kl_temperature: the KL's temperature (the paper's 0.3 for STS, 1.0 for retrieval). Default: 0.3.
        kl: "similarity" (in-batch similarity distributions) or "features" (a softmax over the first d numbers of
            each text's embedding, the authors' STS code). Default: "similarity".
        kl_factor: the KL times "T2" (Hinton et al.'s distillation) or "T" (the authors' code). Default: "T2".
        kl_detach: the teacher (the largest size) gets no gradient from the KL. Default: True.
        kl_scale_logits: divide the logits by the temperature inside the softmax (the authors' features KL does
            not). Default: True.
        kl_normalize: compare unit vectors (True), the pooled ones (False), or follow the model ("auto": unit
            when it ends in Normalize). Default: False.
        kl_teacher: "largest-listed" (the largest size of `sizes`) or "full" (the last layer at full width, the
            authors' code). Default: "largest-listed".
        preset: one of our recipes, whose method options replace the defaults of the arguments not given:
            "starbucks-paper" (the KL as ielab/Starbucks' STS code computes it). Default: None.
        seed: unused: Starbucks draws nothing (kept for the signature the three losses share). Default: None.
        exit_heads: heads trained along (`st_losses.exit_heads_for(model)`): every shallow view goes through its
            exit's head; `st_losses.save_with_exit_heads` writes the model with them. Default: None.

    Inputs:
        | Texts | Labels |
        |---|---|
        | what the wrapped loss takes: (anchor, positive, negative), (anchor, positive), ... | the wrapped loss's |

    Requirements:
        1. A SentenceTransformer whose first module is a Transformer: the loss reads every layer's hidden states.
        2. A wrapped loss that neither embeds by itself (not the `Cached...` losses) nor picks widths or layers
           (not `MatryoshkaLoss`, `Matryoshka2dLoss` or `AdaptiveLayerLoss`: wrap their inner loss).
        3. Batches of at least one row; the similarity KL compares texts within a batch, so it needs two or more.

    Example:
        ```python
        from datasets import Dataset
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        from matryoshka2d.st_losses import StarbucksLoss

        model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
        triplets = Dataset.from_dict({
            "anchor": ["A man is playing a guitar.", "A woman is reading."],
            "positive": ["Someone plays music.", "A person reads a book."],
            "negative": ["A cat sleeps.", "A car drives by."],
        })
        loss = StarbucksLoss(model, MultipleNegativesRankingLoss(model), preset="starbucks-paper")
        SentenceTransformerTrainer(model=model, train_dataset=triplets, loss=loss).train()
        ```

    References:
        - Zhuang, Wang, Koopman and Zuccon, "Starbucks: Improved Training for 2D Matryoshka Embeddings", arXiv
          2410.13230 (https://arxiv.org/abs/2410.13230), sec. 3.1, eqs. 4-5.
        - The authors' code: https://github.com/ielab/Starbucks (`sts/starbucks_loss.py`).
    """

    method_name = "starbucks"

    @records_given_arguments
    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | None = None,
        *,
        sizes: list[tuple[int, int]] | None = None,
        kl_weight: float = 1.0,
        kl_temperature: float = 0.3,
        kl: str = "similarity",
        kl_factor: str = "T2",
        kl_detach: bool = True,
        kl_scale_logits: bool = True,
        kl_normalize: bool | str = False,
        kl_teacher: str = "largest-listed",
        preset: str | None = None,
        seed: int | None = None,
        exit_heads: ExitHeads | None = None,
    ) -> None:
        super().__init__(model, loss, method_arguments(locals()), preset, seed, exit_heads)

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
