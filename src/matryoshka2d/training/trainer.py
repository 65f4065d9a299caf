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
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from matryoshka2d.evaluate.sts import sts_dev_score
from matryoshka2d.losses import make_task_loss
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import Method, make_method
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.paths import sts_dev_file
from matryoshka2d.training import checkpoints, exit_heads
from matryoshka2d.training.config import DEFAULT_LOSSES, TrainConfig, check_config, check_resumable
from matryoshka2d.training.data import TrainingData, read_training_data
from matryoshka2d.training.parallel import Processes
from matryoshka2d.training.rundir import RunDir
from matryoshka2d.training.throughput import (
    Prefetcher,
    adamw,
    autocast,
    grad_scaler,
    lr_schedule,
    private_tokenizer,
    resolve_precision,
)


def host_values(record: dict) -> dict:
    """The record with every device tensor (loss, gradient norm, the method's loss parts) read back as a float."""
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}


class Trainer:
    supports_processes = True  # data-parallel over torchrun's processes (matryoshka2d.training.parallel)

    def __init__(self, config: TrainConfig):
        self.config = config
        self.out = Path(config.output)
        self.run_dir = RunDir(self.out)
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
        exit_heads.prepare(self)
        params = [p for m in (self.encoder, self.method, self.task_loss) for p in m.parameters() if p.requires_grad]
        groups = exit_heads.parameter_groups(self, params)  # the heads with their own learning rate
        self._prepare_throughput()
        self.optimizer = adamw(groups, config.lr, config.weight_decay, self.encoder.device)
        warmup = int(config.warmup_ratio * self.total_steps)
        self.scheduler = lr_schedule(self.optimizer, self.total_steps, warmup, config.lr_schedule)
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
        if data.kind == "pairs" and not getattr(self.task_loss, "learns_from_pairs", False):
            raise ValueError(
                f"{data.sources[0]} holds anchor/positive pairs (no negatives); they train only with a loss that "
                f"takes its negatives from the batch (--loss infonce), not '{self.loss_name}'"
            )
        if data.kind == "sentences" and not wants_sentences:
            raise ValueError(
                f"{data.sources[0]} holds plain sentences; they train only with a loss that learns from sentences "
                f"(--loss simcse), not '{self.loss_name}'"
            )
        return data

    def _prepare_pooler(self) -> None:
        """A pooler head of size pooler_dim (kept if the model already has one that size), and the freeze: the
        transformer's weights stay as they are, and only a pooler head or exit heads (--exit-heads) learn."""
        dim = self.config.pooler_dim
        if dim is not None:
            head = self.encoder.head
            if head is None or head.out_features != dim:
                if head is not None:
                    print(f"replacing the model's {head.describe()} head by a fresh {dim}-dim pooler")
                self.encoder.add_pooler(dim, seed=self.config.seed)
        if self.config.freeze_encoder:
            if self.encoder.head is None and self.config.exit_heads is None:
                raise ValueError(
                    "freeze_encoder trains only the pooler head or the exit heads: give pooler_dim, a model with a "
                    "pooler head, or --exit-heads"
                )
            for p in self.encoder.model.parameters():
                p.requires_grad_(False)

    def _prepare_decoder(self) -> None:
        """ESE sec. 3.1 for decoder LLMs: bidirectional attention and LoRA (mean pooling is their default)."""
        from matryoshka2d.models.decoders import set_bidirectional
        from matryoshka2d.models.lora import add_lora

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
            from matryoshka2d.models.backbones import layer_stack

            for layer in layer_stack(self.encoder.model):
                for block in layer.children():
                    block.compile(dynamic=True)
        self._tokenizer = private_tokenizer(self.encoder.tokenizer)
        self._prefetch = Prefetcher(self.prepare_batch)
        self._pin = device.type == "cuda"
        self._lazy_records = False  # run() sets it: records keep device tensors until a logging step

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
        return Path(self.config.eval_file) if self.config.eval_file else sts_dev_file()

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
        return self.run_dir.checkpoints

    def save_checkpoint(self) -> Path:
        modules = {"encoder": self.encoder, "method": self.method, "task_loss": self.task_loss}
        return self.run_dir.save_checkpoint(
            self.step,
            modules,
            self.optimizer,
            self.scheduler,
            self.history,
            self.saved_config(),
            scaler=self.scaler,
            keep=self.config.keep_checkpoints,
        )

    def latest_checkpoint(self) -> Path | None:
        return self.run_dir.latest_checkpoint()

    def saved_config(self) -> dict:
        """The run's options as JSON values, with the loss it uses even when that was the default."""
        return json.loads(json.dumps({**dataclasses.asdict(self.config), "loss": self.loss_name}))

    def check_same_run(self, checkpoint: Path, saved: dict) -> None:
        if saved.get("loss") is None:  # written before the loss was recorded: the data's default loss
            saved = {**saved, "loss": self.default_loss()}
        check_resumable(checkpoint, saved, self.saved_config())

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

    # ---- the run ------------------------------------------------------------------------------------

    def run(
        self, resume: bool = False, progress: bool = True, overwrite: bool = False, allow_pickle: bool = False
    ) -> Path:
        main = self.processes.main  # with several processes, rank 0 alone writes logs, checkpoints, the model
        self.run_dir.check(resume, overwrite)
        if overwrite and not resume and main:
            self.run_dir.clear_run()
        self.out.mkdir(parents=True, exist_ok=True)
        self.processes.barrier()
        if resume:
            if self.resume(allow_pickle=allow_pickle) and main:
                print(f"resumed from step {self.step} of {self.total_steps}")
            if main:
                self.run_dir.trim_log(self.step)
        exit_heads.fit_at_start(self)
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
        from matryoshka2d.models.lora import save_and_merge_lora

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
