"""What makes a training step cheap, kept out of the loop itself: mixed precision, the optimizer, and
tokenizing the next batch while the current one runs.

- Precision: torch.autocast in bf16 (the default on a CUDA device that supports it) or fp16 (with a
  GradScaler), or plain fp32 (the default on a CPU). Weights and optimizer state stay fp32 either way.
- AdamW: fused (one kernel over all parameters) on CUDA and on CPU, torch's default elsewhere; weight decay on
  every weight, or (`weight_decay_exempt: norm-and-bias`) not on biases and norms, as the Hugging Face and
  sentence-transformers trainers do.
- Prefetch: a background thread tokenizes step s+1 while step s runs forward and backward. It uses its own
  copy of the tokenizer (a fast tokenizer must not be used by two threads at once) and touches no random
  state, so the seeded order of batches, samples and dropout masks is exactly what it was without it.
- Lazy read-back: a step's record keeps its loss on the device until a logging step (`host_values`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from matryoshka2d.models.backbones import layer_stack

PRECISIONS = ("bf16", "fp16", "fp32")
WEIGHT_DECAY_EXEMPTIONS = ("none", "norm-and-bias")
# The names the Hugging Face Trainer keeps out of weight decay (transformers 5.23 `Trainer.get_decay_parameter_names`,
# trainer.py L1408-1418), matched on the lower-cased full name; parameters of nn.LayerNorm modules are kept out too.
NO_DECAY_NAMES = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


class PrecisionError(ValueError):
    """A precision that this device cannot train in; the message says which and why."""


def resolve_precision(precision: str | None, device: torch.device) -> str:
    """The precision to train in: the one asked for if the device can, else a clear error; None picks the
    default (bf16 on a CUDA device that supports it, fp32 otherwise)."""
    cuda = device.type == "cuda"
    bf16_ok = cuda and torch.cuda.is_bf16_supported()
    if precision is None:
        return "bf16" if bf16_ok else "fp32"
    if precision not in PRECISIONS:
        raise PrecisionError(f"--precision must be one of {', '.join(PRECISIONS)}, got '{precision}'")
    if precision == "fp16" and not cuda:
        raise PrecisionError(
            f"--precision fp16 needs a CUDA device (float16 autocast with a GradScaler); the run is on "
            f"'{device}': use --precision fp32"
        )
    if precision == "bf16" and not cuda:
        raise PrecisionError(
            f"--precision bf16 is for CUDA devices; the run is on '{device}', where bf16 autocast is slower than fp32 "
            "on most CPUs and is not supported by this trainer: use --precision fp32 (the CPU default)"
        )
    if precision == "bf16" and not bf16_ok:
        name = torch.cuda.get_device_name(device)
        raise PrecisionError(f"--precision bf16: the GPU {name} does not support bfloat16; use --precision fp16")
    return precision


def checkpoint_and_compile(encoder, gradient_checkpointing: bool, compile: bool) -> None:
    """Gradient checkpointing (activations recomputed in backward: less memory) and torch.compile."""
    if gradient_checkpointing:
        if not getattr(encoder.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"gradient_checkpointing: {encoder.name} does not support it")
        encoder.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        # Compile the blocks inside each layer, not the model: the exits read each layer's output and stop the
        # pass with hooks on the layers, which a compiled whole model would turn into graph breaks.
        for layer in layer_stack(encoder.model):
            for block in layer.children():
                block.compile(dynamic=True)


def autocast(precision: str, device: torch.device):
    """The autocast context of a training forward pass (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def decay_groups(modules: list[torch.nn.Module], weight_decay: float, exempt: str = "none") -> list[dict]:
    """AdamW parameter groups of the trainable parameters of `modules`, in their order.

    "none": one group, every parameter decayed (the checkpoints of earlier runs hold one group).
    "norm-and-bias": biases and norm weights get no decay, as in the Hugging Face Trainer's `create_optimizer`
    (trainer.py L1272-1285) and sentence-transformers 6.2, which applies the same rule to the loss's own
    parameters too (base/trainer.py L1269-1285). Embedding matrices are decayed, as there.
    """
    named = [(f"{i}.{name}", p) for i, m in enumerate(modules) for name, p in m.named_parameters() if p.requires_grad]
    if exempt == "none":
        return [{"params": [p for _, p in named], "weight_decay": weight_decay}]
    from transformers.trainer_pt_utils import get_parameter_names

    decayed = {
        f"{i}.{name}"
        for i, m in enumerate(modules)
        for name in get_parameter_names(m, [torch.nn.LayerNorm], NO_DECAY_NAMES)
    }
    return [
        {"params": [p for name, p in named if name in decayed], "weight_decay": weight_decay},
        {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0},
    ]


def adamw(
    modules: list[torch.nn.Module], lr: float, weight_decay: float, exempt: str, device: torch.device, regroup=None
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `modules` (decay_groups); `regroup(groups)` may split them further
    (the exit heads' own learning rate)."""
    # torch has fused AdamW kernels for CUDA and for CPU; elsewhere (mps, ...) leave torch's default.
    fused = True if device.type in ("cuda", "cpu") else None
    groups = decay_groups(modules, weight_decay, exempt)
    if regroup is not None:
        groups = regroup(groups)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused)


def lr_schedule(optimizer, total: int, warmup: int, kind: str) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup` steps, then "linear" or "cosine" decay to 0 at step `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else max(0.0, 1.0 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Prefetcher:
    """Runs `prepare(step)` for the next step in a background thread; `get(step)` returns step's result,
    computing it now if it was not prefetched (the first step, or after a jump such as a resume)."""

    def __init__(self, prepare: Callable[[int], object]):
        self.prepare = prepare
        self.pool: ThreadPoolExecutor | None = None
        self.pending: tuple[int, Future] | None = None

    def get(self, step: int, next_step: int | None):
        if self.pending is not None and self.pending[0] == step:
            result = self.pending[1].result()
        else:
            if self.pending is not None:
                self.pending[1].cancel()
            result = self.prepare(step)
        self.pending = None
        if next_step is not None:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="m2d-tokenize")
            self.pending = (next_step, self.pool.submit(self.prepare, next_step))
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool, self.pending = None, None


def private_tokenizer(tokenizer):
    """A copy of the tokenizer for the prefetch thread (fast tokenizers refuse concurrent use)."""
    return copy.deepcopy(tokenizer)


def host_values(record: dict) -> dict:
    """The record with every device tensor (loss, gradient norm, the method's loss parts) read back as a float."""
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}
