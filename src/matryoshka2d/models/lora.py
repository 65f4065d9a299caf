"""LoRA fine-tuning through peft (ESE sec. 4: r 32, alpha 32, dropout 0.1, lr 2e-4).

The trained model is saved with the adapter merged into the weights (an ordinary model folder), and the adapter
itself is saved beside it in `lora_adapter/`; `load_adapter()` builds an encoder from the base model plus that
adapter, unmerged.
"""

from __future__ import annotations

import json
from pathlib import Path

from matryoshka2d.confined import ConfinedFolder, OutsideFolderError
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.decoders import is_bidirectional, set_bidirectional
from matryoshka2d.outputs import move_into_place, remove_tree, temporary_folder, write_text

ADAPTER_DIR = "lora_adapter"
ADAPTER_INFO = "matryoshka2d_adapter.json"


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


def save_and_merge_lora(encoder, out: str | Path) -> Path | None:
    """Write the adapter to out/lora_adapter, then merge it into the weights so that the encoder (and what it
    saves next) is a plain model. Returns the adapter folder, or None if the encoder has no LoRA."""
    peft_model = encoder.__dict__.get("lora_model")
    if peft_model is None:
        return None
    target = Path(out) / ADAPTER_DIR
    staging = temporary_folder(Path(out), ADAPTER_DIR)  # peft writes into it; moved into place when whole
    try:
        peft_model.save_pretrained(str(staging))
        info = {
            "base_model": encoder.location or encoder.name,
            "pooling": encoder.pooling,
            "max_length": encoder.max_length,
            "bidirectional": is_bidirectional(encoder.model),
        }
        write_text(staging / ADAPTER_INFO, json.dumps(info, indent=2))
        remove_tree(target)
        move_into_place(staging, target)
    finally:
        remove_tree(staging)
    encoder.model = peft_model.merge_and_unload()
    encoder.__dict__["lora_model"] = None
    return target


def load_adapter(adapter_dir: str | Path, base: str | None = None, device=None):
    """An ElasticEncoder of the base model with the saved LoRA adapter applied and not merged."""
    from peft import PeftModel

    from matryoshka2d.models.encoder import ElasticEncoder

    root = Path(adapter_dir)
    try:  # the adapter's folder is read only inside itself (its links checked before peft opens anything there)
        folder = ConfinedFolder(root, "LoRA adapter")
        if folder.path(ADAPTER_DIR, root, "the adapter folder").is_dir():
            root = root / ADAPTER_DIR
            folder = ConfinedFolder(root, "LoRA adapter")
        info_file = folder.path(ADAPTER_INFO, root, "the adapter record")
    except OutsideFolderError as exc:
        raise BackboneError(str(exc)) from None
    if not info_file.is_file():
        raise BackboneError(f"{root} is not a LoRA adapter saved by matryoshka2d train (no {ADAPTER_INFO})")
    info = json.loads(info_file.read_text(encoding="utf-8"))
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
