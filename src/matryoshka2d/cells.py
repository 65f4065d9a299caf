"""A cell is one (layer, dim) of a model: pool the state after `layer` layers, keep the first `dim` numbers.

The one home of the term: `Cell`, its one parser (both notations a user types: `3x128`, as the server's names
and `--query-cell` write it, and `3:128`, as `--cells` lists write it; `(3,128)` too), its one label (`3x128`),
lists of cells and of layer numbers (`1,3,6`, `1-6`), the nested widths of MRL and 2DMSE, and a cell's vectors
made unit rows. Every command, the server, the index and the pair read cells through here, so a cell means the
same thing, and is refused with the same message, wherever it is typed.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

# Digits are bounded so that a typo of a thousand digits is refused here, not turned into a number that a layer
# range later tries to enumerate (range(1, 10**1000) is a MemoryError, not a message).
_CELL = re.compile(r"\(?\s*(\d{1,9})\s*[xX:,]\s*(\d{1,9})\s*\)?")
_NUMBER_DIGITS = 9
_LONGEST_RANGE = 100_000  # layers and widths of any model fit; a billion-number range is a typo, not a request


class Cell(NamedTuple):
    """One (layer, dim): layer 0 is a model's static cell, layers 1..N its exits; dim the first numbers kept.
    A tuple, so `layer, dim = cell` and the (layer, dim) tuples older callers pass both work."""

    layer: int
    dim: int

    @classmethod
    def parse(cls, text: str, option: str = "cell") -> Cell:
        """'3x128', '3:128' or '(3,128)' -> Cell(3, 128); anything else is a ValueError naming `option`."""
        match = _CELL.fullmatch((text or "").strip())
        if match is None:
            raise ValueError(f"{option}: {text!r} is not a cell; write LAYERxDIM such as 3x128 (or 3:128)")
        return cls(int(match[1]), int(match[2]))

    @property
    def label(self) -> str:
        """'3x128': how a cell is written on the command line and names its files and served names."""
        return f"{self.layer}x{self.dim}"

    def __str__(self) -> str:
        return self.label


def parse_cells(text: str, option: str = "cells") -> list[Cell]:
    """'1:32,2:64', '1x32 2x64' or '(1,32) (2,64)' -> [Cell(1, 32), Cell(2, 64)]; the error names `option` and the
    part it could not read."""
    cells, position = [], 0
    for match in _CELL.finditer(text or ""):
        between = text[position : match.start()]
        if between.strip(" ,;"):
            raise ValueError(
                f"{option}: cannot read cell {between.strip(' ,;')!r} in {text!r}; write LAYERxDIM, e.g. 2x64"
            )
        cells.append(Cell(int(match[1]), int(match[2])))
        position = match.end()
    rest = (text or "")[position:]
    if rest.strip(" ,;"):
        raise ValueError(f"{option}: cannot read cell {rest.strip(' ,;')!r} in {text!r}; write LAYERxDIM, e.g. 2x64")
    if not cells:
        raise ValueError(f"{option}: no cells in {text!r}; write LAYERxDIM items, e.g. 1x32,2x64")
    return cells


def parse_numbers(
    text: str, option: str, least: int = 0, most: int | None = None, what: str = "the numbers"
) -> list[int]:
    """'1,3,6', '1-6' or '1-3,6' -> the numbers, in the order given, repeats dropped. Each is at least `least` (and
    at most `most`, when given); an empty item, a reversed range (3-1, which holds no number), a number below
    `least` (-1) or a number of more than nine digits is a ValueError naming `option` (and the numbers as `what`:
    'layers start at 0, got -1')."""
    out: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"{option}: {text!r} holds an empty item; write e.g. 1,3,6 or 1-6")
        low_text, dash, high_text = part[1:].partition("-")  # part[1:]: a leading '-' is a sign, refused below
        low_text = part[0] + low_text
        try:
            low, high = _whole(low_text), (_whole(high_text) if dash else None)
        except OverflowError:
            raise ValueError(
                f"{option}: {part!r} holds a number of more than {_NUMBER_DIGITS} digits; no model has that many "
                "layers or widths"
            ) from None
        except ValueError:
            raise ValueError(f"{option}: {part!r} is not a whole number or a range like 1-6") from None
        high = low if high is None else high
        if high < low:
            raise ValueError(f"{option}: {part!r} is a reversed range, which holds no number; write {high}-{low}")
        if low < least:
            raise ValueError(f"{option}: {part!r}: {what} start at {least}, got {low}")
        if most is not None and high > most:
            raise ValueError(f"{option}: {part!r}: {what} go up to {most}, got {high}")
        if high - low >= _LONGEST_RANGE:
            raise ValueError(f"{option}: {part!r} holds {high - low + 1:,} numbers; no model has that many")
        out.extend(range(low, high + 1))
        check_how_many(out, option)  # ranges that are each short enough can still add up past any model
    return list(dict.fromkeys(out))


def check_how_many(numbers: list[int], option: str) -> None:
    """Layers or widths of one list, several ranges included, are no more than any model has (_LONGEST_RANGE): a
    ValueError naming `option` before a billion of them are made."""
    if len(numbers) > _LONGEST_RANGE:
        raise ValueError(f"{option}: more than {_LONGEST_RANGE:,} numbers in all; no model has that many")


def _whole(text: str) -> int:
    """A whole number of at most nine digits, its sign included (a negative one is then named as below `least`);
    a ValueError for what is not a number, an OverflowError for a longer one (never converted: int() of thousands
    of digits is an error of its own)."""
    text = text.strip()
    digits = text.removeprefix("-")
    if not digits.isascii() or not digits.isdigit():
        raise ValueError(text)
    if len(digits.lstrip("0")) > _NUMBER_DIGITS:
        raise OverflowError(text)
    return int(text)


def nested_dims(hidden: int, start: int = 8) -> list[int]:
    """8, 16, 32, ... doubling while below `hidden`, then `hidden` itself (MRL's and 2DMSE's set)."""
    dims, d = [], start
    while d < hidden:
        dims.append(d)
        d *= 2
    return [*dims, hidden]


def unit_rows(x) -> np.ndarray:
    """A cell's vectors scaled to length 1, as a new contiguous float32 array; an all-zero row stays zero
    instead of becoming NaN. Cosine similarity is the inner product of unit rows."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
