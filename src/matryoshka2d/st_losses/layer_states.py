"""Every layer's pooled vector from one forward pass of a sentence-transformers model.

What our trainer hands a method (`methods.base.States`: layer -> the batch's pooled full-width vectors), built
here from a `SentenceTransformer` inside its own trainer. The transformer runs once with its hidden states on
(as sentence-transformers' `AdaptiveLayerLoss` runs it, `TransformerDecorator.call_grow_cache`); each layer the
plan asks for goes through the modules after the transformer (Pooling, Dense, ...), Normalize left out: the
methods' terms see the pooled vectors as our trainer's do, and a `kl_normalize` option normalises where a
reference does. Layer 0 is the embedding output, layer i the output of the i-th transformer layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from torch import Tensor, nn


def unwrap(model: nn.Module) -> BaseModel:
    """The SentenceTransformer inside DistributedDataParallel (`.module`) or torch.compile (`._orig_mod`), as
    sentence-transformers' AdaptiveLayerLoss.forward unwraps it."""
    while not isinstance(model, BaseModel):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            raise TypeError(f"cannot find a SentenceTransformer inside {type(model).__name__}")
        model = inner
    return model


def check_layout(model: nn.Module, loss: str) -> None:
    """The layout these losses read: a Transformer first, then modules that map one vector per text."""
    first = model[0]
    if not isinstance(first, Transformer):
        raise ValueError(
            f"{loss}: the model's first module is {type(first).__name__}, not a Transformer; a loss over layers "
            "needs the transformer's hidden states (a query/document Router pair trains each side as its own model)"
        )


def pooling_mode(model: nn.Module) -> str:
    """The Pooling module's mode ("mean", "cls", ...), for `Method.adapt_to_backbone`."""
    for module in model:
        if isinstance(module, Pooling):
            return str(getattr(module, "pooling_mode", "mean"))
    return "mean"


def normalizes(model: nn.Module) -> bool:
    return any(isinstance(module, Normalize) for module in model)


def layer_count(model: nn.Module) -> int:
    config = model[0].auto_model.config
    count = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not count:
        raise ValueError(f"cannot read the number of layers from {type(config).__name__}")
    return int(count)


def layer_states(model: nn.Module, features: dict[str, Tensor], layers: Iterable[int]) -> dict[int, Tensor]:
    """{layer: (batch, hidden)} pooled vectors of one column of a batch, from one forward pass."""
    transformer = model[0]
    config = transformer.auto_model.config
    before = config.output_hidden_states
    try:
        config.output_hidden_states = True
        output = transformer(dict(features))
    finally:
        config.output_hidden_states = before
    hidden = output["all_layer_embeddings"]
    after = [module for module in list(model)[1:] if not isinstance(module, Normalize)]
    states = {}
    for layer in layers:
        layer_output = {**output, "token_embeddings": hidden[layer]}
        layer_output.pop("sentence_embedding", None)
        for module in after:
            layer_output = module(layer_output)
        states[layer] = layer_output["sentence_embedding"]
    return states


def column_states(model: nn.Module, sentence_features: Iterable[dict[str, Tensor]], layers) -> list[dict]:
    """Per column of the batch, {layer: pooled vectors}: one forward pass per column, as sentence-transformers'
    own layer losses embed (AdaptiveLayerLoss disables column merging)."""
    layers = sorted(set(layers))
    return [layer_states(model, features, layers) for features in sentence_features]


def as_float(states: list[dict[int, Tensor]]) -> list[dict[int, Tensor]]:
    """The methods' arithmetic (similarities, softmaxes, PCA) in fp32, as our trainer runs it under autocast."""
    return [{layer: t.float() if t.dtype != torch.float32 else t for layer, t in column.items()} for column in states]
