"""The (layer, dim) grid and the "cell embedder" every evaluator works through.

Evaluators never call a model directly. They hand a list of distinct texts to a CellEmbedder and get back one
array per (layer, dim) cell. The default embedder runs the encoder once up to the deepest requested layer and
slices widths from the pooled states, so a whole grid costs about one full-depth encoding. Anything else that
can produce cells, such as a post-hoc PCA reducer fitted on a corpus or a trained pooler head, plugs into the
same evaluators by implementing the three methods of the protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from matryoshka2d.cells import Cell, nested_dims


@runtime_checkable
class CellEmbedder(Protocol):
    """Anything that turns distinct texts into one array per (layer, dim) cell."""

    def cells(self) -> list[Cell]:
        """The cells this embedder produces, sorted by layer then dim."""
        ...

    def embed(self, texts: Sequence[str]) -> dict[Cell, np.ndarray]:
        """Arrays of shape (len(texts), dim), row i for texts[i]; texts are already distinct."""
        ...

    def info(self) -> dict:
        """What to record about the model: at least 'model', 'layers' (depth) and 'hidden_size' (full width)."""
        ...


def default_dims(hidden_size: int, start: int = 8) -> list[int]:
    """8, 16, 32, ... doubling while below the hidden size, then the hidden size itself (384 -> 8..256, 384)."""
    return nested_dims(hidden_size, start)


def check_cells(
    layers: Iterable[int], dims: Iterable[int], num_layers: int, hidden_size: int, static: bool = False
) -> tuple[list, list]:
    """Sorted, de-duplicated layers and dims, each in range (layer 0 where the model holds a static cell,
    `static`); the error says the valid range."""
    layers, dims = sorted(set(layers)), sorted(set(dims))
    if not layers or not dims:
        raise ValueError("need at least one layer and one dim")
    lowest = 0 if static else 1
    bad = [n for n in layers if not lowest <= n <= num_layers]
    if bad:
        hint = (
            " (layer 0 is a static cell, which this model does not hold: `matryoshka2d distill --mode static` makes "
            "one)"
            if 0 in bad and not static
            else ""
        )
        raise ValueError(f"layers {bad} out of range: the model has layers {lowest}..{num_layers}{hint}")
    bad = [d for d in dims if not 1 <= d <= hidden_size]
    if bad:
        raise ValueError(f"dims {bad} out of range: the model's embeddings have 1..{hidden_size} numbers")
    return layers, dims


class EncoderCells:
    """The default CellEmbedder: one ElasticEncoder pass per call, every requested layer, widths by slicing.

    The returned arrays are views into the full-width pooled states, so a grid of many dims costs no more
    memory than one array per layer.
    """

    def __init__(
        self,
        encoder,
        layers: Iterable[int] | None = None,
        dims: Iterable[int] | None = None,
        batch_size: int = 64,
        show_progress: bool = False,
        compare_heads: bool = False,
    ):
        """`compare_heads`: every pass also makes the cells without the exit heads (from the same pooled
        vectors), for the embedder `without_heads()` returns: both sides of a comparison from one pass."""
        self.encoder = encoder
        self.compare_heads = compare_heads
        # texts -> the cells without heads of each pass over them, oldest first (two datasets may hold the same texts)
        self._without: dict[tuple[str, ...], list[dict[Cell, np.ndarray]]] = {}
        self.layers, self.dims = check_cells(
            layers or encoder.layers,
            dims or default_dims(encoder.hidden_size),
            encoder.num_layers,
            encoder.hidden_size,
            static=encoder.static_cell is not None,
        )
        self.batch_size = batch_size
        self.show_progress = show_progress

    def cells(self) -> list[Cell]:
        return [Cell(n, d) for n in self.layers for d in self.dims]

    def embed(self, texts: Sequence[str]) -> dict[Cell, np.ndarray]:
        if not self.compare_heads:
            pooled = self.encoder.pooled_states(texts, self.layers, self.batch_size, self.show_progress)
            return {Cell(n, d): pooled[n][:, :d] for n in self.layers for d in self.dims}
        reads = self.encoder.pooled_inputs(self.layers, heads=True)  # what the heads read, and the layers
        raw = self.encoder.pooled_states(texts, reads, self.batch_size, self.show_progress, pooled=True)
        sides = {}
        for heads in (True, False):
            full = self.encoder.cells_from_pooled(raw, self.layers, heads=heads)
            sides[heads] = {Cell(n, d): full[n][:, :d] for n in self.layers for d in self.dims}
        self._without.setdefault(tuple(texts), []).append(sides[False])
        return sides[True]

    def without_heads(self) -> CellEmbedder:
        """The same cells without exit heads, read from what embed() made (call it on the same texts after)."""
        return _Remembered(self, self._without)

    def info(self) -> dict:
        precision = str(next(self.encoder.parameters()).dtype).replace("torch.", "")
        return {**self.encoder.info(), "batch_size": self.batch_size, "backend": "torch", "precision": precision}


class _Remembered:
    """A CellEmbedder that serves cells another embedder already computed for the same texts."""

    def __init__(self, source: EncoderCells, cells: dict[tuple[str, ...], list[dict[Cell, np.ndarray]]]):
        self.source, self.stored = source, cells

    def cells(self) -> list[Cell]:
        return self.source.cells()

    def embed(self, texts: Sequence[str]) -> dict[Cell, np.ndarray]:
        try:
            passes = self.stored[tuple(texts)]
            cells = passes.pop(0)
        except (KeyError, IndexError):
            raise ValueError("these texts were not embedded by the first pass of the comparison") from None
        if not passes:
            del self.stored[tuple(texts)]  # what both sides are done with is not kept
        return cells

    def info(self) -> dict:
        return {**self.source.info(), "exit_heads": None, "heads": "off (compared in the same pass)"}


def embed_distinct(embedder: CellEmbedder, texts: Sequence[str]) -> tuple[dict[Cell, np.ndarray], dict[str, int]]:
    """Embed each distinct text once; return the cell arrays and the row of every text in them."""
    rows: dict[str, int] = {}
    for t in texts:
        rows.setdefault(t, len(rows))
    return embedder.embed(list(rows)), rows
