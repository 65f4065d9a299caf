"""What a task loss sees: the embeddings of one view of one batch, and the batch's labels.

Four shapes of training data reach a loss (see matryoshka2d.training.data):
- triplets: columns [anchor, positive, negative], no labels;
- pairs: columns [anchor, positive], no labels (the batch's other positives are the negatives);
- scored pairs: columns [sentence1, sentence2], labels = float similarity scores;
- NLI pairs: columns [premise, hypothesis], labels = class ids (0 entailment, 1 neutral, 2 contradiction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ENTAILMENT, NEUTRAL, CONTRADICTION = 0, 1, 2
NLI_LABELS = {"entailment": ENTAILMENT, "neutral": NEUTRAL, "contradiction": CONTRADICTION}


@dataclass
class EmbeddedBatch:
    columns: list[torch.Tensor]  # each (B, d)
    kind: str  # "triplets" | "pairs" | "scored" | "nli"
    labels: torch.Tensor | None = None

    def scored_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every batch as (u, v, score) pairs with 'higher score = more similar', for ranking losses.

        Triplets give (anchor, positive, 1) and (anchor, negative, 0); NLI pairs rank entailment above neutral
        above contradiction.
        """
        if self.kind == "triplets":
            a, p, n = self.columns
            ones, zeros = torch.ones(len(a), device=a.device), torch.zeros(len(a), device=a.device)
            return torch.cat([a, a]), torch.cat([p, n]), torch.cat([ones, zeros])
        if self.kind == "pairs":
            raise ValueError(
                "anchor/positive pairs have no scores or negatives to rank; train them with --loss infonce"
            )
        u, v = self.columns
        if self.kind == "nli":
            return u, v, (CONTRADICTION - self.labels).float()
        return u, v, self.labels.float()

    def positives_and_candidates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(anchors, candidates, index of each anchor's positive among candidates) for in-batch negatives.

        Triplets: candidates are all positives then all hard negatives. Pairs: all positives. NLI pairs:
        premises whose hypothesis is entailed, against every hypothesis of the batch. Scored pairs have no defined
        positives: None.
        """
        if self.kind == "triplets":
            a, p, n = self.columns
            return a, torch.cat([p, n]), torch.arange(len(a), device=a.device)
        if self.kind == "pairs":
            a, p = self.columns
            return a, p, torch.arange(len(a), device=a.device)
        if self.kind == "nli":
            u, v = self.columns
            keep = (self.labels == ENTAILMENT).nonzero(as_tuple=True)[0]
            if len(keep) == 0:
                return None
            return u[keep], v, keep
        return None

    def similarity_logits(self) -> torch.Tensor:
        """Cosine similarities of each first-column row against every row of the other columns, (B, B*(c-1)).

        This in-batch similarity distribution is what the KL alignment terms of 2DMSE and Starbucks compare.
        """
        first = torch.nn.functional.normalize(self.columns[0], dim=-1)
        others = torch.nn.functional.normalize(torch.cat(self.columns[1:]), dim=-1)
        return first @ others.T

    def sliced(self, dim: int) -> EmbeddedBatch:
        return EmbeddedBatch([c[:, :dim] for c in self.columns], self.kind, self.labels)
