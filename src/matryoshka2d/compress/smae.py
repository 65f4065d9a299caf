"""SMAE: Starbucks Masked Autoencoding pre-training (Zhuang et al., "Starbucks", sec. 3.2, eqs. 6-9).

The backbone is the encoder; a small decoder (one transformer layer) shares its embeddings and its MLM head.
Every step masks a batch of sentences twice (eq. 6): the encoder input with ratio alpha_e, the decoder input
with a higher ratio alpha_d. For each (layer n, dim d) of a fixed list, the Starbucks SRL list by default
(matryoshka2d.methods.starbucks.default_sizes, the same sizes SRL fine-tuning uses):
- encoder MLM (eq. 8, first term): the MLM head predicts the encoder-masked tokens from the first d numbers of
  every token state of layer n;
- decoder MAE (eq. 8, second term): the decoder input's first position (the [CLS] slot) is replaced by
  h = P[:d] x (eq. 7), where x is the first d numbers of layer n's sentence vector and P[:d] the first d rows of
  the projection matrix P; the one-layer decoder then predicts the decoder-masked tokens;
and the loss is summed over the list (eq. 9).

Readings of points the paper leaves to its code (github.com/ielab/Starbucks, smae/):
- P is the MLM head's transform (dense D x D, activation, LayerNorm): "the same projection is used to compute
  the masked token logits for the MLM head" (sec. 3.2). Its first d input rows map a d-dim vector to D, for the
  decoder's first position and for the encoder MLM logits at width d alike, as the authors' code does.
- Masking ratios: the equations of our copy of the paper lost their numbers; only "alpha_d is larger than
  alpha_e" survives in the text. The defaults are the authors' released pre-training command
  (smae/README.md: --mlm_probability 0.2 --decoder_mlm_probability 0.4): alpha_e = 0.2, alpha_d = 0.4.
  Masking is by whole words (their DataCollatorForWholeWordMask), the encoder's masked words a subset of the
  decoder's, and BERT's 80/10/10 replacement ([MASK] / random token / unchanged) for each input. Budgets are
  round(ratio x real tokens), at least one, where real tokens exclude [CLS]/[SEP]/padding.
- The vector fed to the decoder: the paper uses the [CLS] embedding because its models are CLS-pooled. We use
  the model's own sentence vector (its pooling, mean for minilm-l6), so that pre-training shapes the vector
  fine-tuning will use; `bottleneck="cls"` takes the [CLS] token state as in the paper.
- Loss: eq. 8 adds the two MLM losses and eq. 9 sums over sizes ("summing the MLM loss for all pairs");
  the authors' code averages instead (ielab/Starbucks smae/modeling.py, BertFor2DMaekMatryoshkaMaskedLM.forward
  L159-171: (mlm + mae) / 2 per size, then / the number of sizes). The factor (2 x number of sizes) is not
  absorbed by AdamW in the first steps when gradients are clipped at 1.0. `reduction=`: "sum" (the paper, the
  default) or "mean" (their code).
- The decoder layer starts as a copy of the backbone's first layer (the authors keep layer 1 of the pretrained
  BERT as the decoder); the embeddings and the MLM head are shared, not copied.
- The MLM head: our short-name backbones are loaded with AutoModel, and all-MiniLM-L6-v2's folder holds no MLM
  head weights at all, so the head (transform + output bias, output weights tied to the word embeddings) is
  initialised fresh (BERT's initialisation: N(0, initializer_range), LayerNorm 1/0, bias 0). If a model
  folder does hold MLM head weights (a BertForMaskedLM / RobertaForMaskedLM / MPNetForMaskedLM /
  DistilBertForMaskedLM save), they are loaded instead; `config()` records which.
- Optimisation defaults (sec. 4.1): AdamW, lr 1e-4, weight decay 0.05, cosine schedule, warm-up ratio 0.05;
  the paper's batch is 512, ours 32 by default (CPU); set --batch-size to match the paper.

After pre-training only the encoder is saved (the decoder and MLM head are discarded, sec. 3.2); the folder is
an ordinary model for `matryoshka2d train --model DIR`.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from matryoshka2d.compress.masking import IGNORE, MaskedBatch, mask_batch
from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.methods.base import recorded_settings
from matryoshka2d.methods.starbucks import default_sizes
from matryoshka2d.models.backbones import ARCHITECTURES, layer_stack
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.pooler import pool
from matryoshka2d.paths import sts_dev_file
from matryoshka2d.training.data import read_training_data
from matryoshka2d.training.rundir import RunDir
from matryoshka2d.training.trainer import Trainer

ENCODER_MASK_RATIO = 0.2  # alpha_e: the authors' smae/README.md command, --mlm_probability 0.2
DECODER_MASK_RATIO = 0.4  # alpha_d: the same command, --decoder_mlm_probability 0.4
# The bidirectional encoders of the architecture table: masked-LM pre-training needs attention both ways.
MLM_ARCHITECTURES = tuple(name for name, arch in ARCHITECTURES.items() if not arch.decoder)


class SMAEError(ValueError):
    """SMAE cannot run with this model or these settings; the message says why."""


# ---- the MLM head with its projection P --------------------------------------------------------------


class MLMHead(nn.Module):
    """BERT's MLM head: transform (dense D x D, activation, LayerNorm), then logits tied to the word embeddings.

    `project(x)` with x of width d <= D uses the first d input rows of the dense layer: SMAE's P[:d] (eq. 7).
    """

    def __init__(self, hidden: int, vocab_size: int, activation: str = "gelu", eps: float = 1e-12):
        super().__init__()
        from transformers.activations import ACT2FN

        self.dense = nn.Linear(hidden, hidden)
        self.activation = ACT2FN[activation]
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def reset(self, std: float, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.dense.weight.normal_(0.0, std, generator=generator)
            self.dense.bias.zero_()
            self.norm.weight.fill_(1.0)
            self.norm.bias.zero_()
            self.bias.zero_()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        return self.norm(self.activation(F.linear(x, self.dense.weight[:, :d], self.dense.bias)))

    def logits(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return F.linear(self.project(x), word_embeddings, self.bias)


def load_mlm_head(head: MLMHead, model_dir: str | None, keys: tuple[str, str, str] | None) -> str | None:
    """Fill the head from a masked-LM checkpoint's weights if the folder has them under `keys` (the
    architecture's mlm_head prefixes); returns where they came from."""
    if not model_dir or not keys or not Path(model_dir).is_dir():
        return None
    from safetensors import safe_open

    dense, norm, bias = keys
    names = [f"{dense}.weight", f"{dense}.bias", f"{norm}.weight", f"{norm}.bias", bias]
    targets = [head.dense.weight, head.dense.bias, head.norm.weight, head.norm.bias, head.bias]
    folder = ConfinedFolder(model_dir, "model")  # its links checked before a weights file is opened
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(folder.path(file.name)), "pt") as f:
            if not set(names) <= set(f.keys()):
                continue
            tensors = [f.get_tensor(n) for n in names]
            if any(t.shape != p.shape for t, p in zip(tensors, targets, strict=True)):
                continue
            with torch.no_grad():
                for t, p in zip(tensors, targets, strict=True):
                    p.copy_(t)
            return f"{file.name}:{dense}"
    return None


# ---- the objective ------------------------------------------------------------------------------------


@contextlib.contextmanager
def swapped_stack(model: nn.Module, layers: nn.ModuleList):
    """Run `model` with its layer stack replaced by `layers` (the decoder), restoring it afterwards."""
    stack = layer_stack(model)
    parent, name = next((m, n) for m in model.modules() for n, c in m.named_children() if c is stack)
    setattr(parent, name, layers)
    try:
        yield
    finally:
        setattr(parent, name, stack)


class SMAEObjective(nn.Module):
    """Decoder + MLM head + the SMAE loss over a list of (layer, dim) sizes. Holds no reference to the encoder's
    parameters (the encoder is passed to each call), so the optimizer and checkpoints see each weight once."""

    name = "smae"
    settings = "sizes encoder_mask_ratio decoder_mask_ratio bottleneck reduction mlm_head=head_source"

    def __init__(
        self,
        encoder: ElasticEncoder,
        sizes: list[tuple[int, int]] | None = None,
        encoder_mask_ratio: float = ENCODER_MASK_RATIO,
        decoder_mask_ratio: float = DECODER_MASK_RATIO,
        bottleneck: str = "pooled",
        seed: int = 0,
        reduction: str = "sum",
    ):
        super().__init__()
        model = encoder.model
        arch = getattr(model.config, "model_type", "")
        if arch not in MLM_ARCHITECTURES:
            raise SMAEError(
                f"SMAE pre-trains a bidirectional masked-LM encoder ({', '.join(MLM_ARCHITECTURES)}); "
                f"{encoder.name} is '{arch}'"
            )
        if encoder.tokenizer.mask_token_id is None:
            raise SMAEError(f"{encoder.name}: the tokenizer has no mask token, so nothing can be masked")
        if not isinstance(getattr(model, "embeddings", None), nn.Module):
            raise SMAEError(f"{encoder.name}: no `embeddings` module to share with the decoder")
        if encoder.head is not None:
            raise SMAEError(
                f"{encoder.name} has a pooler head ({encoder.head.describe()}); SMAE pre-trains the transformer "
                "alone: pre-train the model without it"
            )
        for what, ratio in (("encoder_mask_ratio", encoder_mask_ratio), ("decoder_mask_ratio", decoder_mask_ratio)):
            if not 0 < ratio < 1:
                raise SMAEError(f"smae: {what} must be between 0 and 1 (exclusive), got {ratio}")
        if bottleneck not in ("pooled", "cls"):
            raise SMAEError(f"smae: bottleneck must be 'pooled' or 'cls', got '{bottleneck}'")
        if reduction not in ("sum", "mean"):
            raise SMAEError(
                f"smae: reduction must be 'sum' (the paper's eq. 9) or 'mean' (ielab's code), got '{reduction}'"
            )
        self.reduction = reduction
        num_layers, width = encoder.num_layers, encoder.transformer_size
        self.sizes = sorted(tuple(int(v) for v in s) for s in (sizes or default_sizes(num_layers, width)))
        for layer, dim in self.sizes:
            if not (1 <= layer <= num_layers and 1 <= dim <= width):
                raise SMAEError(f"smae size ({layer},{dim}) is outside the model's {num_layers} layers x {width} dims")
        self.encoder_mask_ratio, self.decoder_mask_ratio = encoder_mask_ratio, decoder_mask_ratio
        self.bottleneck = bottleneck
        self.decoder = nn.ModuleList([copy.deepcopy(layer_stack(model)[0])])
        config = model.config
        self.mlm_head = MLMHead(
            width,
            model.get_input_embeddings().weight.shape[0],
            getattr(config, "hidden_act", None) or getattr(config, "activation", "gelu"),
            getattr(config, "layer_norm_eps", 1e-12),
        )
        self.mlm_head.reset(getattr(config, "initializer_range", 0.02), seed)
        loaded = load_mlm_head(self.mlm_head, encoder.location, ARCHITECTURES[arch].mlm_head)
        self.head_source = f"loaded from {loaded}" if loaded else "fresh (the model folder has no MLM head weights)"
        self.to(encoder.device)

    def mask(self, encoder: ElasticEncoder, texts: list[str], rng: np.random.Generator) -> MaskedBatch:
        batch = mask_batch(
            encoder.tokenizer,
            texts,
            encoder.max_length,
            self.encoder_mask_ratio,
            self.decoder_mask_ratio,
            rng,
            encoder._input_names,
        )
        return batch.to(encoder.device)

    def sentence_vector(self, encoder: ElasticEncoder, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return states[:, 0] if self.bottleneck == "cls" else pool(states, mask, encoder.pooling)

    def encoder_loss(self, encoder: ElasticEncoder, states: torch.Tensor, dim: int, batch: MaskedBatch):
        """Eq. 8, first term: predict the encoder-masked tokens from the first `dim` numbers of each token state."""
        chosen = batch.encoder_labels != IGNORE
        if not chosen.any():
            return states.sum() * 0.0
        word = encoder.model.get_input_embeddings().weight
        logits = self.mlm_head.logits(states[chosen][:, :dim], word)
        return F.cross_entropy(logits.float(), batch.encoder_labels[chosen])

    def decoder_loss(self, encoder: ElasticEncoder, vector: torch.Tensor, dim: int, batch: MaskedBatch):
        """Eq. 7-8: the decoder's first position gets P[:dim] vector[:, :dim]; it predicts the decoder-masked
        tokens. Numbers of `vector` beyond `dim` are never read."""
        first = self.mlm_head.project(vector[:, :dim])
        model = encoder.model
        self.decoder.train(model.training)  # dropout in the decoder exactly when the encoder has it

        def replace_first(_module, _args, output):
            return torch.cat([first[:, None].to(output.dtype), output[:, 1:]], dim=1)

        handle = model.embeddings.register_forward_hook(replace_first)
        try:
            with swapped_stack(model, self.decoder):
                hidden = model(
                    input_ids=batch.decoder_ids, attention_mask=batch.attention_mask, **batch.extra
                ).last_hidden_state
        finally:
            handle.remove()
        chosen = batch.decoder_labels != IGNORE
        if not chosen.any():
            return hidden.sum() * 0.0
        word = model.get_input_embeddings().weight
        return F.cross_entropy(self.mlm_head.logits(hidden[chosen], word).float(), batch.decoder_labels[chosen])

    def loss(self, encoder: ElasticEncoder, batch: MaskedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Eq. 9: the sum over sizes of the encoder MLM loss and the decoder MAE loss (or their mean)."""
        features = {"input_ids": batch.encoder_ids, "attention_mask": batch.attention_mask, **batch.extra}
        states = encoder.token_states(features, {n for n, _ in self.sizes})
        total, parts = None, {}
        for n, d in self.sizes:
            mlm = self.encoder_loss(encoder, states[n], d, batch)
            mae = self.decoder_loss(encoder, self.sentence_vector(encoder, states[n], batch.attention_mask), d, batch)
            parts[f"mlm({n},{d})"], parts[f"mae({n},{d})"] = mlm.detach(), mae.detach()
            total = mlm + mae if total is None else total + mlm + mae
        if self.reduction == "mean":  # ielab's code: (mlm + mae) / 2 per size, then the mean over sizes
            total = total / (2 * len(self.sizes))
        return total, parts

    def widths(self) -> set[int]:
        """The widths its losses train (the trainer records them as the folder's matryoshka dimensions)."""
        return {d for _, d in self.sizes}

    def config(self) -> dict:
        return {**recorded_settings(self, self.settings), "decoder_layers": len(self.decoder)}


# ---- the run: the Trainer's loop, checkpoints and resume, with SMAE's objective ---------------------------


class SMAETrainer(Trainer):
    """A Trainer whose step is the SMAE loss; the same loop, checkpoints and exact resume."""

    supports_processes = False  # its masked-token losses are per process; not wired to the gather

    def build_method(self):
        if self.config.gradient_accumulation != 1:  # its batch is masked and run whole (prepare_batch below)
            raise SMAEError("smae: gradient_accumulation is not supported; lower --batch-size to save memory")
        return SMAEObjective(self.encoder, seed=self.config.seed, **self.config.method_options)

    def build_task_loss(self):
        return nn.Module()  # SMAE has no sentence-embedding loss; the objective holds its own terms

    def read_data(self, first_read=None):
        return read_training_data(self.config.data, sentences=True)

    def prepare_batch(self, step: int):
        return [None]  # one micro-batch; the texts are masked (and tokenized) in compute_loss

    def compute_loss(self, step: int, micro_batch=None):
        torch.manual_seed(self.config.seed * 1_000_003 + step)  # dropout, as the Trainer does
        texts = self.data.rows(self.batch_indices(step))[0][0]
        batch = self.method.mask(self.encoder, texts, np.random.default_rng([self.config.seed, step, 2]))
        return self.method.loss(self.encoder, batch)

    def check_eval_file(self) -> None:
        if self.config.eval_file is not None:  # the default is optional for pre-training
            super().check_eval_file()

    def evaluate(self) -> list[dict]:
        """STS-B dev at the full model, as a check of the sentence vector; skipped if there is no file."""
        if self.config.eval_file is None:
            try:
                default = sts_dev_file()
            except FileNotFoundError:
                default = None
            if default is None or not default.is_file():
                return [{"step": self.step, "eval": None, "spearman": None, "note": "no STS dev file"}]
        return super().evaluate()


def pretrain_trainer(config) -> SMAETrainer:
    if config.method != "smae":
        raise SMAEError(f"pretrain: unknown method '{config.method}'; the only pre-training method is smae")
    return SMAETrainer(config)


def pretrain(
    config, resume: bool = False, progress: bool = True, overwrite: bool = False, allow_pickle: bool = False
) -> Path:
    # a taken --output, or one overlapping an input, is refused before the model loads
    RunDir(config.output).check(resume, overwrite, config.inputs())
    return pretrain_trainer(config).run(
        resume=resume, progress=progress, overwrite=overwrite, allow_pickle=allow_pickle
    )
