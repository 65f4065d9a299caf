"""ese: Espresso Sentence Embeddings (Li et al., ESE, sec. 3.2-3.4), as the paper writes it or as its authors'
code (angle-emb 0.6.1, `AngleESETrainer` in `angle_emb/angle.py`) runs it.

Total = alpha * L_express + beta * L_compress (eq. 7; alpha = beta = 1 in the paper, sec. 4 "ESE setup").

Learn-to-express (eq. 2), plus the full-size loss of plain training:
    loss(X_N^D) + S * sum_{i in shallow} w_i * loss(X_i^k) + loss(X_N^k),  k = 128 (sec. 4).
The first term, (N, D), is angle-emb's (`compute_loss` L528); the paper's eqs. 2 and 7 do not have it:
`full_loss=false` drops it.
Two readings of "shallow", `layers=`:
  - "paper": the transformer layers i = 1 .. N-1, w_i = 1 / (1 + ln i) (eq. 2).
  - "angle-emb": hidden_states[0 .. N-2], i.e. the embedding output and layers 1 .. N-2, weight
    1 / (1 + ln(1 + i)) (`compute_student_loss` loops `for i in range(n_layers - 1)`).
and S, `shallow_mean=`: 1 in the paper; 1 / (number of shallow layers) in angle-emb, which divides the whole
shallow sum (task and compression terms) by N - 1.
With `dynamic_weights` (the ICLR draft's first implementation) the w_i are learned: w = sum(w0) *
softmax(theta), theta initialised at log(w0), so learning moves weight between layers but cannot shrink all
of them to zero.

Learn-to-compress (eqs. 3-6). For each layer i the batch's full embeddings X (B x D, every column of the
batch) give the inner-dependency matrix A = softmax(X^T X / sqrt(D)), D x D (how angle-emb reads eq. 3,
which writes X X^T for a single vector). A_k = U[:, :k] S[:k] from A's SVD; the target is X A_k (B x k),
detached, and the first-k slice X[:, :k] is aligned to it with MSE + KL (softmax over the k components,
temperature T), weighted like the layer's task term (the last layer: 1, eq. 6).
`compress_target=`:
  - "dependency": X A_k as above, the paper's and angle-emb's target.
  - "scaled" (ours): the same direction, each row rescaled to the norm of the row's own first k numbers. A is
    close to uniform at the last layer (its rows are a softmax over 384 similar logits), so ||X A_k|| is about
    0.10 where ||X[:, :k]|| is 2.76 (issue 8): the unscaled target mostly pulls the first k numbers to zero,
    which costs the last layer 2.4 points on the protocol. Rescaling keeps what the target says (the shape of
    the compressed vector) and drops what it says by accident (its size).
  (Real principal directions of the centred batch are not offered: a batch of 32 triplets has 96 vectors, so
  at most 95 of the k = 128 principal directions exist.)
The SVD (`pca=`): "exact" (torch.linalg.svd, one batched call) or "lowrank", angle-emb's
`torch.svd_lowrank(A, q=k)` (`pca_compress` L475: niter 2, a random sketch drawn from torch's global
generator, one call per layer). Singular vectors have no sign of their own, and the target X U_k S_k flips
with them, which changes the MSE and the KL; `pca_sign=`:
  - "fixed": each column of U turned so that its entry of largest magnitude is positive (scikit-learn's
    `svd_flip(u_based_decision=True)`, sklearn/utils/extmath.py L964-972), so the target is the same from
    any SVD routine, step after step;
  - "raw": the signs as the routine returns them: random with "lowrank" (a new sketch every call), as in
    angle-emb.
`kl_factor=`: the KL term times T (angle-emb's `compute_distillation_loss`) or T^2 (Hinton et al.'s
distillation, our first reading); they agree at T = 1, the default of both.
`beta=`: see docs/reproduction.md for the ablation that picked the default.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from matryoshka2d.losses.align import mse_kl
from matryoshka2d.methods.base import Method, Plan, States, View

LAYER_READINGS = ("paper", "angle-emb")
TARGETS = ("dependency", "scaled")
SVDS = ("exact", "lowrank")
SIGNS = ("fixed", "raw")


def fixed_signs(u: torch.Tensor) -> torch.Tensor:
    """Each column of u (..., D, k) times the sign of its entry of largest magnitude (sklearn's svd_flip)."""
    largest = torch.gather(u, -2, u.abs().argmax(dim=-2, keepdim=True))
    return u * torch.where(largest < 0, -1.0, 1.0).to(u.dtype)


@torch.no_grad()
def pca_targets(
    xs: list[torch.Tensor],
    k: int,
    scaled: bool = False,
    svd: str = "exact",
    sign: str = "fixed",
    q: int | None = None,
    niter: int = 2,
) -> list[torch.Tensor]:
    """Each X (B x D) -> X A_k (B x k), A_k the top-k singular directions of softmax(X^T X / sqrt(D)) times S.

    "exact": one batched SVD for every layer (a D x D matrix each), one call per step, not per layer.
    "lowrank": torch.svd_lowrank per layer with q (default k) and niter as angle-emb calls it.
    With `scaled`, each target row gets the norm of the same row's first k numbers.
    """
    x = torch.stack([t.detach().float() for t in xs])  # (L, B, D)
    dependency = torch.softmax(x.transpose(1, 2) @ x / math.sqrt(x.shape[-1]), dim=-1)
    if svd == "exact":
        u, s, _ = torch.linalg.svd(dependency, full_matrices=False)
    else:  # one call per layer, each drawing its own sketch, as angle-emb's per-layer pca_compress
        parts = [torch.svd_lowrank(a, q=q or k, niter=niter) for a in dependency]
        u, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    u = u[..., :k]
    if sign == "fixed":
        u = fixed_signs(u)
    target = x @ (u * s[:, None, :k])
    if scaled:
        target = target * (x[..., :k].norm(dim=-1, keepdim=True) / target.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return [t.to(xs[0].dtype) for t in target]


def pca_target(x: torch.Tensor, k: int) -> torch.Tensor:
    """The paper's target for one layer (kept for callers that need a single matrix)."""
    return pca_targets([x], k)[0]


class ESE(Method):
    name = "ese"
    summary = "loss at every layer at width k (weights 1/(1+ln i)) + first-k aligned to a PCA target"
    settings = (
        "k alpha beta layers=layers_reading shallow_mean compress_target kl_factor dynamic_weights=dynamic "
        "kl_temperature full_loss pca pca_sign"
    )

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        k: int = 128,
        alpha: float = 1.0,
        beta: float = 0.0,
        dynamic_weights: bool = False,
        kl_temperature: float = 1.0,
        layers: str = "paper",
        shallow_mean: bool = False,
        compress_target: str = "scaled",
        kl_factor: str = "T2",
        full_loss: bool = True,
        pca: str = "exact",
        pca_sign: str = "fixed",
    ):
        super().__init__(num_layers, hidden_size)
        if not 1 <= k <= hidden_size:
            raise ValueError(f"ese: compression size k={k} must be within 1..{hidden_size}")
        for option, value, allowed in (
            ("layers", layers, LAYER_READINGS),
            ("compress_target", compress_target, TARGETS),
            ("pca", pca, SVDS),
            ("pca_sign", pca_sign, SIGNS),
        ):
            if value not in allowed:
                raise ValueError(f"ese: {option} must be one of {', '.join(allowed)}, got '{value}'")
        if kl_factor not in ("T", "T2"):
            raise ValueError(f"ese: kl_factor must be T or T2, got '{kl_factor}'")
        self.k, self.alpha, self.beta, self.kl_temperature = k, alpha, beta, kl_temperature
        self.layers_reading, self.shallow_mean = layers, shallow_mean
        self.compress_target, self.kl_factor = compress_target, kl_factor
        self.dynamic = dynamic_weights
        self.full_loss, self.pca, self.pca_sign = bool(full_loss), pca, pca_sign
        if layers == "paper":
            self.shallow = list(range(1, num_layers))
            default = [1 / (1 + math.log(i)) for i in self.shallow]
        else:
            self.shallow = list(range(0, num_layers - 1))
            default = [1 / (1 + math.log(1 + i)) for i in self.shallow]
        self.register_buffer("default_weights", torch.tensor(default))
        self.theta = nn.Parameter(self.default_weights.log().clone()) if dynamic_weights else None

    def adapt_to_backbone(self, pooling: str, normalizes: bool) -> list[str]:
        if self.layers_reading == "angle-emb" and pooling == "cls":
            return [
                "ese layers=angle-emb trains hidden_states[0], the embedding output, whose [CLS] vector (cls pooling) "
                "is the same for every sentence but for dropout: that term cannot rank anything (angle-emb's "
                "compute_student_loss does the same; layers=paper or mean pooling avoids it)"
            ]
        return []

    def layer_weights(self) -> torch.Tensor:
        """The weights of the shallow layers, in the order of `self.shallow`; the last layer is unweighted."""
        if self.theta is None:
            return self.default_weights
        return self.default_weights.sum() * torch.softmax(self.theta, dim=0)

    def plan(self, rng) -> Plan:
        N, D, k = self.num_layers, self.hidden_size, self.k
        # The weights of shallow views are applied in loss(), where learned weights keep their gradient.
        views = [*([View(N, D)] if self.full_loss else []), *(View(i, k) for i in self.shallow), View(N, k)]
        return Plan(views)

    def loss(self, plan: Plan, states: States, task_loss):
        N, D, k = self.num_layers, self.hidden_size, self.k
        scale = 1.0 / len(self.shallow) if self.shallow_mean and self.shallow else 1.0
        weights = [scale * w for w in self.layer_weights()]
        layers = [*self.shallow, N]
        layer_weight = dict(zip(layers, [*weights, 1.0], strict=True))
        parts: dict[str, float] = {}
        express = None
        if self.full_loss:  # angle-emb's (N, D) term; not in the paper's eqs. 2 and 7
            express = task_loss(states[N])
            parts[f"task({N},{D})"] = express.detach()
        for i in layers:
            value = task_loss(states[i].sliced(k))
            parts[f"task({i},{k})"] = value.detach()
            express = layer_weight[i] * value if express is None else express + layer_weight[i] * value
        total = self.alpha * express
        if self.beta:
            xs = [torch.cat(states[i].columns) for i in layers]
            targets = pca_targets(xs, k, self.compress_target == "scaled", self.pca, self.pca_sign)
            compress = None
            for i, x, target in zip(layers, xs, targets, strict=True):
                align = mse_kl(x[:, :k], target, self.kl_temperature, factor=self.kl_factor)
                parts[f"compress{i}"] = align.detach()
                term = layer_weight[i] * align
                compress = term if compress is None else compress + term
            total = total + self.beta * compress
        if self.theta is not None:
            parts.update({f"w{i}": w for i, w in zip(self.shallow, self.layer_weights().detach(), strict=True)})
        return total, parts

    def config(self) -> dict:
        return {**super().config(), "layer_weights": [round(float(w), 4) for w in self.layer_weights().detach()]}
