"""AnglE: cosine (CoSENT) + in-batch negatives + angle difference in complex space, per kind of data.

Li & Li (2023), "AnglE-optimized Text Embeddings", sec. 3: L = w1 * L_cos + w2 * L_ibn + w3 * L_angle. Each
embedding is read as a complex vector (first half real, second half imaginary); the angle term ranks pairs
by the normalised complex quotient u / v, which is 1 + 0i (angle 0) for identical directions and so does not
saturate the way cosine does near +-1.

Which terms apply to which data, and their defaults, follow the authors' code, angle-emb 0.6.1
(`angle_emb/angle.py`, class `AngleLoss`; terms in `angle_emb/loss.py`), not the paper's w1 = w2 = w3 = 1:

- triplets (angle-emb's format C: query, positive, negative):
      (ibn_w * CE(q vs positives) + cln_w * CE(q vs positives and negatives)) / 2
      + angle_w * angle ranking over (q, p) = 1, (q, n) = 0  [+ cosine_w * CoSENT over the same pairs]
  defaults cosine_w 0, ibn_w 1, cln_w 1, angle_w 0.02, every tau 20. CoSENT is off: on 0/1 pairs it only
  widens the positive-negative gap and every sentence ends in one narrow cone (issue 8: the mean cosine of
  unrelated sentences went 0.075 -> 0.880 in 60 steps).
- NLI pairs (format A with labels): cosine_w * CoSENT over the graded labels (entailment > neutral >
  contradiction) + ibn_w * in-batch negatives over all 2B texts, symmetric, the entailed pairs being the
  positives (angle-emb's `in_batch_negative_loss`) + angle_w * angle ranking over the graded labels;
  angle-emb's class defaults: cosine_w 0, ibn_w 1, angle_w 0.02, taus 20. (Its NLI recipe in the README
  passes ibn_w 30, angle_w 1: the `--loss-option` flags reproduce it.)
- scored pairs (STS-B style similarity scores): CoSENT, which is what such labels are for (cosine_w 1), plus
  angle_w 0.02; no in-batch negatives (ibn_w 0): angle-emb would call every pair with int(score) != 0 a
  positive, which on a 0-5 scale makes "1.2 = barely related" a positive. Set ibn_weight to enable it anyway.

Any weight or scale passed explicitly applies to every kind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matryoshka2d.losses.batch import ENTAILMENT, EmbeddedBatch
from matryoshka2d.losses.cosent import ranking_loss
from matryoshka2d.losses.infonce import in_batch_cross_entropy

# angle-emb 0.6.1 AngleLoss defaults, per data kind (see the module docstring for the scored-pair exception).
DEFAULTS = {
    "triplets": {"cosine_weight": 0.0, "ibn_weight": 1.0, "cln_weight": 1.0, "angle_weight": 0.02},
    "nli": {"cosine_weight": 0.0, "ibn_weight": 1.0, "cln_weight": 0.0, "angle_weight": 0.02},
    "scored": {"cosine_weight": 1.0, "ibn_weight": 0.0, "cln_weight": 0.0, "angle_weight": 0.02},
}
SCALE = 20.0  # angle-emb's cosine_tau, ibn_tau and angle_tau


def angle_scores(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """|sum of the components of (u / v) * |v| / |u||, with u, v read as complex vectors: 1 for equal directions."""
    half = u.shape[-1] // 2
    a, b = u[:, :half], u[:, half : 2 * half]
    c, d = v[:, :half], v[:, half : 2 * half]
    denom = (c**2 + d**2).sum(-1, keepdim=True).clamp_min(1e-12)
    re, im = (a * c + b * d) / denom, (b * c - a * d) / denom
    norm_ratio = ((a**2 + b**2).sum(-1, keepdim=True) / denom).sqrt().clamp_min(1e-12)
    return ((re + im) / norm_ratio).sum(-1).abs()


def symmetric_in_batch_negatives(u: torch.Tensor, v: torch.Tensor, positive: torch.Tensor, scale: float):
    """angle-emb's in-batch negative loss on pairs: each of the 2B texts picks its partner among the other 2B - 1.

    Only texts of a positive pair have a target; the others contribute 0 but still count in the mean over 2B
    rows, as in angle-emb (so a batch with few positives gives a small loss, not a noisy one).
    """
    texts = F.normalize(torch.cat([u, v]), dim=-1)
    logits = texts @ texts.T * scale
    logits = logits.masked_fill(torch.eye(len(texts), dtype=torch.bool, device=texts.device), float("-inf"))
    b = len(u)
    partner = torch.cat([torch.arange(b, 2 * b), torch.arange(0, b)]).to(texts.device)
    has_target = torch.cat([positive, positive]).float()
    per_row = F.cross_entropy(logits, partner, reduction="none")
    return (per_row * has_target).sum() / len(texts)


class AnglELoss(nn.Module):
    def __init__(
        self,
        cosine_weight: float | None = None,
        ibn_weight: float | None = None,
        cln_weight: float | None = None,
        angle_weight: float | None = None,
        cosine_scale: float = SCALE,
        ibn_scale: float = SCALE,
        angle_scale: float = SCALE,
    ):
        super().__init__()
        self.given = {
            key: value
            for key, value in (
                ("cosine_weight", cosine_weight),
                ("ibn_weight", ibn_weight),
                ("cln_weight", cln_weight),
                ("angle_weight", angle_weight),
            )
            if value is not None
        }
        self.cosine_scale, self.ibn_scale, self.angle_scale = cosine_scale, ibn_scale, angle_scale

    def weights(self, kind: str) -> dict[str, float]:
        """The term weights used on data of this kind: angle-emb's defaults, overridden by what was given."""
        if kind not in DEFAULTS:
            raise ValueError(f"the angle loss trains on triplets, NLI pairs or scored pairs, not {kind} data")
        return {**DEFAULTS[kind], **self.given}

    def forward(self, batch: EmbeddedBatch) -> torch.Tensor:
        w = self.weights(batch.kind)
        u, v, labels = batch.scored_pairs()
        total = u.new_zeros(())
        if batch.kind == "triplets":
            anchors, positives, negatives = batch.columns
            target = torch.arange(len(anchors), device=anchors.device)
            contrastive = u.new_zeros(())
            if w["ibn_weight"]:
                contrastive = contrastive + w["ibn_weight"] * in_batch_cross_entropy(
                    anchors, positives, target, self.ibn_scale
                )
            if w["cln_weight"]:
                candidates = torch.cat([positives, negatives])
                contrastive = contrastive + w["cln_weight"] * in_batch_cross_entropy(
                    anchors, candidates, target, self.ibn_scale
                )
            total = total + contrastive / 2
        elif w["ibn_weight"]:
            first, second = batch.columns
            positive = batch.labels == ENTAILMENT if batch.kind == "nli" else batch.labels.float().int() != 0
            total = total + w["ibn_weight"] * symmetric_in_batch_negatives(first, second, positive, self.ibn_scale)
        if w["cosine_weight"]:
            total = total + w["cosine_weight"] * ranking_loss(F.cosine_similarity(u, v, -1) * self.cosine_scale, labels)
        if w["angle_weight"] and u.shape[-1] >= 2:
            total = total + w["angle_weight"] * ranking_loss(angle_scores(u, v) * self.angle_scale, labels)
        return total

    def describe(self, kind: str) -> str:
        w = self.weights(kind)
        terms = {
            "triplets": f"(in-batch {w['ibn_weight']:g} + with hard negatives {w['cln_weight']:g}) / 2",
            "nli": f"in-batch negatives {w['ibn_weight']:g} (entailed pairs)",
            "scored": f"in-batch negatives {w['ibn_weight']:g}",
        }[kind]
        source = "weights given over angle-emb 0.6.1's defaults" if self.given else "angle-emb 0.6.1 terms"
        scales = f"scales {self.cosine_scale:g}/{self.ibn_scale:g}/{self.angle_scale:g}"
        return f"{terms}, CoSENT {w['cosine_weight']:g}, angle {w['angle_weight']:g}, {scales} ({source} for {kind})"
