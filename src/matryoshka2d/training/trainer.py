"""The training loop: any backbone, any method, any task loss; AdamW, linear warm-up and decay, clipping,
periodic STS-B dev evaluation, atomic checkpoints and an exact resume.

Why our own loop and not sentence-transformers' trainer: a method asks for a different set of views every
step and needs the pooled state of several layers from one forward pass that stops at the deepest of them;
the trainer's loss interface gives a loss the model, not those states. The loop is short, and the saved
model is an ordinary sentence-transformers folder.

Determinism: the data order of epoch e is a permutation drawn from (seed, e); the method's sampling at step s
uses a generator seeded with (seed, s) and torch (dropout) is reseeded with (seed, s) too. A resumed run
therefore sees exactly the batches, samples and dropout masks of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from matryoshka2d import checkpoints
from matryoshka2d.data import TrainingData, read_training_data
from matryoshka2d.encoder import ElasticEncoder
from matryoshka2d.losses import make_task_loss
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import Method, make_method
from matryoshka2d.parallel import Processes
from matryoshka2d.throughput import Prefetcher, adamw, autocast, grad_scaler, private_tokenizer, resolve_precision

# The loss a run uses when none is given, per kind of training data (matryoshka2d.data). AnglE's terms depend
# on the kind too (losses/angle.py): angle-emb 0.6.1's format C for triplets, format A for labelled pairs.
DEFAULT_LOSSES = {
    "triplets": ("angle", "AnglE as angle-emb trains triplets: in-batch negatives with and without hard negatives"),
    "nli": ("angle", "AnglE as angle-emb trains labelled pairs: in-batch negatives over entailed pairs"),
    "scored": ("angle", "AnglE for similarity scores: CoSENT on the scores plus the angle term"),
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
)
# What makes a folder "hold a model or a run": `train` does not write into it without --resume or --overwrite.
RUN_MARKERS = (
    "train_log.jsonl",
    "checkpoints",
    "matryoshka2d.json",
    "modules.json",
    "config.json",
    "model.safetensors",
)


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
    max_grad_norm: float = 1.0
    seed: int = 42
    pooling: str | None = None
    max_length: int | None = None
    eval_steps: int = 0  # 0: evaluate only at the end
    eval_file: str | None = None  # STS-B dev by default
    eval_cell: list[int] | None = None  # [layer, dim]; default: the full model
    save_steps: int = 200
    keep_checkpoints: int = 2
    method_options: dict = field(default_factory=dict)
    loss_options: dict = field(default_factory=dict)
    device: str | None = None
    pooler_dim: int | None = None  # put a D -> d tanh pooler head on the encoder (dimensionality paper, sec. 3)
    freeze_encoder: bool = False  # train only the pooler head (and the loss's own parameters): two-step, step 2
    # decoder backbones (ESE sec. 3.1; matryoshka2d.decoders)
    bidirectional: bool = False  # non-causal attention in a Llama/Qwen2/Mistral backbone, saved with the model
    lora_r: int | None = None  # train LoRA adapters of this rank (peft) instead of all weights
    lora_alpha: float | None = None  # default: lora_r
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None  # default: peft's choice for the architecture
    # throughput (matryoshka2d.throughput)
    precision: str | None = None  # bf16 | fp16 | fp32; default bf16 on CUDA where supported, else fp32
    log_every: int = 10  # read the loss back from the device (a host sync) every N steps only
    gradient_accumulation: int = 1  # split each batch into this many micro-batches (same data, less memory)
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile the blocks inside every layer

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


def host_values(record: dict) -> dict:
    """The record with every device tensor (loss, gradient norm, the method's loss parts) read back as a float."""
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}


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
    _number(config, "seed", int, 0)
    _number(config, "max_length", int, 1, allow_none=True)
    _number(config, "eval_steps", int, 0)
    _number(config, "save_steps", int, 0)
    _number(config, "keep_checkpoints", int, 1)
    _number(config, "pooler_dim", int, 1, allow_none=True)
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
    if config.eval_cell is not None and (
        not isinstance(config.eval_cell, (list, tuple))
        or len(config.eval_cell) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in config.eval_cell)
    ):
        raise ValueError(f"eval_cell must be [layer, dim] (two positive integers), got {config.eval_cell!r}")
    if config.lr_schedule not in ("linear", "cosine"):
        raise ValueError(f"lr_schedule must be 'linear' or 'cosine', got '{config.lr_schedule}'")
    check_device(config.device)


def sts_dev_score(encoder: ElasticEncoder, path: str | Path, layer: int, dim: int) -> float:
    """Spearman x 100 of cosine vs gold on one STS file (sentence1, sentence2, score), at one cell."""
    from matryoshka2d.evaluate.sts import load_pairs, spearman_x100

    pairs = load_pairs(path)
    n = len(pairs.sentences1)
    vectors = encoder.encode(pairs.sentences1 + pairs.sentences2, layer=layer, dim=dim, normalize=True)
    return spearman_x100(pairs.gold, (vectors[:n] * vectors[n:]).sum(1))


class Trainer:
    supports_processes = True  # data-parallel over torchrun's processes (matryoshka2d.parallel)

    def __init__(self, config: TrainConfig):
        self.config = config
        self.out = Path(config.output)
        check_config(config)
        self.check_eval_file()
        self.processes = Processes.from_env(config.device)
        if self.processes.active and not self.supports_processes:
            raise ValueError(f"{type(self).__name__} runs in one process; start it without --processes or torchrun")
        config.device = self.processes.device(config.device)
        self.encoder = ElasticEncoder(
            config.model, pooling=config.pooling, max_length=config.max_length, device=config.device
        )
        self._prepare_pooler()
        self._prepare_decoder()
        if config.eval_cell is not None:
            self.encoder.check_layer(config.eval_cell[0]), self.encoder.check_dim(config.eval_cell[1])
        self.method = self.build_method()
        self.loss_name = config.loss or self.default_loss()
        self.task_loss = self.build_task_loss()
        self.data: TrainingData = self.read_data()
        self.steps_per_epoch = math.ceil(len(self.data) / config.batch_size)
        self.total_steps = config.steps or max(1, math.ceil(config.epochs * self.steps_per_epoch))
        self._prepare_loss_parameters()
        params = [p for m in (self.encoder, self.method, self.task_loss) for p in m.parameters() if p.requires_grad]
        self._prepare_throughput()
        self.optimizer = adamw(params, config.lr, config.weight_decay, self.encoder.device)
        warmup = int(config.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factory(warmup))
        if self.processes.active:
            self.processes.broadcast_from_main([self.encoder, self.method, self.task_loss])
        self.step = 0
        self.history: list[dict] = []

    # ---- what is trained, on what (subclasses such as the SMAE pre-trainer replace these) ---------------

    def build_method(self) -> Method:
        return make_method(
            self.config.method, self.encoder.num_layers, self.encoder.hidden_size, **self.config.method_options
        )

    def default_loss(self) -> str:
        """The loss for the kind of data given (DEFAULT_LOSSES); the run says which it picked and why."""
        kind = read_training_data(self.config.data).kind
        name, why = DEFAULT_LOSSES[kind]
        if self.processes.main:
            print(f"loss: {name} (default for {kind} data: {why}; --loss to choose another)")
        return name

    def build_task_loss(self) -> torch.nn.Module:
        return make_task_loss(self.loss_name, **self.config.loss_options)

    def read_data(self) -> TrainingData:
        """The training rows; losses that learn from plain sentences (simcse) get every file read as sentences."""
        wants_sentences = bool(getattr(self.task_loss, "needs_sentences", False))
        data = read_training_data(self.config.data, sentences=wants_sentences)
        if data.kind == "sentences" and not wants_sentences:
            raise ValueError(
                f"{data.sources[0]} holds plain sentences; they train only with a loss that learns from sentences "
                f"(--loss simcse), not '{self.loss_name}'"
            )
        return data

    def _prepare_pooler(self) -> None:
        """A pooler head of size pooler_dim (kept if the model already has one that size), and the freeze."""
        dim = self.config.pooler_dim
        if dim is not None:
            head = self.encoder.head
            if head is None or head.out_features != dim:
                if head is not None:
                    print(f"replacing the model's {head.describe()} head by a fresh {dim}-dim pooler")
                self.encoder.add_pooler(dim, seed=self.config.seed)
        if self.config.freeze_encoder:
            if self.encoder.head is None:
                raise ValueError("freeze_encoder trains only the pooler head: give pooler_dim or a model with one")
            for p in self.encoder.model.parameters():
                p.requires_grad_(False)

    def _prepare_decoder(self) -> None:
        """ESE sec. 3.1 for decoder LLMs: bidirectional attention and LoRA (mean pooling is their default)."""
        from matryoshka2d.decoders import add_lora, set_bidirectional

        cfg = self.config
        if cfg.bidirectional:
            set_bidirectional(self.encoder.model, self.encoder.name)
        if cfg.lora_r is not None:
            if cfg.freeze_encoder:
                raise ValueError("lora_r and freeze_encoder exclude each other: LoRA trains adapters in the encoder")
            add_lora(self.encoder, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules, cfg.lora_dropout)

    def _prepare_throughput(self) -> None:
        cfg, device = self.config, self.encoder.device
        for name in ("log_every", "gradient_accumulation"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
        if cfg.gradient_accumulation > cfg.batch_size:
            raise ValueError(
                f"gradient_accumulation {cfg.gradient_accumulation} splits a batch of {cfg.batch_size} into "
                "micro-batches; it cannot exceed batch_size"
            )
        self.precision = resolve_precision(cfg.precision, device)
        self.scaler = grad_scaler(self.precision, device)
        if cfg.gradient_checkpointing:
            if not getattr(self.encoder.model, "supports_gradient_checkpointing", False):
                raise ValueError(f"gradient_checkpointing: {self.encoder.name} does not support it")
            self.encoder.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.compile:
            # Compile the blocks inside each layer, not the model: the exits cut the layer stack and read each
            # layer's output with a hook, which a compiled whole model would turn into recompiles and breaks.
            from matryoshka2d.backbones import layer_stack

            for layer in layer_stack(self.encoder.model):
                for block in layer.children():
                    block.compile(dynamic=True)
        self._tokenizer = private_tokenizer(self.encoder.tokenizer)
        self._prefetch = Prefetcher(self.prepare_batch)
        self._pin = device.type == "cuda"
        self._lazy_records = False  # run() sets it: records keep device tensors until a logging step

    def _lr_factory(self, warmup: int):
        total, cosine = self.total_steps, self.config.lr_schedule == "cosine"

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress)) if cosine else max(0.0, 1.0 - progress)

        return factor

    def _prepare_loss_parameters(self) -> None:
        """Losses with per-width parameters (the softmax classifier) get them now, so AdamW sees them."""
        head = getattr(self.task_loss, "head", None)
        if head is None:
            return
        like = next(self.encoder.parameters())
        for width in self.method.widths():
            head(width, like)

    # ---- one step -----------------------------------------------------------------------------------

    def batch_indices(self, step: int) -> np.ndarray:
        epoch, position = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.data))
        return order[position * self.config.batch_size : (position + 1) * self.config.batch_size]

    def prepare_batch(self, step: int) -> list[tuple[list[dict], np.ndarray | None]]:
        """Step's rows, split into `gradient_accumulation` micro-batches, each column tokenized on the CPU
        (pinned for a fast copy to a GPU). Pure function of the step: safe to run ahead in a thread.

        Each column is tokenized and run on its own, padded to the longest text of that column rather than of
        the whole batch (premises are much longer than hypotheses): fewer padded tokens, as sentence-transformers
        does (docs/benchmarks.md, training speed)."""
        indices = self.batch_indices(step)
        micro = []
        for part in np.array_split(indices, min(self.config.gradient_accumulation, len(indices))):
            columns, labels = self.data.rows(part)  # labels of the whole part: every process computes its loss
            if self.processes.active:
                columns, _ = self.data.rows(self.processes.own_rows(part))
            features = []
            for col in columns:
                batch = self._tokenizer(
                    list(col), padding=True, truncation=True, max_length=self.encoder.max_length, return_tensors="pt"
                )
                tensors = {k: v for k, v in batch.items() if k in self.encoder._input_names}
                features.append({k: v.pin_memory() for k, v in tensors.items()} if self._pin else tensors)
            micro.append((features, labels, len(part)))
        return micro

    def compute_loss(self, step: int, micro_batch=None) -> tuple[torch.Tensor, dict]:
        """The loss of one step (or of one micro-batch of it), on the device, and its parts."""
        # Dropout draws differ per process (their rows differ); the plan (layers, widths) is the same in all.
        torch.manual_seed(self.config.seed * 1_000_003 + step + 7919 * self.processes.rank)
        plan = self.method.plan(np.random.default_rng([self.config.seed, step, 1]))
        features, labels, rows = micro_batch if micro_batch is not None else self.prepare_batch(step)[0]
        device = self.encoder.device
        with autocast(self.precision, device):
            per_column = [
                self.encoder({k: v.to(device, non_blocking=True) for k, v in f.items()}, plan.layers) for f in features
            ]
        if self.processes.active:  # the whole batch's embeddings, own rows with their graph (parallel.py)
            local = torch.stack([torch.stack([pooled[layer] for layer in plan.layers]) for pooled in per_column])
            whole = self.processes.gather_rows(local, rows, dim=2)
            per_column = [dict(zip(plan.layers, column, strict=True)) for column in whole]
        # The method's and the task loss's arithmetic (similarities, softmaxes, ESE's PCA) runs in fp32.
        label_tensor = None if labels is None else torch.as_tensor(labels, device=device)
        states = {
            layer: EmbeddedBatch([pooled[layer].float() for pooled in per_column], self.data.kind, label_tensor)
            for layer in plan.layers
        }
        loss, parts = self.method.loss(plan, states, self.task_loss)
        parts.update({k: v for k, v in plan.info.items()})
        return loss, parts

    def train_step(self) -> dict:
        """One optimizer step. Inside run() the loss and gradient norm stay on the device (no host sync; the
        record holds tensors, read back on logging steps only); called directly, the record holds floats."""
        self.encoder.train()
        step = self.step
        micro_batches = self._prefetch.get(step, step + 1 if step + 1 < self.total_steps else None)
        total, parts_sum = None, {}
        for micro in micro_batches:
            loss, parts = self.compute_loss(step, micro)
            loss = loss / len(micro_batches)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0) + v
        parts = parts_sum if len(micro_batches) == 1 else {k: v / len(micro_batches) for k, v in parts_sum.items()}
        if self.processes.active:
            self.processes.sum_gradients([p for p in self.encoder.parameters() if p.requires_grad])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if not self._lazy_records:
            return host_values({"step": self.step, "loss": total, "grad_norm": grad_norm, **parts})
        return {"step": self.step, "loss": total, "grad_norm": grad_norm, **parts}

    # ---- evaluation, checkpoints --------------------------------------------------------------------

    def eval_path(self) -> Path:
        from matryoshka2d.paths import data_dir

        return Path(self.config.eval_file) if self.config.eval_file else data_dir() / "sts" / "raw" / "stsb_dev.tsv"

    def check_eval_file(self) -> None:
        """Read the evaluation file now: a typo must not cost a whole run (it is read again at the end)."""
        from matryoshka2d.evaluate.sts import load_pairs

        try:
            path = self.eval_path()
        except FileNotFoundError as exc:
            raise ValueError(f"no evaluation file: {exc}; pass --eval-file") from None
        try:
            load_pairs(path)
        except ValueError as exc:
            flag = "--eval-file" if self.config.eval_file else "the default evaluation file (set --eval-file)"
            raise ValueError(f"{flag}: {exc}") from None

    def evaluate(self) -> dict:
        path = self.eval_path()
        layer, dim = self.config.eval_cell or (self.encoder.num_layers, self.encoder.hidden_size)
        keep = getattr(self.method, "keep_layers", None)
        if keep:
            layer = min(layer, keep)
        score = sts_dev_score(self.encoder, path, layer, dim)
        return {"step": self.step, "eval": f"{Path(path).name}@({layer},{dim})", "spearman": round(score, 2)}

    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Write everything a resume needs (safetensors + JSON, with a manifest) into a temporary folder, then
        rename it: a kill leaves no half (matryoshka2d.checkpoints)."""
        root = self.checkpoint_dir()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step:07d}"
        tmp = root / f".tmp-step-{self.step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        checkpoints.write_checkpoint(
            tmp,
            {"encoder": self.encoder, "method": self.method, "task_loss": self.task_loss},
            self.optimizer,
            self.scheduler,
            self.step,
            self.history,
            self.saved_config(),
            scaler=self.scaler,
        )
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step-*"))[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        found = checkpoints.candidates(self.checkpoint_dir())
        return found[0] if found else None

    def saved_config(self) -> dict:
        """The run's options as JSON values, with the loss it uses even when that was the default."""
        return json.loads(json.dumps({**dataclasses.asdict(self.config), "loss": self.loss_name}))

    def check_same_run(self, checkpoint: Path, saved: dict) -> None:
        """Refuse to resume a checkpoint whose training options differ from this run's, naming each."""
        mine = self.saved_config()
        # A checkpoint written before an option existed holds that option's default.
        defaults = json.loads(json.dumps(dataclasses.asdict(TrainConfig(data=[], output=""))))
        if saved.get("loss") is None:  # written before the loss was recorded: the data's default loss
            saved = {**saved, "loss": self.default_loss()}
        differ = [
            f"{k} (checkpoint {saved.get(k, defaults.get(k))!r}, now {mine.get(k)!r})"
            for k in mine
            if k not in RESUMABLE_CHANGES and saved.get(k, defaults.get(k)) != mine.get(k)
        ]
        if differ:
            raise ValueError(
                f"cannot resume from {checkpoint}: the run differs in {'; '.join(differ)}. Resume with the "
                "checkpoint's options, or start a new run with --overwrite or another --output"
            )

    def resume(self, allow_pickle: bool = False) -> bool:
        found = checkpoints.load_latest(
            self.checkpoint_dir(), self.encoder.device, allow_pickle=allow_pickle, check_config=self.check_same_run
        )
        if found is None:
            return False
        folder, state = found
        modules = {"encoder": self.encoder, "method": self.method, "task_loss": self.task_loss}
        try:
            for name, module in modules.items():
                module.load_state_dict(state["modules"].get(name, {}))
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise checkpoints.CheckpointError(
                f"{folder}: does not fit this model ({str(exc).splitlines()[0]})"
            ) from None
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        checkpoints.restore_rng(state["rng"])
        self.step, self.history = state["step"], state["history"]
        return True

    def check_output(self, resume: bool, overwrite: bool) -> None:
        """A folder holding another model or run is not written into unless the user says so."""
        if not self.out.exists():
            return
        if not self.out.is_dir():
            raise ValueError(f"--output {self.out} is a file, not a folder")
        held = sorted(p.name for p in self.out.iterdir() if p.name in RUN_MARKERS)
        if held and not (resume or overwrite):
            raise ValueError(
                f"--output {self.out} already holds a model or a run ({', '.join(held)}); pass --resume to continue "
                "it, --overwrite to replace it, or choose another --output"
            )
        if overwrite and not resume and self.processes.main:
            shutil.rmtree(self.checkpoint_dir(), ignore_errors=True)
            (self.out / "train_log.jsonl").unlink(missing_ok=True)

    def trim_log(self) -> None:
        """After a resume, drop the log records of steps after the checkpoint: they are run again."""
        path = self.out / "train_log.jsonl"
        if not path.is_file():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= self.step:
                kept.append(line)
        tmp = path.with_name(".train_log.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)

    # ---- the run ------------------------------------------------------------------------------------

    def run(
        self, resume: bool = False, progress: bool = True, overwrite: bool = False, allow_pickle: bool = False
    ) -> Path:
        main = self.processes.main  # with several processes, rank 0 alone writes logs, checkpoints, the model
        self.check_output(resume, overwrite)
        self.out.mkdir(parents=True, exist_ok=True)
        self.processes.barrier()
        if resume:
            if self.resume(allow_pickle=allow_pickle) and main:
                print(f"resumed from step {self.step} of {self.total_steps}")
            if main:
                self.trim_log()
        log = (self.out / "train_log.jsonl").open("a", encoding="utf-8") if main else open(os.devnull, "w")  # noqa: SIM115
        start, first_step = time.perf_counter(), self.step
        bar = tqdm(
            total=self.total_steps, initial=self.step, disable=not (progress and main), desc=f"{self.config.method}"
        )
        try:
            every, pending, self._lazy_records = self.config.log_every, [], True
            while self.step < self.total_steps:
                logging = (self.step + 1) % every == 0 or self.step + 1 == self.total_steps
                pending.append(self.train_step())
                bar.update(1)
                if logging or (self.config.save_steps and self.step % self.config.save_steps == 0):
                    # One host sync for the steps since the last log: their losses were kept on the device.
                    for record in pending:
                        record.update(host_values(record))
                        self.history.append({"step": record["step"], "loss": record["loss"]})
                        log.write(json.dumps(record) + "\n")
                    bar.set_postfix(loss=f"{pending[-1]['loss']:.4f}")
                    pending = []
                if (
                    main
                    and self.config.eval_steps
                    and self.step % self.config.eval_steps == 0
                    and self.step < self.total_steps
                ):
                    result = self.evaluate()
                    log.write(json.dumps(result) + "\n")
                    bar.write(f"step {self.step}: STS {result['eval']} spearman {result['spearman']}")
                if main and self.config.save_steps and self.step % self.config.save_steps == 0:
                    self.save_checkpoint()
                log.flush()
        finally:
            bar.close()
            log.close()
            self._prefetch.close()
            self._lazy_records = False
        seconds = time.perf_counter() - start
        if not main:
            self.processes.barrier()  # until rank 0 has saved the model
            self.processes.close()
            return self.out
        final_eval = self.evaluate()
        with (self.out / "train_log.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(final_eval) + "\n")
        steps_run = self.step - first_step
        metadata = {
            "method": self.method.config(),
            "loss": self.loss_name,
            "loss_terms": self.task_loss.describe(self.data.kind) if hasattr(self.task_loss, "describe") else None,
            "training": dataclasses.asdict(self.config),
            "examples": len(self.data),
            "data_kind": self.data.kind,
            "steps": self.step,
            "seconds_this_run": round(seconds, 1),
            "seconds_per_step": round(seconds / steps_run, 4) if steps_run else None,
            "processes": self.processes.world,
            "final_eval": final_eval,
        }
        self.encoder.eval()
        from matryoshka2d.decoders import save_and_merge_lora

        keep = getattr(self.method, "keep_layers", None)

        def save(folder: Path) -> Path:
            save_and_merge_lora(self.encoder, folder)  # the adapter beside the model; the model saved merged
            return self.encoder.save(folder, keep_layers=keep, metadata=metadata)

        saved = checkpoints.save_model_atomically(save, self.out)
        self.processes.barrier()
        self.processes.close()
        return saved


def train(
    config: TrainConfig,
    resume: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    allow_pickle: bool = False,
) -> Path:
    return Trainer(config).run(resume=resume, progress=progress, overwrite=overwrite, allow_pickle=allow_pickle)
