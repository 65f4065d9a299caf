"""2dmse: 2D Matryoshka Sentence Embeddings (Li et al., 2024, sec. 3).

Each step samples a shallow layer n ~ U(1, N-1) (eq. 3) and a width d from the nested set below D, the
geometric series 8, 16, 32, ... (sec. 3.2), and puts the task loss on four views (eqs. 2-5):
(N, D), (n, D), (N, d), (n, d). The alignment term (eq. 6) is KLDiv(L_n^D, L_N^D) + KLDiv(L_n^d, L_N^d): the
shallow view's in-batch similarity distribution is pulled towards the last layer's at the same width, the
last layer acting as a detached teacher. The objectives are summed with weights lambda (eq. 7); the paper
gives no values, so all default to 1. The KL temperature is not given either; 0.3 is the value of
sentence-transformers' Matryoshka2dLoss and of Starbucks' STS setting.

Options that give the reference code's choices (presets st-matryoshka2d and 2dmse-authors use them):
- `kl_normalize` (False, True, "auto"): the features KL on L2-normalised vectors. sentence-transformers 6.2
  (`sentence_transformer/losses/adaptive_layer.py`, ForwardDecorator L61-81) takes the KL of
  `sentence_embedding`, the output after every module, so for all-MiniLM-L6-v2 (Transformer, Pooling,
  Normalize) it compares unit vectors. "auto" normalises when the backbone's pipeline does. A full-width
  vector is normalised, then sliced to the compared width. No effect on the similarity KL (cosines).
- `min_layer` (1): the shallow layer n is drawn from min_layer..N-1. sentence-transformers draws from
  hidden_states[0..N-1] (adaptive_layer.py L251-254), 0 being the embedding output.
- `views` ("paper"): "st" trains sentence-transformers' two views instead of the four of eqs. 2-5: the last
  layer at one random width and layer n at another, each drawn from the dims and D
  (Matryoshka2dLoss = AdaptiveLayerLoss(MatryoshkaLoss(n_dims_per_step=1)), matryoshka_2d.py L124-140;
  matryoshka.py L237-239 draws a width at every call). It compares the layers at full width only.
- `draws` ("numpy"): with views="st", "python" draws as sentence-transformers does, from one Python
  `random.Random(seed)` for the whole run, three `sample` calls a step in its order: the last layer's width
  (MatryoshkaLoss, matryoshka.py L237-239), the prior layer (adaptive_layer.py L251-254), that layer's width,
  each an index into the widths largest first. Given the same seed, at the same point, a run draws the
  library's layers and widths step for step (benchmarks/peer_st_matryoshka2d.py seeds `random` just before its
  first step). A resumed run replays the draws of the steps before it.
"""

from __future__ import annotations

import random

import numpy as np

from matryoshka2d.cells import nested_dims
from matryoshka2d.losses.align import FACTORS, feature_kl, similarity_kl
from matryoshka2d.methods.base import Method, Plan, States, View, check_normalize, kl_features


class TwoDMSE(Method):
    name = "2dmse"
    summary = "each step: last + one random shallow layer, full + one random width, KL from last layer"
    settings = (
        "dims weights_full_shallow_lastsmall_shallowsmall=weights kl_weight kl_temperature shallow_weighting "
        "kl=kl_kind kl_widths kl_factor kl_detach kl_normalize min_layer views draws"
    )

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
        kl_normalize: bool | str = False,
        min_layer: int = 1,
        views: str = "paper",
        draws: str = "numpy",
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
            ("views", views, ("paper", "st")),
            ("draws", draws, ("numpy", "python")),
        ):
            if value not in allowed:
                raise ValueError(f"2dmse: {option} must be one of {', '.join(allowed)}, got '{value}'")
        if isinstance(min_layer, bool) or not isinstance(min_layer, int) or not 0 <= min_layer < num_layers:
            raise ValueError(f"2dmse: min_layer must be an integer within 0..{num_layers - 1}, got {min_layer!r}")
        if min_layer == 0 and shallow_weighting == "inverse":
            raise ValueError("2dmse: shallow_weighting=inverse divides by n, so it needs min_layer 1 or more")
        if views == "st" and kl_widths != "full":
            raise ValueError(
                "2dmse: views=st compares the layers at full width only, as sentence-transformers does; "
                "set kl_widths=full"
            )
        self.shallow_weighting, self.kl_kind, self.kl_widths = shallow_weighting, kl, kl_widths
        self.kl_factor, self.kl_detach = kl_factor, bool(kl_detach)
        self.kl_normalize, self.min_layer, self.views = check_normalize(self.name, kl_normalize), min_layer, views
        if draws == "python" and views != "st":
            raise ValueError("2dmse: draws=python draws sentence-transformers' views in its order; set views=st")
        self.draws = draws
        self._python: tuple[int, int, random.Random] | None = None  # (seed, next step, its generator)

    def adapt_to_backbone(self, pooling: str, normalizes: bool) -> list[str]:
        if self.kl_normalize == "auto":
            self.kl_normalize = bool(normalizes)
        return []

    def generator(self, seed: int, step: int):
        if self.draws == "numpy":
            return super().generator(seed, step)
        if self._python is None or self._python[:2] != (seed, step):  # a new run or a resumed one: replay
            rng = random.Random(seed)
            for _ in range(step):
                self._st_draws(rng)
            self._python = (seed, step, rng)
        rng = self._python[2]
        self._python = (seed, step + 1, rng)
        return rng

    def _st_draws(self, rng: random.Random) -> tuple[int, int, int]:
        """(last layer's width, prior layer, its width) as sentence-transformers draws them."""
        widths = sorted({*self.dims, self.hidden_size}, reverse=True)
        d = widths[rng.sample(range(len(widths)), 1)[0]]
        n = rng.sample(range(self.min_layer, self.num_layers), 1)[0]
        d_shallow = widths[rng.sample(range(len(widths)), 1)[0]]
        return d, n, d_shallow

    def plan(self, rng: np.random.Generator) -> Plan:
        if isinstance(rng, random.Random):  # draws="python"
            d, n, d_shallow = self._st_draws(rng)
            return self._st_plan(n, d, d_shallow)
        n = int(rng.integers(self.min_layer, self.num_layers))  # U(1, N-1) by default, inclusive
        d = int(self.dims[rng.integers(len(self.dims))])
        N, D = self.num_layers, self.hidden_size
        if self.views == "st":  # one width for the last layer's loss (d), another for layer n's, from dims and D
            widths = [*self.dims, D]
            d, d_shallow = int(widths[rng.integers(len(widths))]), int(widths[rng.integers(len(widths))])
            return self._st_plan(n, d, d_shallow)
        w_full, w_shallow, w_last_small, w_shallow_small = self.weights
        if self.shallow_weighting == "inverse":
            w_shallow, w_shallow_small = w_shallow / n, w_shallow_small / n
        views = [View(N, D, w_full), View(n, D, w_shallow), View(N, d, w_last_small), View(n, d, w_shallow_small)]
        return Plan(views, info={"n": n, "d": d})

    def _st_plan(self, n: int, d: int, d_shallow: int) -> Plan:
        """sentence-transformers' two views: the last layer at width d, layer n at width d_shallow."""
        w_full, w_shallow = self.weights[0], self.weights[1]
        if self.shallow_weighting == "inverse":
            w_shallow = w_shallow / n
        views = [View(self.num_layers, d, w_full), View(n, d_shallow, w_shallow)]
        return Plan(views, info={"n": n, "d": d, "d_n": d_shallow})

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
                    kl_features(states[n], width, self.kl_normalize),
                    kl_features(states[N], width, self.kl_normalize),
                    self.kl_temperature,
                    self.kl_factor,
                    self.kl_detach,
                )
            kl = value if kl is None else kl + value
        return self.kl_weight * kl, {"kl": kl.detach()}
