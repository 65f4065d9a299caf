"""2dmse: 2D Matryoshka Sentence Embeddings (Li et al., 2024, sec. 3).

Each step samples a shallow layer n ~ U(1, N-1) (eq. 3) and a width d from the nested set below D, the
geometric series 8, 16, 32, ... (sec. 3.2), and puts the task loss on four views (eqs. 2-5):
(N, D), (n, D), (N, d), (n, d). The alignment term (eq. 6) is KLDiv(L_n^D, L_N^D) + KLDiv(L_n^d, L_N^d): the
shallow view's in-batch similarity distribution is pulled towards the last layer's at the same width, the
last layer acting as a detached teacher. The objectives are summed with weights lambda (eq. 7); the paper
gives no values, so all default to 1. The KL temperature is not given either; 0.3 is the value of
sentence-transformers' Matryoshka2dLoss and of Starbucks' STS setting.
"""

from __future__ import annotations

import numpy as np
import torch

from matryoshka2d.losses.align import FACTORS, feature_kl, similarity_kl
from matryoshka2d.methods.base import Method, Plan, States
from matryoshka2d.views import View, nested_dims


class TwoDMSE(Method):
    name = "2dmse"
    summary = "each step: last + one random shallow layer, full + one random width, KL from last layer"

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
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
    ):
        super().__init__(num_layers, hidden_size)
        if num_layers < 2:
            raise ValueError("2dmse needs a backbone with at least 2 layers (it samples n from 1..N-1)")
        self.dims = sorted(d for d in (dims or nested_dims(hidden_size)) if d < hidden_size)
        if not self.dims:
            raise ValueError(f"2dmse needs at least one width below the hidden size {hidden_size}")
        self.weights = (full_weight, shallow_weight, last_small_weight, shallow_small_weight)
        self.kl_weight, self.kl_temperature = kl_weight, kl_temperature
        for option, value, allowed in (
            ("shallow_weighting", shallow_weighting, ("uniform", "inverse")),
            ("kl", kl, ("similarity", "features")),
            ("kl_widths", kl_widths, ("both", "full")),
            ("kl_factor", kl_factor, FACTORS),
        ):
            if value not in allowed:
                raise ValueError(f"2dmse: {option} must be one of {', '.join(allowed)}, got '{value}'")
        self.shallow_weighting, self.kl_kind, self.kl_widths = shallow_weighting, kl, kl_widths
        self.kl_factor, self.kl_detach = kl_factor, bool(kl_detach)

    def plan(self, rng: np.random.Generator) -> Plan:
        n = int(rng.integers(1, self.num_layers))  # U(1, N-1), inclusive
        d = int(self.dims[rng.integers(len(self.dims))])
        N, D = self.num_layers, self.hidden_size
        w_full, w_shallow, w_last_small, w_shallow_small = self.weights
        if self.shallow_weighting == "inverse":
            w_shallow, w_shallow_small = w_shallow / n, w_shallow_small / n
        views = [View(N, D, w_full), View(n, D, w_shallow), View(N, d, w_last_small), View(n, d, w_shallow_small)]
        return Plan(views, info={"n": n, "d": d})

    def widths(self) -> set[int]:
        return {*self.dims, self.hidden_size}

    def extra_loss(self, plan: Plan, states: States):
        if not self.kl_weight:
            return None, {}
        n, d, N = plan.info["n"], plan.info["d"], self.num_layers
        widths = [self.hidden_size] if self.kl_widths == "full" else [self.hidden_size, d]
        kl = None
        for width in widths:
            student, teacher = states[n].sliced(width), states[N].sliced(width)
            if self.kl_kind == "similarity":
                value = similarity_kl(student, teacher, self.kl_temperature, self.kl_factor, self.kl_detach)
            else:
                value = feature_kl(
                    torch.cat(student.columns),
                    torch.cat(teacher.columns),
                    self.kl_temperature,
                    self.kl_factor,
                    self.kl_detach,
                )
            kl = value if kl is None else kl + value
        return self.kl_weight * kl, {"kl": kl.detach()}

    def config(self) -> dict:
        return {
            "method": self.name,
            "dims": self.dims,
            "weights_full_shallow_lastsmall_shallowsmall": list(self.weights),
            "kl_weight": self.kl_weight,
            "kl_temperature": self.kl_temperature,
            "shallow_weighting": self.shallow_weighting,
            "kl": self.kl_kind,
            "kl_widths": self.kl_widths,
            "kl_factor": self.kl_factor,
            "kl_detach": self.kl_detach,
        }
