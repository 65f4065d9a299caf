"""Exits that really stop: a forward pass that reads the layers asked for and never runs the layers above the
deepest of them.

Every layer carries two hooks, put on once when the encoder is built: one reads the layer's output when the current
call asked for that layer, and one, on the layer above the deepest one asked for, stops the forward pass before
that layer runs. What a call asks for lives in a thread-local record, never in the model, so one encoder serves
different cells from several threads at once (matryoshka2d.models.encoder).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from matryoshka2d.models.backbones import layer_stack


class _ExitReached(Exception):
    """Raised before the first layer above a call's deepest exit: that layer and those above it do not run."""


class ExitRequest:
    """What one forward call of one thread asks of the layer stack: the layers to read (1-based; 0 is the
    embedding output, the first layer's input) and where to stop."""

    def __init__(self, stack: nn.ModuleList, wanted: list[int]):
        self.position = {id(layer): n for n, layer in enumerate(stack, start=1)}
        self.wanted = set(wanted)
        self.stop = max(max(wanted), 1)  # the deepest layer that runs
        self.captured: dict[int, torch.Tensor] = {}


_CALLS = threading.local()  # .request: the ExitRequest of the forward call running in this thread, if any


def _read_output(module: nn.Module, _args, output) -> None:
    request = getattr(_CALLS, "request", None)
    n = request.position.get(id(module)) if request is not None else None
    if n is not None and n in request.wanted:
        request.captured[n] = output[0] if isinstance(output, tuple) else output


def _stop_or_read_input(module: nn.Module, args, kwargs) -> None:
    request = getattr(_CALLS, "request", None)
    n = request.position.get(id(module)) if request is not None else None
    if n is None:
        return
    if n == 1 and 0 in request.wanted:
        request.captured[0] = args[0] if args else kwargs["hidden_states"]
    if n > request.stop:
        raise _ExitReached


def install_exit_hooks(model: nn.Module) -> None:
    """Put the exit hooks on every layer once (they do nothing outside a call that asks for them)."""
    for layer in layer_stack(model):
        if _read_output not in layer._forward_hooks.values():
            layer.register_forward_hook(_read_output)
            layer.register_forward_pre_hook(_stop_or_read_input, with_kwargs=True)


def run_to_exits(model: nn.Module, stack: nn.ModuleList, wanted: list[int], features: dict) -> dict[int, torch.Tensor]:
    """Run `model` on `features` up to the deepest of the `wanted` layers of its `stack` (hooked by
    install_exit_hooks) and return what each wanted layer gave (0: the embedding output)."""
    request = ExitRequest(stack, wanted)
    outer, _CALLS.request = getattr(_CALLS, "request", None), request
    try:
        model(**features)
    except _ExitReached:
        pass
    finally:
        _CALLS.request = outer
    return request.captured
