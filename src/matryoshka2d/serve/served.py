"""Cells as a serving backend computes them, so that the quality `pick` weighs is the quality that will be served.

A backend is named the way `pick --backend` and the results name it:

- `torch`: the ElasticEncoder in float32 (`serve --backend torch`);
- `onnx`: one fp32 ONNX graph per exit layer (`serve --backend onnx`);
- `onnx-int8`: the same graphs after onnxruntime's dynamic int8 quantization (`serve --backend onnx --quantize int8`).

`BackendCells` is a CellEmbedder (evaluate/grid.py) over the server's own backend objects (serve/backends.py):
the onnx graphs come from the same cache, built and checked the same way, as `serve --backend onnx` uses, so an
int8 score is measured on the graphs that serve, never assumed from fp32. Its `info()` records the backend, the
precision and the sha256 of every graph it ran, and `served_as()` reads that back from any result file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from matryoshka2d.cells import Cell
from matryoshka2d.evaluate.grid import check_cells, default_dims

BACKENDS = ("torch", "onnx", "onnx-int8")
TEXTS_PER_CALL = 1024  # texts handed to the backend at once while a grid is scored (the progress bar's step)


def parse_backend(name: str) -> tuple[str, str | None]:
    """'onnx-int8' -> ('onnx', 'int8'); the error lists the names there are."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose {', '.join(BACKENDS)}")
    kind, _, quantize = name.partition("-")
    return kind, quantize or None


def backend_name(kind: str, quantize: str | None) -> str:
    return kind if kind == "torch" or not quantize else f"{kind}-{quantize}"


def served_as(model: dict) -> str:
    """The backend a result file's model record was scored with. Results written before backends were recorded,
    and every torch result, were computed by torch in the encoder's precision."""
    backend = model.get("backend") or "torch"
    precision = model.get("precision")
    if backend == "torch":
        return "torch" if precision in (None, "float32") else f"torch-{precision}"
    return backend_name(backend, None if precision in (None, "fp32") else precision)


def make_backend(encoder, name: str, layers: Iterable[int] | None = None, threads=None, batch_size=64, log=None):
    """The server's backend object for `name`; onnx ones build (or take from the cache) only `layers`' graphs."""
    from matryoshka2d.serve.backends import OnnxBackend, TorchBackend

    kind, quantize = parse_backend(name)
    if kind == "torch":
        return TorchBackend(encoder, batch_size=batch_size)
    from matryoshka2d.export.onnx_graphs import require_onnx

    require_onnx()
    return OnnxBackend(
        encoder, quantize, sorted(set(layers)) if layers else None, threads=threads, batch_size=batch_size, log=log
    )


def backend_record(backend) -> dict:
    """What a result records about the backend: its name, precision and, for onnx, each graph's sha256."""
    described = backend.describe()
    record = {"backend": described["backend"], "precision": described["precision"]}
    cache = getattr(backend, "cache", None)
    if cache is not None:
        record["graphs"] = str(cache.folder)
        record["graphs_sha256"] = {
            str(n): cache.graphs[path.name]["sha256"] for n, path in sorted(backend.paths.items())
        }
    return record


class BackendCells:
    """A CellEmbedder that runs each layer's graph of a serving backend, widths by slicing (as the server does:
    a cell is the first `dim` numbers of the layer's output, made unit length after)."""

    def __init__(self, encoder, backend, layers=None, dims=None, show_progress: bool = False):
        self.encoder, self.backend, self.show_progress = encoder, backend, show_progress
        self.layers, self.dims = check_cells(
            layers or encoder.layers,
            dims or default_dims(encoder.hidden_size),
            encoder.num_layers,
            encoder.hidden_size,
            static=encoder.static_cell is not None,
        )
        self.batch_size = backend.batch_size

    def cells(self) -> list[Cell]:
        return [(n, d) for n in self.layers for d in self.dims]

    def embed(self, texts: Sequence[str]) -> dict[Cell, np.ndarray]:
        from tqdm.auto import tqdm

        texts = list(texts)
        bar = tqdm(
            total=len(texts) * len(self.layers),
            desc=f"{self.backend_name} graphs",
            unit="text",
            disable=not self.show_progress,
        )
        out = {}
        for n in self.layers:
            parts = []
            for start in range(0, len(texts), TEXTS_PER_CALL):
                chunk = texts[start : start + TEXTS_PER_CALL]
                parts.append(self.backend.pooled(chunk, n))
                bar.update(len(chunk))
            pooled = np.concatenate(parts) if parts else np.zeros((0, self.encoder.hidden_size), np.float32)
            out.update({(n, d): pooled[:, :d] for d in self.dims})
        bar.close()
        return out

    @property
    def backend_name(self) -> str:
        return served_as(backend_record(self.backend))

    def info(self) -> dict:
        return {**self.encoder.info(), "batch_size": self.batch_size, **backend_record(self.backend)}
