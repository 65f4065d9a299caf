"""A view is one (layer, dim) cell of a model: pool the state after `layer` layers, keep the first `dim` numbers.

Every method in the papers is a choice of views per step, with weights, plus extra alignment terms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class View:
    layer: int
    dim: int
    weight: float = 1.0

    def __str__(self) -> str:
        return f"({self.layer},{self.dim})" + ("" if self.weight == 1.0 else f"x{self.weight:.3g}")


def unit_rows(x) -> np.ndarray:
    """A cell's vectors scaled to length 1, as a new contiguous float32 array; an all-zero row stays zero
    instead of becoming NaN. Cosine similarity is the inner product of unit rows."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def nested_dims(hidden: int, start: int = 8) -> list[int]:
    """8, 16, 32, ... doubling while below `hidden`, then `hidden` itself (MRL's and 2DMSE's set)."""
    dims, d = [], start
    while d < hidden:
        dims.append(d)
        d *= 2
    return [*dims, hidden]


def parse_cells(text: str) -> list[tuple[int, int]]:
    """'1:32,2:64' or '(1,32) (2,64)' -> [(1, 32), (2, 64)]."""
    pattern = re.compile(r"\(?\s*(\d+)\s*[:,]\s*(\d+)\s*\)?")
    cells, position = [], 0
    for match in pattern.finditer(text):
        between = text[position : match.start()]
        if between.strip(" ,;"):
            raise ValueError(f"cannot read cell '{between.strip()}' in '{text}': write layer:dim, e.g. 2:64")
        cells.append((int(match.group(1)), int(match.group(2))))
        position = match.end()
    rest = text[position:]
    if rest.strip(" ,;"):
        raise ValueError(f"cannot read cell '{rest.strip()}' in '{text}': write layer:dim, e.g. 2:64")
    if not cells:
        raise ValueError(f"no cells in '{text}': write layer:dim pairs, e.g. 1:32,2:64")
    return cells
