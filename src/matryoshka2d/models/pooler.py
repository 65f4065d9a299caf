"""A pooler head that compresses a sentence vector from D to d numbers: fully connected D -> d, then tanh.

Wang et al., "On the Dimensionality of Sentence Embeddings", sec. 3 and Figure 1: BERT/RoBERTa's pooler is a
fully connected D x D layer with a tanh on top of the pooled [CLS] state; changing its output size to d makes
it a compressor whose output is the sentence embedding. Here the head sits on whatever pooling the model uses
(mean for minilm-l6, cls for BERT-style CLS models) and after any layer exit, so `encode(layer=n)` gives the
head applied to layer n's pooled vector.

On disk the head is a sentence-transformers `Dense` module folder (e.g. `2_Dense/`): `config.json` with
in_features, out_features, bias and activation_function, and `model.safetensors` holding `linear.weight`
(d x D) and `linear.bias` (d). That is the format `sentence_transformers.base.modules.dense.Dense.save` writes in
sentence-transformers 6.2, so `SentenceTransformer(path)` loads the same head and gives the same embeddings.

A fresh head is initialised as BERT initialises its pooler (weights ~ N(0, 0.02), bias 0; `initializer_range`
of the BERT/RoBERTa configs), from a seeded generator so that runs are reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from matryoshka2d.confined import ConfinedFolder, OutsideFolderError
from matryoshka2d.models.backbones import POOLING_MODES, BackboneError
from matryoshka2d.outputs import make_folder, write_text, writing

# The activations a Dense module may declare that we reproduce exactly (class paths as sentence-transformers
# writes them with `fullname(...)`).
ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.linear.Identity": nn.Identity,
}
TANH = "torch.nn.modules.activation.Tanh"


class PoolerHead(nn.Module):
    """y = tanh(W x + b), W of shape (d, D): the dimensionality paper's pooler with output size d."""

    def __init__(self, in_features: int, out_features: int, activation: str = TANH, bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise BackboneError(
                f"pooler activation '{activation}' is not supported; supported: {', '.join(sorted(ACTIVATIONS))}"
            )
        self.in_features, self.out_features, self.activation_name = in_features, out_features, activation
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = ACTIVATIONS[activation]()

    @classmethod
    def fresh(cls, in_features: int, out_features: int, seed: int = 0, std: float = 0.02) -> PoolerHead:
        check_pooler_dim(out_features, in_features)
        head = cls(in_features, out_features)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.linear.weight.normal_(0.0, std, generator=generator)
            head.linear.bias.zero_()
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x.to(self.linear.weight.dtype)))

    def describe(self) -> str:
        act = self.activation_name.rsplit(".", 1)[-1].lower()
        return f"dense {self.in_features}->{self.out_features} {act}"

    # ---- the sentence-transformers Dense folder ---------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        out = make_folder(Path(folder))
        config = {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.linear.bias is not None,
            "activation_function": self.activation_name,
        }
        write_text(out / "config.json", json.dumps(config, indent=2))
        tensors = {"linear.weight": self.linear.weight.detach().float().cpu().contiguous()}
        if self.linear.bias is not None:
            tensors["linear.bias"] = self.linear.bias.detach().float().cpu().contiguous()
        with writing(out / "model.safetensors") as tmp:
            save_file(tensors, str(tmp))
        return out

    @classmethod
    def load(cls, folder: str | Path) -> PoolerHead:
        from safetensors.torch import load_file

        folder = Path(folder)
        try:  # read only inside itself: its links are checked before anything there is opened
            confined = ConfinedFolder(folder, "Dense module")
            config_file, weights = confined.path("config.json"), confined.path("model.safetensors")
        except OutsideFolderError as exc:
            raise BackboneError(str(exc)) from None
        if not config_file.is_file():
            raise BackboneError(f"{folder}: a Dense module folder needs config.json")
        config = json.loads(config_file.read_text())
        missing = [k for k in ("in_features", "out_features") if k not in config]
        if missing:
            raise BackboneError(f"{config_file}: missing {', '.join(missing)}")
        if not weights.is_file():
            found = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth"})
            hint = f" (found {', '.join(found)}; convert it to safetensors)" if found else ""
            raise BackboneError(f"Missing weights: {folder} has no model.safetensors{hint}")
        head = cls(
            int(config["in_features"]),
            int(config["out_features"]),
            activation=config.get("activation_function", TANH),
            bias=bool(config.get("bias", True)),
        )
        if config.get("use_residual"):
            raise BackboneError(f"{config_file}: Dense modules with use_residual are not supported")
        state = load_file(str(weights))
        try:
            head.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise BackboneError(f"{weights}: not the weights of a {head.describe()} layer ({exc})") from None
        return head


def check_pooler_dim(dim, hidden: int) -> int:
    """A pooler output size must be a positive integer no larger than the hidden size it compresses."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise BackboneError(f"pooler dim must be an integer, got {dim!r}")
    dim = int(dim)
    if not 1 <= dim <= hidden:
        raise BackboneError(
            f"pooler dim {dim} is out of range: the head compresses the model's {hidden} hidden numbers to 1..{hidden}"
        )
    return dim


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool token states (B, T, H) into sentence vectors (B, H), ignoring padding."""
    if mode == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last-token":
        # Index of the last real token in each row; works for left and right padding alike.
        last = attention_mask.shape[1] - 1 - attention_mask.flip(1).int().argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise BackboneError(f"Unknown pooling '{mode}'; choose one of {', '.join(POOLING_MODES)}")
