"""What runs the model behind `matryoshka2d serve`: torch, or onnxruntime with one graph per exit layer.

A backend answers one question, the full-width sentence vectors of some texts at one exit layer
(`pooled(texts, layer, encoded)`; `encoded`, when given, is the texts' unpadded tokenizer output, which the server
already made to count tokens), and knows the model's shape and tokenizer. The server does everything else (the
API, validation, micro-batching, slicing to `dimensions`, normalising, errors) the same way for every backend.

- TorchBackend: the ElasticEncoder (pooled_states: length-sorted batches, the exit stops the stack).
- OnnxBackend: one ONNX graph per exit layer, each exactly `encoder.forward(features, [layer])` (ExitGraph in
  export/onnx_graphs.py: the layers up to the exit, pooling, and whatever forward applies after pooling), full
  width; the width is sliced after, by the server. `quantize="int8"`: each graph in int8. The graphs come from the
  cache beside the model, built and checked there (serve/graph_cache.py). One onnxruntime session per layer,
  loaded at its first request, or up front for the layers given (`layers`): then only those are served, and
  memory is the sum of their sessions (measured at load: `session_mb`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from matryoshka2d import outputs
from matryoshka2d.export.graph_check import session as _session
from matryoshka2d.export.onnx_graphs import ExportError
from matryoshka2d.models.batching import inference_batches, pad_rows
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve.graph_cache import GraphCache, build_graph, default_cache_folder, trusted, weights_digest

BACKENDS = ("torch", "onnx")
# The fixed cost of one onnxruntime call in token positions (minilm-l6, one thread, CPU time, 1-8 texts of 10
# tokens): fp32 about 2 ms at layer 3 against 0.1 ms per position; int8 0.4-1.1 ms at layers 3-6 against
# 0.05-0.1 ms (benchmarks/call_overhead.py; used by models/batching.inference_batches).
ONNX_CALL_OVERHEAD_TOKENS = {None: 20.0, "int8": 10.0}


def rss_mb() -> float:
    """This process's resident memory, from /proc (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Backend(Protocol):
    """What runs a model for the server, the ladder and pick (TorchBackend, OnnxBackend, the tests' fakes); it may
    also have `release_memory()`, which the micro-batcher calls at rest."""

    tokenizer: Any  # the model's (the server counts tokens with copies of it)
    pooling: str | None
    num_layers: int
    hidden_size: int
    max_length: int  # tokens per text
    layers: list[int]  # the layers it answers (0 first where the model holds a static cell)

    def pooled(self, texts: list[str], layer: int, encoded: dict | None = None) -> np.ndarray:
        """Full-width vectors at `layer`, one row per text; `encoded`: the texts' unpadded tokenizer output."""

    def describe(self) -> dict:
        """What /v1/models says of it: at least `backend` and `precision`, never a path of the machine."""


class TorchBackend:
    """The encoder itself, in fp32 (or whatever it was loaded in); `layers`: the only layers it answers (default:
    every layer of the model, and its static cell)."""

    kind = "torch"

    def __init__(self, encoder: ElasticEncoder, batch_size: int = 64, layers: list[int] | None = None):
        self.encoder, self.batch_size = encoder, batch_size
        self.tokenizer, self.pooling = encoder.tokenizer, encoder.pooling
        self.num_layers, self.hidden_size, self.max_length = encoder.num_layers, encoder.hidden_size, encoder.max_length
        # 0 too where the model holds a static cell (models.static)
        self.layers = sorted({encoder.check_layer(n) for n in layers}) if layers else encoder.layers

    def pooled(self, texts: list[str], layer: int, encoded=None) -> np.ndarray:
        """`encoded` (the transformer's tokens) is not used at layer 0: the static cell tokenizes on its own."""
        return self.encoder.pooled_states(texts, [layer], batch_size=self.batch_size, encoded=encoded)[layer]

    def describe(self) -> dict:
        return {"backend": "torch", "precision": str(next(self.encoder.parameters()).dtype).replace("torch.", "")}


class OnnxBackend:
    """One onnxruntime session per exit layer, on graphs from the cache (built there first if needed)."""

    kind = "onnx"

    def __init__(
        self,
        encoder: ElasticEncoder,
        quantize: str | None = None,
        layers: list[int] | None = None,
        cache_folder: str | Path | None = None,
        threads: int | None = None,
        batch_size: int = 64,
        log=None,
    ):
        if quantize not in (None, "int8"):
            raise ExportError(f"--quantize {quantize!r} is not supported; choose int8")
        self.log = log or (lambda message: print(message, file=sys.stderr))
        self.tokenizer, self.pooling = encoder.tokenizer, encoder.pooling
        self.num_layers, self.hidden_size, self.max_length = encoder.num_layers, encoder.hidden_size, encoder.max_length
        self.quantize, self.batch_size = quantize, batch_size
        self.threads = threads or torch.get_num_threads()
        self.layers = sorted({encoder.check_layer(n) for n in layers}) if layers else encoder.layers
        # Layer 0, a static cell (models.static), is a table lookup and a small matrix: it stays in torch, kept
        # here so that the transformer can go once the graphs are loaded.
        self.static_cell = encoder.static_cell if 0 in self.layers else None
        self.up_front = bool(layers)
        source = weights_digest(encoder)
        folder = Path(cache_folder) if cache_folder else default_cache_folder(encoder, source)
        # The cache is kept by design inside the model's folder (onnx-serve/), which a command such as `eval` reads:
        # its files may be written there; the cache folder still may not be, or hold, an input of the command.
        outputs.allow_folder(folder)
        outputs.check_destination(folder, "--onnx-cache")
        self.cache = GraphCache(folder, source, encoder.pooling)
        # Every servable layer's graph exists before the first request (building one takes seconds): after
        # this the torch model is no longer needed, and a request never waits for an export.
        self.paths = {}
        for n in (n for n in self.layers if n > 0):
            path = trusted(encoder, self.cache, n, quantize, self.log)
            if path is None:
                self.log(f"building the ONNX graph of layer {n}{' (int8)' if quantize else ''} in {self.cache.folder}")
                path = build_graph(encoder, self.cache, n, quantize, self.log)
            self.paths[n] = path
        self.sessions, self.session_mb = {}, {}  # by layer: its onnxruntime session, the MB it took at load

    def load(self) -> None:
        """Load the sessions of the layers given up front (none without `layers`: each loads at its first
        request). The server calls it once the torch model is gone, so each session's memory is measured
        against a heap that the model's freed pages do not pad."""
        if self.up_front:
            for n in self.paths:
                self._session(n)

    def _session(self, layer: int):
        session = self.sessions.get(layer)
        if session is None:
            before = rss_mb()
            session = _session(self.paths[layer], self.threads)
            self.sessions[layer] = session
            self._run(session, ["warm-up"])  # the arena's first allocation counts towards the session
            self.session_mb[layer] = rss_mb() - before
            self.log(f"onnxruntime session for layer {layer} loaded: {self.session_mb[layer]:+.0f} MB resident")
        return session

    def _run(self, session, texts: list[str], encoded=None) -> np.ndarray:
        names = [i.name for i in session.get_inputs()]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length) if encoded is None else encoded
        lengths = [len(x) for x in encoded["input_ids"]]
        out = np.zeros((len(texts), self.hidden_size), dtype=np.float32)
        for idx in inference_batches(lengths, self.batch_size, ONNX_CALL_OVERHEAD_TOKENS[self.quantize]):
            features = pad_rows(self.tokenizer, encoded, idx, names)
            (vectors,) = session.run(None, {k: v.numpy() for k, v in features.items()})
            out[idx] = vectors
        return out

    def pooled(self, texts: list[str], layer: int, encoded=None) -> np.ndarray:
        if layer == 0 and self.static_cell is not None:  # its own tokenizer: `encoded` is not used
            return self.static_cell.encode(texts)
        return self._run(self._session(layer), texts, encoded)

    def release_memory(self) -> None:
        """Give back what each session's memory arena grew to under load (the server calls it when its queue runs
        dry): one tiny run with onnxruntime's arena shrinkage on. The arena stays on for speed (without it, 4-5%
        more CPU per text, int8 layer 3); a burst of large batches grew it by 25-30 MB, which this returns."""
        import onnxruntime as ort

        shrink = ort.RunOptions()
        shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        for session in self.sessions.values():
            names = [i.name for i in session.get_inputs()]
            features = pad_rows(self.tokenizer, self.tokenizer(["release"]), [0], names)
            session.run(None, {k: v.numpy() for k, v in features.items()}, shrink)

    def describe(self) -> dict:
        return {
            "backend": "onnx",
            "precision": self.quantize or "fp32",
            "sessions_loaded": sorted(self.sessions),
            "session_mb": {str(n): round(mb, 1) for n, mb in sorted(self.session_mb.items())},
        }
