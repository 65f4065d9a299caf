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

import math
import sys
from pathlib import Path

import numpy as np
import torch

from matryoshka2d.evaluate.sts import sentence_key, sts_test_sentence_keys
from matryoshka2d.files import DataFormatError
from matryoshka2d.losses import TASK_LOSSES, make_task_loss
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import Method, Plan, make_method
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.paths import data_dir
from matryoshka2d.training import exit_heads, gradcache, preflight, surgery
from matryoshka2d.training.config import DEFAULT_LOSSES, TrainConfig, check_config, eval_cells
from matryoshka2d.training.data import (
    DataError,
    TrainingData,
    read_training_data,
    without_repeated_texts,
    without_rows_holding,
)
from matryoshka2d.training.packing import ColumnBatch, call_overhead, encode_columns, tokenize_columns
from matryoshka2d.training.parallel import Processes
from matryoshka2d.training.run_loop import RunLoop
from matryoshka2d.training.rundir import RunDir
from matryoshka2d.training.teacher import distill_term, teacher_term
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


class Trainer(RunLoop):
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
        preflight.check(self)  # what the save would refuse, and terms a batch of one row leaves at 0: before any work

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

    # ---- what the preflight checks (training.preflight) ---------------------------------------------------------

    def cut_options(self) -> str:
        """The options that make the run save its model cut to fewer layers, as a message names them."""
        cfg = self.config
        heads = f" --exit-heads {cfg.exit_heads}" if cfg.exit_heads else ""
        inputs = f" --exit-heads-inputs {cfg.exit_heads_inputs}" if cfg.exit_heads_inputs else ""
        return f"--method {cfg.method} --layer {self.method.keep_layers}{heads}{inputs}"

    def one_row_terms(self) -> list[preflight.Term]:
        """Each term a step trains by, for the check that a batch of one row trains: the task loss (one that
        make_task_loss made; a subclass whose objective holds its terms has none) and the term of --distill-from."""
        terms, width, device = [], max(self.method.widths()), self.encoder.device
        if isinstance(self.task_loss, tuple(TASK_LOSSES.values())):
            labels, kind = self.data.labels, self.data.kind

            def task(vectors: list[torch.Tensor], row: int) -> torch.Tensor:
                label = None if labels is None else torch.as_tensor(labels[[row]], device=device)
                return self.task_loss(EmbeddedBatch(vectors, kind, label))

            chosen = "" if self.config.loss else f" (the default for {kind} data)"
            terms.append(preflight.Term(f"--loss {self.loss_name}{chosen}", len(self.data.columns), width, task))
        if self.teacher_term is not None:
            cfg = self.config
            target = torch.nn.functional.normalize(torch.ones(1, width, device=device), dim=-1)

            def taught(vectors: list[torch.Tensor], _row: int) -> torch.Tensor:
                return distill_term(vectors[0], target, [width], cfg.distill_loss)

            terms.append(preflight.Term(f"--distill-loss {cfg.distill_loss} (--distill-from)", 1, width, taught))
        return terms

    def _without_sts_test(self, data: TrainingData) -> TrainingData:
        try:
            keys = sts_test_sentence_keys(data_dir(self.config.sts_data_dir))
        except (FileNotFoundError, DataFormatError) as exc:
            raise FileNotFoundError(f"exclude_sts_test: cannot read the STS test sets to exclude ({exc})") from None
        try:
            data, dropped = without_rows_holding(data, keys, sentence_key)
        except DataError as exc:  # every row left out: say which sentences and how to keep them
            raise DataError(
                f"{exc}: all {len(data)} rows hold a sentence of the STS test sets (--exclude-sts-test); leave that "
                "flag out to train on them"
            ) from None
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


def train(
    config: TrainConfig,
    resume: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    allow_pickle: bool = False,
) -> Path:
    # a taken --output, or one overlapping an input, is refused before the model loads
    RunDir(config.output).check(resume, overwrite, config.inputs())
    return Trainer(config).run(resume=resume, progress=progress, overwrite=overwrite, allow_pickle=allow_pickle)
