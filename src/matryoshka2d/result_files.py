"""Result files (results.json of a grid, cascade.json of a cascade) have one reader: `read_result_record` checks
every field its readers use and stops at the first that is wrong, naming the file and the field (docs/reliability.md,
rule 6). `eval`, `pick`, `report`, the model card and the benchmarks all read through it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from matryoshka2d.files import read_json

GRID_FIELDS = ("task", "metric", "average", "layers", "dims")
# The fields of a result's model record that pick, report and the card read: each a string (or null: not recorded)
# or a whole number; the weights checksum a sha256, 64 hex digits, as models.identity.weights_sha256 writes it.
MODEL_STRINGS = ("model", "location", "pooling", "backend", "precision", "architecture")
MODEL_NUMBERS = ("layers", "hidden_size", "max_length")
SHA256 = re.compile(r"[0-9a-f]{64}")


class ResultFileError(ValueError):
    """A results.json or cascade.json that is not what `eval` writes; the message names the file and the field."""


def _whole_number(value, place: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ResultFileError(f"{place}: {value!r} is not a whole number of at least {least}")
    return value


def _score(value, place: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ResultFileError(f"{place}: {value!r} is not a score (a JSON number)")
    return float(value)


def _list_of(record: dict, key: str, file: Path, kind: type, required: bool = True) -> list:
    value = record.get(key)
    if key not in record and not required:  # absent from older files; null where a list belongs is refused
        return []
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        shown = "missing" if key not in record else f"{type(value).__name__} {str(value)[:60]!r}"
        raise ResultFileError(f"{file}: field '{key}' must be a list of {kind.__name__}s, got {shown}")
    return value


def check_model_record(record: dict, file: Path) -> None:
    """The result's `model` record, where it has one: each field its readers use of the kind they use it as (a
    checksum a hand edit made a number was a TypeError of whatever sliced it)."""
    model = record.get("model")
    if model is None:
        return
    if not isinstance(model, dict):
        raise ResultFileError(f"{file}: field 'model' must be the model's record (an object)")
    for key in MODEL_STRINGS:
        if model.get(key) is not None and not isinstance(model[key], str):
            raise ResultFileError(f"{file}: model.{key}: {str(model[key])[:40]!r} is not a string")
    for key in MODEL_NUMBERS:
        if model.get(key) is not None:
            _whole_number(model[key], f"{file}: model.{key}")
    checksum = model.get("weights_sha256")
    if checksum is not None and not (isinstance(checksum, str) and SHA256.fullmatch(checksum)):
        raise ResultFileError(
            f"{file}: model.weights_sha256: {str(checksum)[:70]!r} is not a sha256 checksum (64 hex digits, as "
            "`matryoshka2d eval` writes it)"
        )


def check_summary(record: dict, file: Path) -> None:
    """The summary `report` prints: its average and shallow average scores, the cell of the average."""
    summary = record.get("summary") or {}
    for key in ("average", "shallow_average"):
        if key in summary and (summary[key] is not None or key == "shallow_average"):
            _score(summary[key], f"{file}: summary.{key}")
    if summary.get("average") is not None:
        cell = summary.get("cell")
        if not isinstance(cell, list) or len(cell) != 2:
            raise ResultFileError(f"{file}: summary.cell: {str(cell)[:40]!r} is not a cell [layer, dim]")
        _whole_number(cell[0], f"{file}: summary.cell[0]", 0)
        _whole_number(cell[1], f"{file}: summary.cell[1]")
    for i, layer in enumerate(_list_of(summary, "shallow_layers", file, object, required=False)):
        _whole_number(layer, f"{file}: summary.shallow_layers[{i}]", 0)


def _cell_row(row: dict, place: str, metrics: list[str]) -> tuple[int, int]:
    for key in ("layer", "dim"):
        if key not in row:
            raise ResultFileError(f"{place}: no '{key}'")
    # layer 0 is a model's static cell (models.static)
    cell = _whole_number(row["layer"], f"{place}.layer", 0), _whole_number(row["dim"], f"{place}.dim")
    for metric in metrics:
        if metric in row:
            _score(row[metric], f"{place}.{metric}")
    return cell


def check_grid_record(record, file: Path) -> dict:
    """A results.json's contents, every field pick and report use checked (see above); returns it."""
    if not isinstance(record, dict):
        raise ResultFileError(f"{file}: not a matryoshka2d result (a JSON {type(record).__name__}, not an object)")
    if missing := [k for k in GRID_FIELDS if k not in record]:
        raise ResultFileError(f"{file}: not a matryoshka2d result (missing {', '.join(missing)})")
    for key in ("task", "metric"):
        if not isinstance(record[key], str):
            raise ResultFileError(f"{file}: field '{key}' must be a string, got {record[key]!r}")
    metrics = _list_of(record, "metrics", file, str, required=False) or [record["metric"]]
    _list_of(record, "datasets", file, str, required=False)
    for key in ("layers", "dims"):
        for i, value in enumerate(_list_of(record, key, file, object)):
            _whole_number(value, f"{file}: {key}[{i}]", 0 if key == "layers" else 1)
    for key in ("model", "settings", "seconds", "provenance", "summary"):
        if key in record and not isinstance(record[key], dict):
            raise ResultFileError(f"{file}: field '{key}' must be an object, got {type(record[key]).__name__}")
    check_model_record(record, file)
    check_summary(record, file)
    per_dataset: dict[tuple[int, int], dict[str, list[float]]] = {}
    for i, row in enumerate(_list_of(record, "scores", file, dict, required=False)):
        cell = _cell_row(row, f"{file}: scores[{i}]", metrics)
        if not isinstance(row.get("dataset"), str):
            raise ResultFileError(f"{file}: scores[{i}].dataset: {row.get('dataset')!r} is not a dataset name")
        for metric in metrics:
            if metric in row:
                per_dataset.setdefault(cell, {}).setdefault(metric, []).append(float(row[metric]))
    for i, row in enumerate(_list_of(record, "average", file, dict)):
        place = f"{file}: average[{i}]"
        cell = _cell_row(row, place, metrics)
        if not per_dataset:
            continue  # a file without per-dataset rows has nothing to check its averages against
        for metric in metrics:
            if metric not in row:
                continue
            scores = per_dataset.get(cell, {}).get(metric)
            if not scores:
                raise ResultFileError(f"{place}.{metric}: an average for cell {cell} that has no per-dataset score")
            mean, said = math.fsum(scores) / len(scores), float(row[metric])
            same = (math.isnan(mean) and math.isnan(said)) or math.isclose(mean, said, rel_tol=1e-6, abs_tol=1e-6)
            if not same:
                raise ResultFileError(
                    f"{place}.{metric}: {said!r} contradicts the mean of the cell's {len(scores)} per-dataset "
                    f"scores, {mean!r}"
                )
    return record


def check_cascade_record(record: dict, file: Path) -> dict:
    """A cascade.json's contents: rows of a mode (a string) and an nDCG@10 (a score), and the model's record."""
    rows = record.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ResultFileError(f"{file}: field 'rows' must be a non-empty list of rows, got {str(rows)[:60]!r}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ResultFileError(f"{file}: rows[{i}] must be an object, got {type(row).__name__}")
        for key in ("mode", "ndcg@10"):
            if key not in row:
                raise ResultFileError(f"{file}: rows[{i}]: no '{key}'")
        if not isinstance(row["mode"], str):
            raise ResultFileError(f"{file}: rows[{i}].mode: {row['mode']!r} is not a string")
        _score(row["ndcg@10"], f"{file}: rows[{i}].ndcg@10")
    if not isinstance(record.get("model"), dict):
        raise ResultFileError(f"{file}: field 'model' must be the model's record (an object)")
    check_model_record(record, file)
    return record


def read_result_record(path: str | Path, kinds: tuple[str, ...] = ("grid", "cascade")) -> tuple[str, Path, dict]:
    """('grid' or 'cascade', the file, its checked contents) of a result file, or of the results.json or
    cascade.json in a result folder; anything else is a ResultFileError naming the file and the field."""
    given = Path(path)
    names = {"grid": "results.json", "cascade": "cascade.json"}
    candidates = [given / names[k] for k in kinds] if given.is_dir() else [given]
    file = next((f for f in candidates if f.is_file()), None)
    if file is None:
        raise FileNotFoundError(
            f"{path}: no {' or '.join(names[k] for k in kinds)} (give a folder or file that `matryoshka2d eval` wrote)"
        )
    record = read_json(file, ResultFileError)  # names file and field of anything it cannot read
    if isinstance(record, dict) and record.get("task") == "retrieval-cascade":
        if "cascade" not in kinds:
            raise ResultFileError(f"{file}: a cascade result of `eval retrieval`; give a grid's results.json")
        return "cascade", file, check_cascade_record(record, file)
    return "grid", file, check_grid_record(record, file)
