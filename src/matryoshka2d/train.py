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

from matryoshka2d.data import TrainingData, read_training_data
from matryoshka2d.encoder import ElasticEncoder
from matryoshka2d.losses import make_task_loss
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import Method, make_method

# The loss a run uses when none is given, per kind of training data (matryoshka2d.data). AnglE's terms depend
# on the kind too (losses/angle.py): angle-emb 0.6.1's format C for triplets, format A for labelled pairs.
DEFAULT_LOSSES = {
    "triplets": ("angle", "AnglE as angle-emb trains triplets: in-batch negatives with and without hard negatives"),
    "nli": ("angle", "AnglE as angle-emb trains labelled pairs: in-batch negatives over entailed pairs"),
    "scored": ("angle", "AnglE for similarity scores: CoSENT on the scores plus the angle term"),
    "sentences": ("simcse", "unsupervised SimCSE: plain sentences, dropout as the only noise"),
}


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

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


def sts_dev_score(encoder: ElasticEncoder, path: str | Path, layer: int, dim: int) -> float:
    """Spearman x 100 of cosine vs gold on one STS file (sentence1, sentence2, score), at one cell."""
    from matryoshka2d.evaluate.sts import load_pairs, spearman_x100

    pairs = load_pairs(path)
    n = len(pairs.sentences1)
    vectors = encoder.encode(pairs.sentences1 + pairs.sentences2, layer=layer, dim=dim, normalize=True)
    return spearman_x100(pairs.gold, (vectors[:n] * vectors[n:]).sum(1))


class Trainer:
    def __init__(self, config: TrainConfig):
        self.config = config
        self.out = Path(config.output)
        if config.lr_schedule not in ("linear", "cosine"):
            raise ValueError(f"lr_schedule must be 'linear' or 'cosine', got '{config.lr_schedule}'")
        self.encoder = ElasticEncoder(
            config.model, pooling=config.pooling, max_length=config.max_length, device=config.device
        )
        self._prepare_pooler()
        self.method = self.build_method()
        self.loss_name = config.loss or self.default_loss()
        self.task_loss = self.build_task_loss()
        self.data: TrainingData = self.read_data()
        self.steps_per_epoch = math.ceil(len(self.data) / config.batch_size)
        self.total_steps = config.steps or max(1, math.ceil(config.epochs * self.steps_per_epoch))
        self._prepare_loss_parameters()
        params = [p for m in (self.encoder, self.method, self.task_loss) for p in m.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        warmup = int(config.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factory(warmup))
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

    def compute_loss(self, step: int) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(self.config.seed * 1_000_003 + step)
        plan = self.method.plan(np.random.default_rng([self.config.seed, step, 1]))
        columns, labels = self.data.rows(self.batch_indices(step))
        # Each column is tokenized and run on its own, padded to the longest text of that column rather than of
        # the whole batch (premises are much longer than hypotheses): fewer padded tokens, as sentence-transformers
        # does (docs/benchmarks.md, training speed).
        per_column = [self.encoder(self.encoder.tokenize(col), plan.layers) for col in columns]
        label_tensor = None if labels is None else torch.as_tensor(labels, device=self.encoder.device)
        states = {
            layer: EmbeddedBatch([pooled[layer] for pooled in per_column], self.data.kind, label_tensor)
            for layer in plan.layers
        }
        loss, parts = self.method.loss(plan, states, self.task_loss)
        parts.update({k: v for k, v in plan.info.items()})
        return loss, parts

    def train_step(self) -> dict:
        self.encoder.train()
        loss, parts = self.compute_loss(self.step)
        loss.backward()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "loss": float(loss.detach()), "grad_norm": float(grad_norm), **parts}

    # ---- evaluation, checkpoints --------------------------------------------------------------------

    def evaluate(self) -> dict:
        from matryoshka2d.paths import data_dir

        path = self.config.eval_file or data_dir() / "sts" / "raw" / "stsb_dev.tsv"
        layer, dim = self.config.eval_cell or (self.encoder.num_layers, self.encoder.hidden_size)
        keep = getattr(self.method, "keep_layers", None)
        if keep:
            layer = min(layer, keep)
        score = sts_dev_score(self.encoder, path, layer, dim)
        return {"step": self.step, "eval": f"{Path(path).name}@({layer},{dim})", "spearman": round(score, 2)}

    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Write everything a resume needs into a temporary folder, then rename it: a kill leaves no half."""
        root = self.checkpoint_dir()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step:07d}"
        tmp = root / f".tmp-step-{self.step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(
            {
                "encoder": self.encoder.state_dict(),
                "method": self.method.state_dict(),
                "task_loss": self.task_loss.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "step": self.step,
                "history": self.history,
            },
            tmp / "state.pt",
        )
        saved = {**dataclasses.asdict(self.config), "loss": self.loss_name}  # the loss the run uses, even by default
        (tmp / "config.json").write_text(json.dumps(saved, indent=2))
        with open(tmp / "state.pt", "rb") as f:
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step-*"))[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        found = sorted(p for p in self.checkpoint_dir().glob("step-*") if (p / "state.pt").is_file())
        return found[-1] if found else None

    def resume(self) -> bool:
        checkpoint = self.latest_checkpoint()
        if checkpoint is None:
            return False
        saved = json.loads((checkpoint / "config.json").read_text())
        mine = {**dataclasses.asdict(self.config), "loss": self.loss_name}
        keys = ("model", "method", "loss", "batch_size", "seed", "data", "pooler_dim", "freeze_encoder")
        # A checkpoint written before an option existed holds that option's default.
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        differ = [k for k in keys if saved.get(k, defaults.get(k)) != mine.get(k)]
        if differ:
            raise ValueError(f"cannot resume from {checkpoint}: the run differs in {', '.join(differ)}")
        state = torch.load(checkpoint / "state.pt", map_location=self.encoder.device, weights_only=False)
        self.encoder.load_state_dict(state["encoder"])
        self.method.load_state_dict(state["method"])
        self.task_loss.load_state_dict(state["task_loss"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.history = state["step"], state["history"]
        return True

    # ---- the run ------------------------------------------------------------------------------------

    def run(self, resume: bool = False, progress: bool = True) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        if resume and self.resume():
            print(f"resumed from step {self.step} of {self.total_steps}")
        log = (self.out / "train_log.jsonl").open("a", encoding="utf-8")
        start, first_step = time.perf_counter(), self.step
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not progress, desc=f"{self.config.method}")
        try:
            while self.step < self.total_steps:
                record = self.train_step()
                self.history.append({"step": record["step"], "loss": record["loss"]})
                log.write(json.dumps(record) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                if self.config.eval_steps and self.step % self.config.eval_steps == 0 and self.step < self.total_steps:
                    result = self.evaluate()
                    log.write(json.dumps(result) + "\n")
                    bar.write(f"step {self.step}: STS {result['eval']} spearman {result['spearman']}")
                if self.config.save_steps and self.step % self.config.save_steps == 0:
                    self.save_checkpoint()
                log.flush()
        finally:
            bar.close()
            log.close()
        seconds = time.perf_counter() - start
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
            "final_eval": final_eval,
        }
        self.encoder.eval()
        return self.encoder.save(self.out, keep_layers=getattr(self.method, "keep_layers", None), metadata=metadata)


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> Path:
    return Trainer(config).run(resume=resume, progress=progress)
