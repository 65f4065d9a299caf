"""ese: Espresso Sentence Embeddings (Li et al., ESE, sec. 3.2-3.4).

Total = alpha * L_express + beta * L_compress (eq. 7; alpha = beta = 1, sec. 4 "ESE setup").

Learn-to-express (eq. 2), plus the full-size loss of plain training:
    loss(X_N^D) + sum_{i<N} w_i * loss(X_i^k) + loss(X_N^k),  w_i = 1 / (1 + ln i),
where layer i = 1 is the first transformer layer (not the embedding output) and k = 128 (sec. 4). With
`dynamic_weights` (the ICLR draft's first implementation) the w_i are learned: w = S * softmax(theta), with
theta initialised at log(1 / (1 + ln i)) and S the sum of the default weights, so that learning moves weight
between layers but cannot shrink all of them to zero.

Learn-to-compress (eqs. 3-6). For each layer i the batch's full embeddings X (B x D, every column of the
batch) give the inner-dependency matrix A = softmax(X^T X / sqrt(D)), D x D. We read eq. 3 this way (the
paper writes X X^T for a single d x 1 vector, which would be d x d too) because it is how the authors' own
implementation computes it. A = U S V^T; A_k = U[:, :k] S[:k, :k] (D x k); the target is X A_k (B x k),
detached. The first-k slice X[:, :k] is aligned to it with MSE + KL (KL between softmax over the k
components, temperature 1), weighted w_i for i < N and 1 for the last layer (eq. 6).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from matryoshka2d.losses.align import mse_kl
from matryoshka2d.methods.base import Method, Plan, States
from matryoshka2d.views import View


def pca_target(x: torch.Tensor, k: int) -> torch.Tensor:
    """X (B x D) -> X A_k (B x k), A_k the top-k singular directions of softmax(X^T X / sqrt(D)) scaled by S."""
    x = x.detach().float()
    dependency = torch.softmax(x.T @ x / math.sqrt(x.shape[-1]), dim=-1)
    u, s, _ = torch.linalg.svd(dependency, full_matrices=False)
    return x @ (u[:, :k] * s[:k])


class ESE(Method):
    name = "ese"
    summary = "loss at every layer at width k (weights 1/(1+ln i)) + first-k aligned to a PCA target"

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        k: int = 128,
        alpha: float = 1.0,
        beta: float = 1.0,
        dynamic_weights: bool = False,
        kl_temperature: float = 1.0,
    ):
        super().__init__(num_layers, hidden_size)
        if not 1 <= k <= hidden_size:
            raise ValueError(f"ese: compression size k={k} must be within 1..{hidden_size}")
        self.k, self.alpha, self.beta, self.kl_temperature = k, alpha, beta, kl_temperature
        self.dynamic = dynamic_weights
        default = torch.tensor([1 / (1 + math.log(i)) for i in range(1, num_layers)])
        self.register_buffer("default_weights", default)
        self.theta = nn.Parameter(default.log().clone()) if dynamic_weights else None

    def layer_weights(self) -> torch.Tensor:
        """w_1 .. w_{N-1}; the last layer is unweighted."""
        if self.theta is None:
            return self.default_weights
        return self.default_weights.sum() * torch.softmax(self.theta, dim=0)

    def plan(self, rng) -> Plan:
        N, D, k = self.num_layers, self.hidden_size, self.k
        # The weights of shallow views are applied in loss(), where learned weights keep their gradient.
        views = [View(N, D), *(View(i, k) for i in range(1, N)), View(N, k)]
        return Plan(views)

    def loss(self, plan: Plan, states: States, task_loss):
        N, D, k = self.num_layers, self.hidden_size, self.k
        weights = self.layer_weights()
        parts: dict[str, float] = {}
        express = task_loss(states[N])
        parts[f"task({N},{D})"] = float(express.detach())
        compress = None
        for i in range(1, N + 1):
            w = weights[i - 1] if i < N else 1.0
            value = task_loss(states[i].sliced(k))
            parts[f"task({i},{k})"] = float(value.detach())
            express = express + w * value
            if self.beta:
                x = torch.cat(states[i].columns)
                align = mse_kl(x[:, :k], pca_target(x, k), self.kl_temperature)
                parts[f"compress{i}"] = float(align.detach())
                compress = w * align if compress is None else compress + w * align
        total = self.alpha * express + (self.beta * compress if compress is not None else 0.0)
        if self.theta is not None:
            parts.update({f"w{i}": float(w) for i, w in enumerate(weights.detach().tolist(), start=1)})
        return total, parts

    def config(self) -> dict:
        return {
            "method": self.name,
            "k": self.k,
            "alpha": self.alpha,
            "beta": self.beta,
            "dynamic_weights": self.dynamic,
            "layer_weights": [round(float(w), 4) for w in self.layer_weights().detach()],
            "kl_temperature": self.kl_temperature,
        }
