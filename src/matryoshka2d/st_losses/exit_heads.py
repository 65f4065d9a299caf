"""Exit heads trained along in sentence-transformers' trainer, and the folder that keeps them.

Our exit heads (`matryoshka2d.models.heads.ExitHeads`) map a shallow layer's pooled vector into the last layer's
space. Inside a loss they are a submodule, so `SentenceTransformerTrainer` trains them with the model (their own
learning rate through its `learning_rate_mapping`, e.g. {r"exit_heads": 5e-4}). A sentence-transformers pipeline
has one exit, the last layer, so the heads do not live in its modules.json: `save_with_exit_heads` writes the
trained model as our folder (exit_heads.safetensors, their record in matryoshka2d.json) that `eval`, `pick`,
`export` and `serve` read; a cell exported from it carries its head as a plain sentence-transformers Dense module.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from torch import nn

from matryoshka2d.methods import Method
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.st_losses.layer_states import check_layout, layer_count, unwrap

PLAIN_MODULES = ("Transformer", "Pooling", "Normalize")


def _check_plain(model: nn.Module, owner: str) -> None:
    """Heads map the pooled vector of a layer to the model's output: a pipeline of Transformer, Pooling and
    Normalize, where the two are the same size."""
    extra = [type(m).__name__ for m in model if type(m).__name__ not in PLAIN_MODULES]
    if extra:
        raise ValueError(
            f"{owner}: exit heads map a layer's pooled vector to the output, which {', '.join(extra)} changes; "
            "heads fit a model of Transformer, Pooling and Normalize"
        )


def exit_heads_for(model: nn.Module, kind: str = "affine") -> ExitHeads:
    """Exit heads to train along with the model: one at every exit below the last layer, each starting as the
    identity (the exit's own vector), on the model's device; pass them to a loss as `exit_heads=`.

    Args:
        model: the SentenceTransformer being trained: Transformer, Pooling and optionally Normalize (a head maps a
            layer's pooled vector to the output, which any other module would change).
        kind: each head's form: "affine" (y = W x + b) or "mlp" (the affine map plus a residual MLP whose output
            starts at zero). Default: "affine".

    Returns:
        The heads, at layers 1..N-1, mapping the model's width to itself.

    Example:
        ```python
        heads = exit_heads_for(model)
        loss = StarbucksLoss(model, exit_heads=heads)
        args = SentenceTransformerTrainingArguments(..., learning_rate_mapping={r"exit_heads": 5e-4})
        SentenceTransformerTrainer(model=model, args=args, train_dataset=triplets, loss=loss).train()
        save_with_exit_heads(model, heads, "runs/st-starbucks-heads")
        ```
    """
    backbone = unwrap(model)
    check_layout(backbone, "exit_heads_for")
    _check_plain(backbone, "exit_heads_for")
    width = backbone.get_embedding_dimension()
    heads = ExitHeads.identity(range(1, layer_count(backbone)), width, width, kind)
    return heads.to(next(backbone.parameters()).device)


def check_heads(heads: ExitHeads | None, method: Method, owner: str) -> ExitHeads | None:
    """The heads given to a loss, checked to map this model's exits (1..N-1) from and to its width."""
    if heads is None:
        return None
    if heads.inputs != "exit":
        raise ValueError(f"{owner}: exit heads that read several layers (inputs={heads.inputs}) are not supported here")
    if heads.dim_out != method.hidden_size or heads.dim_in != method.hidden_size:
        raise ValueError(
            f"{owner}: exit heads map {heads.dim_in} -> {heads.dim_out}; this model's vectors have {method.hidden_size}"
        )
    if bad := [n for n in heads.layers if not 1 <= n < method.num_layers]:
        raise ValueError(f"{owner}: exit heads at layers {bad}; the model's exits are 1..{method.num_layers - 1}")
    return heads


def save_with_exit_heads(model: nn.Module, heads: ExitHeads, output: str | Path) -> Path:
    """The trained model and its heads as one new model folder, which `matryoshka2d eval`, `pick`, `export` and
    `serve` read (a cell exported from it carries its head as a Dense module).

    Args:
        model: the trained SentenceTransformer (Transformer, Pooling, optionally Normalize).
        heads: the heads trained along (`exit_heads_for(model)`, or the loss's `exit_heads`).
        output: the new folder; it must not exist yet.

    Returns:
        The folder written.
    """
    backbone = unwrap(model)
    _check_plain(backbone, "save_with_exit_heads")
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"{output} exists: save_with_exit_heads writes a new model folder, choose another path")
    with tempfile.TemporaryDirectory(prefix="matryoshka2d-st-heads-") as staging:
        backbone.save(staging)
        encoder = ElasticEncoder(staging, device="cpu")
        encoder.set_exit_heads(heads.to("cpu"))
        return encoder.save(output)
