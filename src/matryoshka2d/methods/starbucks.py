"""starbucks: Starbucks Representation Learning, SRL (Zhuang et al., Starbucks, sec. 3.1).

The task loss summed over a fixed list of (layer, dim) sizes from small to large (eq. 4), plus a KL term from
the full-size (N, D) in-batch similarity distribution to each smaller listed size (eq. 5), temperature 0.3
for STS (the paper's Table 5; 1.0 for retrieval). Only the layers of the list are computed: a list ending at
layer 4 runs 4 layers.

Default list: the paper's six sizes for BERT-base (12 x 768) are (2,32) (4,64) (6,128) (8,256) (10,512)
(12,768). For another backbone we scale depth by N/12 and width by D/768, keeping at least 32 dims (the paper's
smallest cup) and ending at the full (N, D): for 6 x 384 that is (1,32) (2,32) (3,64) (4,128) (5,256) (6,384).

The KL term as the authors' STS code computes it (ielab/Starbucks `sts/starbucks_loss.py`) differs from our
first reading; each difference is an option (defaults: our reading, kept by the protocol runs in
docs/reproduction.md): `kl` "similarity" (in-batch similarity distributions) or "features" (a softmax over the
first d components of every text's embedding, their code, which applies no temperature inside the softmax:
`kl_scale_logits` false); `kl_factor` "T2" or "T" (their code multiplies by T); `kl_detach` (their teacher
keeps its gradient); `kl_normalize` (their KL sees `sentence_embedding`, the output after every module of the
sentence-transformers model, so unit vectors on a backbone that ends in Normalize; "auto" follows the
backbone; the full-width vector is normalised, then cut to d); `kl_teacher` "largest-listed" or "full" (their
teacher is the last layer's full-width vector whatever the list, `sts/starbucks_loss.py` L114-115).

Custom sizes must grow in depth and width together: sorted by layer, each size at least as wide as the one
before it, none listed twice. Their code pairs the listed layers and widths by position
(`sts/starbucks_loss.py` L120-121), so another list silently mis-pairs them there; here it is an error that
names the size.
"""

from __future__ import annotations

import itertools

from matryoshka2d.losses.align import FACTORS, feature_kl, similarity_kl
from matryoshka2d.methods.base import Method, Plan, States, View, check_normalize, kl_features

PAPER_SIZES = [(2, 32), (4, 64), (6, 128), (8, 256), (10, 512), (12, 768)]


def default_sizes(num_layers: int, hidden: int) -> list[tuple[int, int]]:
    sizes = []
    for layer, dim in PAPER_SIZES:
        n = max(1, round(layer * num_layers / 12))
        d = min(hidden, max(32, round(dim * hidden / 768 / 8) * 8))
        sizes.append((n, d))
    sizes[-1] = (num_layers, hidden)
    return sorted(set(sizes))


class Starbucks(Method):
    name = "starbucks"
    summary = "a fixed list of (layer, dim) sizes every step + KL from the full size to each (SRL)"
    settings = "sizes kl_weight kl_temperature kl=kl_kind kl_factor kl_detach kl_scale_logits kl_normalize kl_teacher"

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        sizes: list[tuple[int, int]] | None = None,
        kl_weight: float = 1.0,
        kl_temperature: float = 0.3,
        kl: str = "similarity",
        kl_factor: str = "T2",
        kl_detach: bool = True,
        kl_scale_logits: bool = True,
        kl_normalize: bool | str = False,
        kl_teacher: str = "largest-listed",
    ):
        super().__init__(num_layers, hidden_size)
        self.sizes = sorted((int(n), int(d)) for n, d in (sizes or default_sizes(num_layers, hidden_size)))
        for layer, dim in self.sizes:
            if not (1 <= layer <= num_layers and 1 <= dim <= hidden_size):
                raise ValueError(f"starbucks size ({layer},{dim}) is outside the model's {num_layers} x {hidden_size}")
        for (n0, d0), (n, d) in itertools.pairwise(self.sizes):
            if (n, d) == (n0, d0):
                raise ValueError(f"starbucks size ({n},{d}) is listed twice")
            if d < d0:
                raise ValueError(
                    f"starbucks size ({n},{d}) is narrower than ({n0},{d0}), a shallower size: sizes must grow in "
                    "depth and width together (sorted by layer, each at least as wide as the one before); got "
                    + " ".join(f"({a},{b})" for a, b in self.sizes)
                )
        if kl_teacher not in ("largest-listed", "full"):
            raise ValueError(f"starbucks: kl_teacher must be largest-listed or full, got '{kl_teacher}'")
        self.kl_weight, self.kl_temperature = kl_weight, kl_temperature
        if kl not in ("similarity", "features"):
            raise ValueError(f"starbucks: kl must be similarity or features, got '{kl}'")
        if kl_factor not in FACTORS:
            raise ValueError(f"starbucks: kl_factor must be one of {', '.join(FACTORS)}, got '{kl_factor}'")
        self.kl_kind, self.kl_factor = kl, kl_factor
        self.kl_detach, self.kl_scale_logits = bool(kl_detach), bool(kl_scale_logits)
        self.kl_normalize, self.kl_teacher = check_normalize(self.name, kl_normalize), kl_teacher

    def adapt_to_backbone(self, pooling: str, normalizes: bool) -> list[str]:
        if self.kl_normalize == "auto":
            self.kl_normalize = bool(normalizes)
        full = (self.num_layers, self.hidden_size)
        if self.kl_weight and self.kl_teacher == "largest-listed" and self.sizes[-1] != full:
            return [
                f"starbucks: the KL teacher is the largest listed size ({self.sizes[-1][0]},{self.sizes[-1][1]}), not "
                f"the full model ({full[0]},{full[1]}); kl_teacher=full makes the full model the teacher "
                "(ielab/Starbucks' code)"
            ]
        return []

    def teacher_size(self) -> tuple[int, int]:
        return (self.num_layers, self.hidden_size) if self.kl_teacher == "full" else self.sizes[-1]

    def plan(self, rng) -> Plan:
        return Plan([View(n, d) for n, d in self.sizes], extra_layers={self.teacher_size()[0]})

    def extra_loss(self, plan: Plan, states: States):
        teacher_size = self.teacher_size()  # the full model by default either way
        if not self.kl_weight:
            return None, {}
        teacher = states[teacher_size[0]].sliced(teacher_size[1])
        kl = None
        for n, d in self.sizes:
            if (n, d) == teacher_size:
                continue
            if self.kl_kind == "similarity":
                value = similarity_kl(states[n].sliced(d), teacher, self.kl_temperature, self.kl_factor, self.kl_detach)
            else:
                student, target = (
                    kl_features(states[n], d, self.kl_normalize),
                    kl_features(teacher, d, self.kl_normalize),
                )
                value = feature_kl(
                    student, target, self.kl_temperature, self.kl_factor, self.kl_detach, self.kl_scale_logits
                )
            kl = value if kl is None else kl + value
        if kl is None:
            return None, {}
        return self.kl_weight * kl, {"kl": kl.detach()}
