"""The options of a training run (`matryoshka2d train`, YAML configs and presets), and their checks.

Everything here can be checked before a model is loaded; each error names the option.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from matryoshka2d.models.backbones import check_device
from matryoshka2d.training.throughput import WEIGHT_DECAY_EXEMPTIONS

# The loss a run uses when none is given, per kind of training data (matryoshka2d.training.data). AnglE's terms depend
# on the kind too (losses/angle.py): angle-emb 0.6.1's format C for triplets, format A for labelled pairs.
DEFAULT_LOSSES = {
    "triplets": ("angle", "AnglE as angle-emb trains triplets: in-batch negatives with and without hard negatives"),
    "nli": ("angle", "AnglE as angle-emb trains labelled pairs: in-batch negatives over entailed pairs"),
    "scored": ("angle", "AnglE for similarity scores: CoSENT on the scores plus the angle term"),
    "pairs": ("infonce", "in-batch negatives: each anchor's positive against the batch's other positives"),
    "sentences": ("simcse", "unsupervised SimCSE: plain sentences, dropout as the only noise"),
}

# Options that may change between a run and its resume: they do not change what is trained.
RESUMABLE_CHANGES = (
    "output",
    "eval_steps",
    "eval_file",
    "eval_cell",
    "save_steps",
    "keep_checkpoints",
    "device",
    # how a step is computed or logged, not what it computes
    "log_every",
    "gradient_checkpointing",
    "compile",
    "padding_free",
    "preset",  # its name only: the options it set are recorded, and compared, one by one
)
# Options naming files or folders: a resume compares what they name (resolved, or the same file by identity or
# content), not how they are spelled (`data/x.tsv`, `./data/x.tsv`, an absolute path or a link to it are one file).
PATH_OPTIONS = ("data", "model", "distill_from", "sts_data_dir")


@dataclass
class TrainConfig:
    data: list[str]
    output: str
    model: str = "minilm-l6"
    method: str = "plain"
    loss: str | None = None  # None: the default loss for the kind of training data (DEFAULT_LOSSES)
    steps: int | None = None  # None: `epochs` passes over the data
    epochs: float = 1.0
    batch_size: int = 32
    lr: float = 5e-5  # 2DMSE sec. 4 and ESE sec. 4 (BERT-based models)
    warmup_ratio: float = 0.1
    lr_schedule: str = "linear"  # linear warm-up, then "linear" or "cosine" decay to 0
    weight_decay: float = 0.01
    # "norm-and-bias": no decay on biases and norm weights (Hugging Face / sentence-transformers trainers);
    # "none" decays every weight and keeps earlier checkpoints resumable (training.throughput.decay_groups)
    weight_decay_exempt: str = "none"
    max_grad_norm: float = 1.0
    seed: int = 42
    pooling: str | None = None
    max_length: int | None = None
    eval_steps: int = 0  # 0: evaluate only at the end
    eval_file: str | None = None  # STS-B dev by default
    eval_cell: list | None = None  # [layer, dim], or a list of them ([[1, 16], [2, 32]]); default: the full model
    save_steps: int = 200
    keep_checkpoints: int = 2
    method_options: dict = field(default_factory=dict)
    loss_options: dict = field(default_factory=dict)
    device: str | None = None
    pooler_dim: int | None = None  # put a D -> d tanh pooler head on the encoder (dimensionality paper, sec. 3)
    # train only the pooler head or the exit heads (and the loss's own parameters): two-step, step 2; a query head
    freeze_encoder: bool = False
    # exit heads trained with the backbone (matryoshka2d.training.exit_heads): start "fit" | "identity" | "keep"
    exit_heads: str | None = None
    exit_heads_lr: float | None = None  # default: lr
    exit_heads_sentences: int = 20000  # training sentences the closed-form start is fitted on
    # what each head reads (models.heads.INPUTS): its exit's pooled vector ("exit", the default for fit and
    # identity) or the pooled layers 0..exit side by side ("stack"); with keep, the folder's heads decide
    exit_heads_inputs: str | None = None
    # decoder backbones (ESE sec. 3.1; matryoshka2d.models.decoders)
    bidirectional: bool = False  # non-causal attention in a Llama/Qwen2/Mistral backbone, saved with the model
    lora_r: int | None = None  # train LoRA adapters of this rank (peft) instead of all weights
    lora_alpha: float | None = None  # default: lora_r
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None  # default: peft's choice for the architecture
    # throughput (matryoshka2d.training.throughput)
    precision: str | None = None  # bf16 | fp16 | fp32; default bf16 on CUDA where supported, else fp32
    log_every: int = 10  # read the loss back from the device (a host sync) every N steps only
    # split each batch into this many micro-batches: the same loss and gradient as the whole batch, by gradient
    # caching (matryoshka2d.training.gradcache), at the price of a second forward pass; less memory
    gradient_accumulation: int = 1
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile the blocks inside every layer
    # angle-emb's in-batch duplicate filter: drop a row that repeats a text (as token ids) already in its batch
    # (training.data.without_repeated_texts); off unless a preset of angle-emb's recipes turns it on
    filter_duplicates: bool = False
    # drop every row holding a sentence of the seven STS test sets (evaluate.sts.sts_test_sentence_keys): the shared NLI
    # triplets hold 454 of them in 403 rows; off by default, as the protocol of record and the peers train on all rows
    exclude_sts_test: bool = False
    sts_data_dir: str | None = None  # where exclude_sts_test reads the STS sets (default: paths.data_dir())
    padding_free: bool | None = None  # length groups, not per-column padding (training/packing.py); None: on a CPU
    # train --distill-from T: a frozen teacher's unit vectors of each step's texts pull every trained view towards
    # them (training.teacher.TeacherTerm), weight distill_weight, comparison distill_loss (cos | mse | relational)
    distill_from: str | None = None
    distill_weight: float = 1.0
    distill_loss: str = "cos"
    preset: str | None = None  # the --preset the options came from (recorded with the model; training/presets)

    def inputs(self) -> list[tuple[str, object]]:
        """(option, path) of everything the run reads from disk, which its output must lie apart from (rule 1):
        the start model (or teacher), the training files, the evaluation file, a teacher to distill from."""
        from matryoshka2d.models.backbones import local_folder

        teacher = "--teacher" if self.method == "distill" else "--model"
        found: list[tuple[str, object]] = [(teacher, local_folder(self.model))]
        found += [("--data", d) for d in ([self.data] if isinstance(self.data, str) else self.data or [])]
        found.append(("--eval-file", self.eval_file))
        found.append(("--distill-from", local_folder(self.distill_from) if self.distill_from else None))
        return found

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


def _number(config, name: str, kinds, low=None, high=None, low_open=False, allow_none=False) -> None:
    value = getattr(config, name)
    flag = "--" + name.replace("_", "-")
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ValueError(f"{flag} must be a finite number{' (an integer)' if kinds is int else ''}, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{flag} must be {'greater than' if low_open else 'at least'} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{flag} must be at most {high}, got {value}")


def check_config(config: TrainConfig) -> None:
    """Everything about the options that can be checked before loading a model; each error names the option."""
    _number(config, "batch_size", int, 1)
    _number(config, "steps", int, 1, allow_none=True)
    _number(config, "epochs", (int, float), 0, low_open=True)
    _number(config, "lr", (int, float), 0, low_open=True)
    _number(config, "warmup_ratio", (int, float), 0, 1)
    _number(config, "weight_decay", (int, float), 0)
    _number(config, "max_grad_norm", (int, float), 0, low_open=True)
    _number(config, "seed", int, 0, 2**32 - 1)  # what numpy takes, as cli.args.seed (a --config file too)
    _number(config, "max_length", int, 1, allow_none=True)
    _number(config, "eval_steps", int, 0)
    _number(config, "save_steps", int, 0)
    _number(config, "keep_checkpoints", int, 1)
    _number(config, "pooler_dim", int, 1, allow_none=True)
    _number(config, "exit_heads_lr", (int, float), 0, low_open=True, allow_none=True)
    _number(config, "exit_heads_sentences", int, 1)
    if config.exit_heads is not None and config.exit_heads not in ("fit", "identity", "keep"):
        raise ValueError(f"--exit-heads must be fit, identity or keep, got {config.exit_heads!r}")
    if config.exit_heads is None and config.method != "distill":  # distill: None picks keep or fit
        given = [
            f
            for f, v in (("--exit-heads-lr", config.exit_heads_lr), ("--exit-heads-inputs", config.exit_heads_inputs))
            if v is not None
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} set how exit heads train; they need --exit-heads (fit, identity or keep)"
            )
    if config.exit_heads_inputs is not None and config.exit_heads_inputs not in ("exit", "stack"):
        raise ValueError(f"--exit-heads-inputs must be exit or stack, got {config.exit_heads_inputs!r}")
    _number(config, "log_every", int, 1)
    _number(config, "gradient_accumulation", int, 1)
    if config.gradient_accumulation > config.batch_size:
        raise ValueError(
            f"--gradient-accumulation {config.gradient_accumulation} splits a batch of {config.batch_size} into "
            "micro-batches; it cannot exceed --batch-size"
        )
    for name in ("method_options", "loss_options"):
        value = getattr(config, name)
        if not isinstance(value, dict):
            raise ValueError(
                f"{name} must be a mapping of key: value (in YAML, one 'key: value' per indented line; on the "
                f"command line --{name[:-1].replace('_', '-')} key=value), got {value!r}"
            )
    if isinstance(config.data, str):
        config.data = [config.data]
    if not isinstance(config.data, list) or not config.data or not all(isinstance(d, str) for d in config.data):
        raise ValueError(f"data must be a list of training files, got {config.data!r}")
    if config.eval_cell is not None:
        eval_cells(config)
    if config.weight_decay_exempt not in WEIGHT_DECAY_EXEMPTIONS:
        raise ValueError(
            f"weight_decay_exempt must be one of {', '.join(WEIGHT_DECAY_EXEMPTIONS)}, "
            f"got {config.weight_decay_exempt!r}"
        )
    for name in ("filter_duplicates", "exclude_sts_test"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(config, name)!r}")
    if config.lr_schedule not in ("linear", "cosine"):
        raise ValueError(f"lr_schedule must be 'linear' or 'cosine', got '{config.lr_schedule}'")
    if config.distill_from is not None:
        _number(config, "distill_weight", (int, float), 0, low_open=True)
        if config.distill_loss not in ("cos", "mse", "relational"):
            raise ValueError(f"--distill-loss must be cos, mse or relational, got {config.distill_loss!r}")
        if config.gradient_accumulation != 1:
            raise ValueError("--distill-from runs the teacher on each whole step; it needs --gradient-accumulation 1")
    check_device(config.device)


def eval_cells(config: TrainConfig) -> list[tuple[int, int]] | None:
    """The cells to evaluate: eval_cell is one [layer, dim] or a list of them; None: the full model."""
    value = config.eval_cell
    if value is None:
        return None

    def cell(item) -> bool:
        return (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in item)
        )

    if cell(value):
        return [tuple(value)]
    if isinstance(value, (list, tuple)) and value and all(cell(item) for item in value):
        return [tuple(item) for item in value]
    raise ValueError(
        f"eval_cell must be [layer, dim] (two positive integers) or a list of them, got {value!r}; on the command "
        "line --eval-cell 2:64 or --eval-cell 1:16,2:32"
    )


def resolved_paths(values: dict) -> dict:
    """`values` (a run's options) with each option of PATH_OPTIONS that names an existing file or folder written as
    its absolute path, links resolved: what a checkpoint records, so that a resume from another folder, or with
    the path spelled another way, compares the same file."""

    def resolved(value):
        if isinstance(value, list):
            return [resolved(item) for item in value]
        if isinstance(value, str) and value and Path(value).expanduser().exists():
            return str(Path(value).expanduser().resolve())
        return value

    return {key: resolved(value) if key in PATH_OPTIONS else value for key, value in values.items()}


def same_inputs(saved, mine) -> bool:
    """Whether two values of a PATH_OPTIONS option name the same files: equal as written or resolved, the same file
    or folder by device and inode (a hard link, a bind mount), or files of the same bytes (a copy)."""
    if isinstance(saved, list) and isinstance(mine, list):
        return len(saved) == len(mine) and all(same_inputs(a, b) for a, b in zip(saved, mine, strict=True))
    if saved == mine:
        return True
    if not (isinstance(saved, str) and isinstance(mine, str)):
        return False
    a, b = Path(saved).expanduser(), Path(mine).expanduser()
    try:
        if not (a.exists() and b.exists()):
            return False
        if a.resolve() == b.resolve() or os.path.samefile(a, b):
            return True
        if a.is_file() and b.is_file() and a.stat().st_size == b.stat().st_size:
            from matryoshka2d.files import file_sha256

            return file_sha256(a) == file_sha256(b)
    except OSError:
        return False
    return False


def check_resumable(checkpoint, saved: dict, mine: dict) -> None:
    """Refuse to resume a checkpoint whose training options (`saved`) differ from this run's, naming each;
    RESUMABLE_CHANGES may differ, and PATH_OPTIONS are compared by the files they name (same_inputs). A checkpoint
    written before an option existed holds that option's default."""
    defaults = json.loads(json.dumps(dataclasses.asdict(TrainConfig(data=[], output=""))))

    def same(key: str) -> bool:
        before, now = saved.get(key, defaults.get(key)), mine.get(key)
        return before == now or (key in PATH_OPTIONS and same_inputs(before, now))

    differ = [
        f"{k} (checkpoint {saved.get(k, defaults.get(k))!r}, now {mine.get(k)!r})"
        for k in mine
        if k not in RESUMABLE_CHANGES and not same(k)
    ]
    if differ:
        raise ValueError(
            f"cannot resume from {checkpoint}: the run differs in {'; '.join(differ)}. Resume with the "
            "checkpoint's options, or start a new run with --overwrite or another --output"
        )
