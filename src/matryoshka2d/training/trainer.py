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
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from matryoshka2d.evaluate.sts import sentence_key, sts_dev_score, sts_test_sentence_keys
from matryoshka2d.files import DataFormatError
from matryoshka2d.losses import make_task_loss
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import Method, Plan, make_method
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.paths import data_dir, sts_dev_file
from matryoshka2d.training import checkpoints, exit_heads, gradcache, surgery
from matryoshka2d.training.config import DEFAULT_LOSSES, TrainConfig, check_config, check_resumable, eval_cells
from matryoshka2d.training.data import (
    TrainingData,
    read_training_data,
    without_repeated_texts,
    without_rows_holding,
)
from matryoshka2d.training.packing import ColumnBatch, call_overhead, encode_columns, tokenize_columns
from matryoshka2d.training.parallel import Processes
from matryoshka2d.training.rundir import RunDir
from matryoshka2d.training.teacher import teacher_term
from matryoshka2d.training.throughput import (
    Prefetcher,
    adamw,
    autocast,
    checkpoint_and_compile,
    grad_scaler,
    host_values,
    lr_schedule,
    private_tokenizer,
    resolve_precision,
)


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
        surgery.prepare_model(self.encoder, config)  # pooler head and freeze, bidirectional attention, LoRA
        for layer, dim in eval_cells(config) or []:
            self.encoder.check_layer(layer), self.encoder.check_dim(dim)
        self.method = self.build_method()
        self.teacher_term = teacher_term(self)  # train --distill-from T (training.teacher), or None
        first_read = None if config.loss else read_training_data(config.data)  # its kind picks the loss
        self.loss_name = config.loss or self.default_loss(first_read.kind)
        self.task_loss = self.build_task_loss()
        self.data: TrainingData = self.read_data(first_read)
        self.steps_per_epoch = math.ceil(len(self.data) / config.batch_size)
        self.total_steps = config.steps or max(1, math.ceil(config.epochs * self.steps_per_epoch))
        self._prepare_loss_parameters()
        exit_heads.prepare(self)
        self._prepare_throughput()
        modules, cfg = [self.encoder, self.method, self.task_loss], config
        heads_apart = exit_heads.regroup(self)  # the heads with their own learning rate
        self.optimizer = adamw(
            modules, cfg.lr, cfg.weight_decay, cfg.weight_decay_exempt, self.encoder.device, heads_apart
        )
        warmup = int(config.warmup_ratio * self.total_steps)
        self.scheduler = lr_schedule(self.optimizer, self.total_steps, warmup, config.lr_schedule)
        if self.processes.active:
            self.processes.broadcast_from_main([self.encoder, self.method, self.task_loss])
        self.step = 0
        self.history: list[dict] = []

    # ---- what is trained, on what (subclasses such as the SMAE pre-trainer replace these) ---------------

    def build_method(self) -> Method:
        cfg, encoder = self.config, self.encoder
        method = make_method(cfg.method, encoder.num_layers, encoder.hidden_size, **cfg.method_options)
        for warning in method.adapt_to_backbone(encoder.pooling, encoder.normalize_output):
            if self.processes.main:
                print(f"warning: {warning}", file=sys.stderr)
        return method

    def default_loss(self, kind: str) -> str:
        """The loss for the kind of data given (DEFAULT_LOSSES); the run says which it picked and why."""
        name, why = DEFAULT_LOSSES[kind]
        if self.processes.main:
            print(f"loss: {name} (default for {kind} data: {why}; --loss to choose another)")
        return name

    def build_task_loss(self) -> torch.nn.Module:
        return make_task_loss(self.loss_name, **self.config.loss_options)

    def read_data(self, first_read: TrainingData | None = None) -> TrainingData:
        """The training rows; losses that learn from plain sentences (simcse) get every file read as sentences.
        `first_read`, the data as read to pick the default loss, is used again when it fits the loss."""
        wants_sentences = bool(getattr(self.task_loss, "needs_sentences", False))
        if first_read is not None and (first_read.kind == "sentences" or not wants_sentences):
            data = first_read
        else:
            data = read_training_data(self.config.data, sentences=wants_sentences)
        if self.config.exclude_sts_test:
            data = self._without_sts_test(data)
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

    def _without_sts_test(self, data: TrainingData) -> TrainingData:
        try:
            keys = sts_test_sentence_keys(data_dir(self.config.sts_data_dir))
        except (FileNotFoundError, DataFormatError) as exc:
            raise FileNotFoundError(f"exclude_sts_test: cannot read the STS test sets to exclude ({exc})") from None
        data, dropped = without_rows_holding(data, keys, sentence_key)
        if self.processes.main:
            print(f"exclude_sts_test: {dropped} rows hold an STS test sentence and are left out; {len(data)} remain")
        return data

    def _prepare_throughput(self) -> None:
        cfg, device = self.config, self.encoder.device
        self.precision = resolve_precision(cfg.precision, device)
        self.scaler = grad_scaler(self.precision, device)
        checkpoint_and_compile(self.encoder, cfg.gradient_checkpointing, cfg.compile)
        self._tokenizer = private_tokenizer(self.encoder.tokenizer)
        self._prefetch = Prefetcher(self.prepare_batch)
        self._pin = device.type == "cuda"
        self._overhead = call_overhead(device, cfg.padding_free)  # None: each column padded on its own
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
        rows = order[position * self.config.batch_size : (position + 1) * self.config.batch_size]
        if not self.config.filter_duplicates:
            return rows
        return without_repeated_texts(self.data, rows, self._tokenizer, self.encoder.max_length)

    def prepare_batch(self, step: int) -> list[tuple[ColumnBatch, np.ndarray | None, int]]:
        """Step's rows, split into `gradient_accumulation` micro-batches, tokenized on the CPU (pinned for a fast
        copy to a GPU) in length groups, each padded to its own longest text (training/packing.py), or column
        by column without padding_free. Pure function of the step: safe to run ahead in a thread."""
        indices = self.batch_indices(step)
        micro = []
        for part in np.array_split(indices, min(self.config.gradient_accumulation, len(indices))):
            columns, labels = self.data.rows(part)  # labels of the whole part: every process computes its loss
            if self.processes.active:
                columns, _ = self.data.rows(self.processes.own_rows(part))
            enc = self.encoder
            batch = tokenize_columns(
                self._tokenizer, columns, enc.max_length, enc._input_names, self._overhead, self._pin
            )
            micro.append((batch, labels, len(part)))
        return micro

    def compute_loss(self, step: int, micro_batch=None) -> tuple[torch.Tensor, dict]:
        """The loss of one step (or of one micro-batch of it), on the device, and its parts."""
        plan = self.start_step(step)
        features, labels, rows = micro_batch if micro_batch is not None else self.prepare_batch(step)[0]
        per_column = self.gather(plan, self.embed(features, plan), rows)
        loss, parts = self.objective(plan, per_column, labels)
        if self.teacher_term is not None:
            weighted, term = self.teacher_term(features, per_column, plan.layers)
            loss, parts["distill"] = loss + weighted, term
        return loss, parts

    def start_step(self, step: int) -> Plan:
        """Seed the step's dropout and draw its plan (layers, widths) from the step's own generator."""
        # Dropout draws differ per process (their rows differ); the plan (layers, widths) is the same in all.
        torch.manual_seed(self.config.seed * 1_000_003 + step + 7919 * self.processes.rank)
        return self.method.plan(self.method.generator(self.config.seed, step))

    def embed(self, features: ColumnBatch, plan: Plan) -> list[dict[int, torch.Tensor]]:
        """Per column, the pooled full-width state of every layer the plan needs (one forward pass per length
        group, the rows put back in batch order: training/packing.py)."""
        with autocast(self.precision, self.encoder.device):
            return encode_columns(self.encoder, features, plan.layers)

    def gather(self, plan: Plan, per_column: list[dict], rows: int) -> list[dict]:
        """With several processes, the whole batch's embeddings: own rows with their graph (parallel.py)."""
        if not self.processes.active:
            return per_column
        local = torch.stack([torch.stack([pooled[layer] for layer in plan.layers]) for pooled in per_column])
        whole = self.processes.gather_rows(local, rows, dim=2)
        return [dict(zip(plan.layers, column, strict=True)) for column in whole]

    def objective(self, plan: Plan, per_column: list[dict], labels) -> tuple[torch.Tensor, dict]:
        """The method's loss on the batch's embeddings; its arithmetic (similarities, softmaxes, PCA) runs in fp32."""
        label_tensor = None if labels is None else torch.as_tensor(labels, device=self.encoder.device)
        states = {
            layer: EmbeddedBatch([pooled[layer].float() for pooled in per_column], self.data.kind, label_tensor)
            for layer in plan.layers
        }
        loss, parts = self.method.loss(plan, states, self.task_loss)
        parts.update({k: v for k, v in plan.info.items()})
        return loss, parts

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def train_step(self) -> dict:
        """One optimizer step. Inside run() the loss and gradient norm stay on the device (no host sync; the
        record holds tensors, read back on logging steps only); called directly, the record holds floats.
        With several micro-batches the loss is still the whole batch's, by gradient caching (gradcache.py)."""
        self.encoder.train()
        step = self.step
        micro_batches = self._prefetch.get(step, step + 1 if step + 1 < self.total_steps else None)
        if len(micro_batches) == 1:
            loss, parts = self.compute_loss(step, micro_batches[0])
            self.backward(loss)
        else:
            loss, parts = gradcache.accumulate(self, step, micro_batches)
        total = loss.detach()
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

    def evaluate(self) -> list[dict]:
        """One record per evaluated cell (--eval-cell, one or several; default the full model)."""
        path = self.eval_path()
        records = []
        for layer, dim in eval_cells(self.config) or [(self.encoder.num_layers, self.encoder.hidden_size)]:
            keep = getattr(self.method, "keep_layers", None)
            if keep:
                layer = min(layer, keep)
            score = sts_dev_score(self.encoder, path, layer, dim)
            records.append(
                {"step": self.step, "eval": f"{Path(path).name}@({layer},{dim})", "spearman": round(score, 2)}
            )
        return records

    def modules(self) -> dict[str, torch.nn.Module]:
        """What a checkpoint holds the weights of: the encoder, the method's and the task loss's parameters."""
        return {"encoder": self.encoder, "method": self.method, "task_loss": self.task_loss}

    def save_checkpoint(self) -> Path:
        return self.run_dir.save_checkpoint(
            self.step,
            self.modules(),
            self.optimizer,
            self.scheduler,
            self.history,
            self.saved_config(),
            scaler=self.scaler,
            keep=self.config.keep_checkpoints,
        )

    def saved_config(self) -> dict:
        """The run's options as JSON values, with the loss it uses even when that was the default."""
        return json.loads(json.dumps({**dataclasses.asdict(self.config), "loss": self.loss_name}))

    def check_same_run(self, checkpoint: Path, saved: dict) -> None:
        if saved.get("loss") is None:  # written before the loss was recorded: the data's default loss
            saved = {**saved, "loss": DEFAULT_LOSSES[read_training_data(self.config.data).kind][0]}
        check_resumable(checkpoint, saved, self.saved_config())

    def resume(self, allow_pickle: bool = False) -> bool:
        found = checkpoints.load_latest(
            self.run_dir.checkpoints, self.encoder.device, allow_pickle=allow_pickle, check_config=self.check_same_run
        )
        if found is None:
            return False
        folder, state = found
        try:
            for name, module in self.modules().items():
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

    # ---- the run: prepare the folder, the steps, the final evaluation and save ------------------------------

    def run(
        self, resume: bool = False, progress: bool = True, overwrite: bool = False, allow_pickle: bool = False
    ) -> Path:
        """Train from step 0 (or from the last checkpoint) to total_steps, evaluate, save the model; returns
        its folder. With several processes, rank 0 alone writes the log, the checkpoints and the model."""
        main = self.processes.main
        self.prepare_run(resume, overwrite, allow_pickle)
        log = self.run_dir.log_path.open("a", encoding="utf-8") if main else open(os.devnull, "w")  # noqa: SIM115
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (progress and main), desc=self.config.method)
        start, first_step = time.perf_counter(), self.step
        try:
            self.steps(log, bar)
        finally:
            bar.close()
            log.close()
            self._prefetch.close()
        seconds = time.perf_counter() - start
        if not main:
            self.processes.barrier()  # until rank 0 has saved the model
            self.processes.close()
            return self.out
        saved = self.save_model(seconds, self.step - first_step)
        self.processes.barrier()
        self.processes.close()
        return saved

    def prepare_run(self, resume: bool, overwrite: bool, allow_pickle: bool) -> None:
        """The output folder checked (and cleared for --overwrite), the last checkpoint loaded for --resume."""
        main = self.processes.main
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
        exit_heads.fit_at_start(self)  # --exit-heads fit: the closed-form start (not after a resume)

    def steps(self, log, bar) -> None:
        """Optimizer steps to total_steps. Their losses stay on the device until a logging or checkpoint step,
        which reads back (one host sync) the records of every step since the last one and logs them."""
        cfg, main, pending = self.config, self.processes.main, []
        self._lazy_records = True
        try:
            while self.step < self.total_steps:
                pending.append(self.train_step())
                bar.update(1)
                last = self.step == self.total_steps
                checkpoint = bool(cfg.save_steps) and self.step % cfg.save_steps == 0
                if last or checkpoint or self.step % cfg.log_every == 0:
                    self.write_records(pending, log, bar)
                    pending = []
                if main and cfg.eval_steps and self.step % cfg.eval_steps == 0 and not last:
                    for result in self.evaluate():
                        log.write(json.dumps(result) + "\n")
                        bar.write(f"step {self.step}: STS {result['eval']} spearman {result['spearman']}")
                if main and checkpoint:
                    self.save_checkpoint()
                log.flush()
        finally:
            self._lazy_records = False

    def write_records(self, records: list[dict], log, bar) -> None:
        for record in records:
            record.update(host_values(record))
            if not math.isfinite(record["loss"]):  # before any checkpoint or model holds what it did to the weights
                kept = checkpoints.candidates(self.run_dir.checkpoints)
                raise ValueError(
                    f"step {record['step']}: the loss is {record['loss']} (not finite); the run stops there, and "
                    + (f"its last checkpoint ({kept[0].name}) is kept: " if kept else "no model is saved: ")
                    + "lower --lr, check the data and the start model, then train again (--resume goes on from the "
                    "last checkpoint)"
                )
            self.history.append({"step": record["step"], "loss": record["loss"]})
            log.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{records[-1]['loss']:.4f}")

    def extra_metadata(self) -> dict:
        """What a subclass records with the model beside the run's record (distillation: its teacher)."""
        return {}

    def save_model(self, seconds: float, steps_run: int) -> Path:
        """The final evaluation, then the model with what the run recorded (matryoshka2d.json), atomically."""
        from matryoshka2d.models.lora import save_and_merge_lora

        final_evals = self.evaluate()
        with self.run_dir.log_path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(record) + "\n" for record in final_evals)
        metadata = {
            "method": self.method.config(),
            "trained_widths": sorted(self.method.widths()),  # -> matryoshka_dimensions in config.json
            "loss": self.loss_name,
            "loss_terms": self.task_loss.describe(self.data.kind) if hasattr(self.task_loss, "describe") else None,
            "training": dataclasses.asdict(self.config),
            "examples": len(self.data),
            "data_kind": self.data.kind,
            "steps": self.step,
            "seconds_this_run": round(seconds, 1),
            "seconds_per_step": round(seconds / steps_run, 4) if steps_run else None,
            "processes": self.processes.world,
            "final_eval": final_evals[0],  # the first --eval-cell (or the full model)
            "final_evals": final_evals,  # every --eval-cell
            **self.extra_metadata(),
        }
        self.encoder.eval()
        keep = getattr(self.method, "keep_layers", None)

        def save(folder: Path) -> Path:
            save_and_merge_lora(self.encoder, folder)  # the adapter beside the model; the model saved merged
            return self.encoder.save(folder, keep_layers=keep, metadata=metadata)

        return checkpoints.save_model_atomically(save, self.out)


def train(
    config: TrainConfig,
    resume: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    allow_pickle: bool = False,
) -> Path:
    RunDir(config.output).check(resume, overwrite)  # a taken --output is refused before the model loads
    return Trainer(config).run(resume=resume, progress=progress, overwrite=overwrite, allow_pickle=allow_pickle)
