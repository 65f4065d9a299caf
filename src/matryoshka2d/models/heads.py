"""Exit heads: one small learned map per exit layer l < N, from the pooled layer-l vector into the model's output
space (what the last layer gives). A cell (l, d) is then the first d numbers of head_l(pool_l(x)).

A head may read more than its own layer: with inputs="stack" the head of exit l reads the pooled vectors of the
embedding output and of every layer up to l, side by side ([pool_0, pool_1, ..., pool_l]). An exit at l runs those
layers anyway, so the input costs one pooling per layer; the head has (l + 1) x D inputs. The embedding layer and
the early layers keep lexical detail that the exit's own layer has already mixed away ("first-last average"
pooling of BERT-flow and WhiteningBERT rests on the same observation); in closed form on all-MiniLM-L6-v2 a
stacked head gains 0.6-1.3 STS points over a head on the exit's layer alone (docs/exit-heads.md).

A pooled shallow layer lives in another space than the last layer; a plain affine map recovers most of the gap.
Fitted in closed form (ridge regression onto the last layer's own vectors, no labels) on all-MiniLM-L6-v2, it
lifts the STS average at (3,128) from about 50 to about 71 (docs/exit-heads.md). The last layer has no head.

Saved in a model folder and loaded from it by matryoshka2d.models.heads_on_disk; fitted in closed form by
matryoshka2d.models.heads_fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn

from matryoshka2d.models.backbones import BackboneError

HEADS_FILE = "exit_heads.safetensors"
RECORD_KEY = "exit_heads"  # in matryoshka2d.json
KINDS = ("affine", "mlp")
INPUTS = ("exit", "stack")  # what a head reads: the exit's pooled vector, or those of layers 0..exit side by side


class HeadsError(BackboneError):
    """Exit heads that cannot be fitted, loaded or used; the message says which file or option and why."""


class ExitHead(nn.Module):
    """An affine map y = W x + b; the MLP kind adds a residual y += V gelu(U x + c) (V starts at zero, so an
    MLP head starts as its affine part)."""

    def __init__(self, dim_in: int, dim_out: int, kind: str = "affine", hidden: int | None = None):
        super().__init__()
        if kind not in KINDS:
            raise HeadsError(f"exit head kind '{kind}' is not known; choose one of {', '.join(KINDS)}")
        self.kind = kind
        self.linear = nn.Linear(dim_in, dim_out)
        if kind == "mlp":
            hidden = hidden or dim_in
            self.up = nn.Linear(dim_in, hidden)
            self.down = nn.Linear(hidden, dim_out, bias=False)
            nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.kind == "mlp":
            y = y + self.down(nn.functional.gelu(self.up(x)))
        return y


class ExitHeads(nn.Module):
    """One ExitHead per exit layer; `forward(layer, pooled)` maps layer `layer`'s pooled vectors (a tensor), or,
    for heads that read several layers (inputs="stack"), the pooled vectors of the layers `reads(layer)` names
    (a mapping layer -> tensor)."""

    def __init__(
        self,
        layers: Iterable[int],
        dim_in: int,
        dim_out: int,
        kind: str = "affine",
        hidden: int | None = None,
        inputs: str = "exit",
    ):
        super().__init__()
        if inputs not in INPUTS:
            raise HeadsError(f"exit head inputs '{inputs}' are not known; choose one of {', '.join(INPUTS)}")
        self.layers = sorted({int(n) for n in layers})
        self.dim_in, self.dim_out, self.kind, self.inputs = dim_in, dim_out, kind, inputs
        self.hidden = (hidden or dim_in) if kind == "mlp" else None
        self.heads = nn.ModuleDict(
            {str(n): ExitHead(self.in_features(n), dim_out, kind, self.hidden) for n in self.layers}
        )
        self.record: dict = {}  # how the heads were made (fit options, data, held-out errors), saved with them

    @classmethod
    def identity(
        cls, layers: Iterable[int], dim_in: int, dim_out: int, kind: str = "affine", inputs: str = "exit"
    ) -> ExitHeads:
        """Heads that start as the identity on the exit's own pooled vector (the first dim_out numbers when the
        sizes differ; a stacked head starts with zero weight on the other layers)."""
        heads = cls(layers, dim_in, dim_out, kind, inputs=inputs)
        with torch.no_grad():
            for head in heads.heads.values():
                head.linear.weight.zero_()
                head.linear.weight[:, -dim_in:].copy_(torch.eye(dim_out, dim_in))  # the exit's own layer is last
                head.linear.bias.zero_()
        heads.record = {"init": "identity"}
        return heads

    def reads(self, layer: int) -> list[int]:
        """The layers whose pooled vectors the head of `layer` reads, in the order they are stacked."""
        return list(range(0, layer + 1)) if self.inputs == "stack" else [layer]

    def in_features(self, layer: int) -> int:
        return self.dim_in * len(self.reads(layer))

    def gather(self, layer: int, pooled):
        """The input of the head of `layer`: the layer's pooled vectors (a tensor or array), or the layers it reads
        side by side, taken from a mapping layer -> vectors (torch tensors or numpy arrays)."""
        if not isinstance(pooled, Mapping):
            if self.inputs == "exit":
                return pooled
            raise HeadsError(
                f"the exit head of layer {layer} reads the pooled vectors of layers {self.reads(layer)}; it was "
                "given those of one layer only"
            )
        parts = [pooled[n] for n in self.reads(layer)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=-1) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts, axis=-1)

    def has(self, layer: int) -> bool:
        return str(layer) in self.heads

    def forward(self, layer: int, pooled) -> torch.Tensor:
        head = self.heads[str(layer)]
        return head(self.gather(layer, pooled).to(head.linear.weight.dtype))

    def describe(self) -> str:
        reads = ", each reading layers 0..its exit" if self.inputs == "stack" else ""
        return (
            f"{self.kind} exit heads at layers {','.join(map(str, self.layers))} ({self.dim_in} -> {self.dim_out}"
            f"{reads})"
        )

    def bytes_per_cell(self, dim: int, layer: int | None = None) -> int:
        """float32 bytes one exported cell of width `dim` keeps of its head (the first dim output rows); for
        stacked heads, of the head of `layer` (default the deepest)."""
        dim_in = self.in_features(layer if layer is not None else max(self.layers, default=1))
        params = dim * dim_in + dim  # W[:dim], b[:dim]
        if self.kind == "mlp":
            params += self.hidden * dim_in + self.hidden + dim * self.hidden
        return 4 * params
