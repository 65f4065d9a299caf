"""`eval mteb`: mteb's tasks on cells of one model (a pair's query side included), mteb's result files per cell and
our grid from them.

For each task, each cell runs through `mteb.evaluate` (mteb/evaluate.py) with a `ResultCache` in a temporary folder of
the one writer (outputs.temporary_folder): mteb writes its own files there, in its own layout
(`results/<model>/<revision>/<Task>.json`, model_meta.json, run_settings.jsonl: mteb/cache/result_cache.py,
`save_to_cache`), and the finished folder is moved into place as `OUTPUT/<layer>x<dim>` (outputs.move_into_place), so
`mteb.ResultCache(OUTPUT/6x384).load_results()` reads it as any mteb cache. `overwrite_strategy="always"`: the
temporary cache is new and empty, so mteb never takes a result from elsewhere. Tasks run one after the other, every
cell of a task before the next task, so the vectors one task's texts get in one pass serve all its cells
(mteb_encoder.SharedPass) and are dropped after it.

What the files say of each cell: the revision folder is the weights' sha256 (models.identity.weights_sha256, the
`weights_sha256` of results.json's model record); `evaluation_time` is the cell's own evaluation, the task's encoding
pass that made its vectors (one pass shared by the cells, so the cells' times overlap by it) plus its own scoring,
where mteb alone would have given the first cell the whole pass and the next ones only their scoring. The grid
keeps each task's main score under its own name (cosine_spearman, ndcg_at_10, accuracy): an average is taken over
the tasks of one metric only, never across metrics.

mteb is optional: this module imports it only inside functions; `require_mteb` says how to install it.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matryoshka2d.cells import Cell
from matryoshka2d.evaluate.results import GridResult, grid_result, model_record, provenance
from matryoshka2d.outputs import move_into_place, remove_tree, temporary_folder

ROOT = Path(__file__).resolve().parents[3]  # the checkout holding src/matryoshka2d, when installed from one
# How to install the extra, as help texts say it (the same on every machine): the package is on no index.
INSTALL = "`make`'s set-up installs it; else, from the checkout's root, `.venv/bin/pip install -e '.[mteb]'`"


def install_line() -> str:
    """A command that installs mteb into the interpreter running this: the checkout's `mteb` extra when the package
    was installed from its source folder (`make` does: `pip install -e '.[dev]'`), else mteb itself."""
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    if (ROOT / "pyproject.toml").is_file() and (ROOT / "src" / "matryoshka2d").is_dir():
        return f"{pip} -e {shlex.quote(str(ROOT) + '[mteb]')}"
    return f"{pip} 'mteb>=2.26'"


class MtebMissingError(ValueError):
    """mteb is not installed."""


def require_mteb() -> None:
    """Import mteb, or say how to install it (an error `main` prints as one line, exit 2)."""
    try:
        import mteb  # noqa: F401
    except ImportError as exc:
        raise MtebMissingError(f"`eval mteb` needs mteb, which is not installed ({exc}): {install_line()}") from None


class TaskLoadError(ValueError):
    """A task whose data could not be loaded (mteb's tasks load from the Hugging Face hub)."""


def load_task(task) -> None:
    """Load a task's data before anything is encoded; a hub task that cannot be reached is named with its dataset."""
    try:
        task.load_data()
    except ValueError:
        raise  # our readers' errors already name the file and line
    except Exception as exc:
        dataset = task.metadata.dataset.get("path")
        raise TaskLoadError(
            f"task {task.metadata.name}: its data ({dataset}) could not be loaded: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}. mteb's own tasks load from the Hugging Face hub; "
            "offline, give the task's files with --task-dir (a BEIR folder or an STS .tsv file)"
        ) from None


def task_record(task) -> dict:
    """What a result says of a task: its type, dataset (path and revision), split, subsets and main score."""
    meta = task.metadata
    return {
        "type": meta.type,
        "dataset": meta.dataset.get("path"),
        "revision": meta.dataset.get("revision"),
        "splits": list(meta.eval_splits),
        "subsets": list(task.hf_subsets or ["default"]),
        "main_score": meta.main_score,
        "local": type(task).__module__.startswith("matryoshka2d."),
        "source": str(getattr(task, "path", None) or getattr(task, "directory", None) or "") or "the Hugging Face hub",
    }


@dataclass
class MtebRequest:
    """What `eval mteb` is asked: the cells (none: the full cell), the task names (none: every --task-dir task, else
    STSBenchmark), where local tasks come from, a pair's query side (a query model or a query cell), the output."""

    output: Path
    cells: list[Cell] = field(default_factory=list)
    tasks: list[str] | None = None
    task_dirs: list[str] = field(default_factory=list)
    data_dir: str | None = None
    query_model: str | None = None
    query_cell: Cell | None = None
    batch_size: int = 64
    show_progress: bool = False


def run_eval_mteb(
    request: MtebRequest,
    load_model: Callable[..., object],
    write_results: Callable[[GridResult], int],
    log: Callable[[str], None],
) -> int:
    """The whole of `eval mteb`: the tasks resolved and the model's card checked before anything is encoded, every
    cell scored, the grid written (`write_results`), then the card's model-index refreshed. `load_model(path=None,
    **options)` loads --model (or `path`) as the command's options ask."""
    require_mteb()
    from matryoshka2d.evaluate import mteb_encoder, mteb_tasks
    from matryoshka2d.models.identity import weights_sha256

    catalogue = mteb_tasks.local_catalogue(_data_root(request.data_dir), request.task_dirs)
    names = request.tasks or list(catalogue.own) or ["STSBenchmark"]
    tasks = mteb_tasks.resolve_tasks(names, catalogue)  # before the model loads
    encoder = load_model()
    card = _card_to_refresh(encoder, request.output, log)  # a card that cannot be read is refused before the work
    query_cell = request.query_cell
    cells = request.cells or [(encoder.num_layers, query_cell[1] if query_cell else encoder.hidden_size)]
    documents = mteb_encoder.SharedPass(encoder, cells, request.batch_size, request.show_progress)  # checks cells
    if request.query_model:
        student = load_model(request.query_model, pooling=None)
        query = mteb_encoder.query_model_side(encoder, student.query_encoder or student, cells, request.batch_size)
    elif query_cell:
        query = mteb_encoder.query_cell_side(encoder, query_cell, cells, request.batch_size)
    else:
        query = mteb_encoder.pair_folder_side(encoder, cells, request.batch_size)
    revision = weights_sha256(encoder)  # the weights the cells are cut from name mteb's revision folder
    encoders = {cell: mteb_encoder.CellEncoder(documents, cell, query, revision) for cell in cells}
    shared = [documents, *([query.queries] if query is not None else [])]
    settings = {"query_side": query.label if query is not None else None, "cells": [list(c) for c in cells]}
    result = evaluate_mteb(
        encoders, tasks, request.output, shared, documents.embedder, settings, request.batch_size, log
    )
    code = write_results(result)
    if card is not None:
        from matryoshka2d.models.card import refresh_model_index

        refresh_model_index(card.parent, Path(str(encoder.name)).name)
        print(f"model card -> {card} (model-index: the mteb results in {card.parent})")
    return code


def _data_root(given: str | None) -> Path | None:
    """--data-dir, else the shared data when there is one (none: the tasks come from --task-dir or from mteb)."""
    from matryoshka2d.paths import data_dir

    try:
        return data_dir(given)
    except FileNotFoundError:
        if given:
            raise
        return None


def _card_to_refresh(encoder, output: Path, log: Callable[[str], None]) -> Path | None:
    """The card (README.md) of the --model folder when OUTPUT lies inside it, checked to be one whose front matter can
    be read and rewritten (models.card.check_card: UTF-8, YAML); the card is the one file of the model folder the
    command writes, allowed by name of the folder. None when OUTPUT lies elsewhere or the folder has no card."""
    from matryoshka2d.models.card import check_card
    from matryoshka2d.outputs import allow_folder

    folder = Path(encoder.location) if encoder.location else None
    if folder is None or not folder.is_dir() or not output.resolve().is_relative_to(folder.resolve()):
        return None
    if not (folder / "README.md").is_file():
        log(f"{folder} has no model card (README.md): none was written; a save of the model writes one with them")
        return None
    check_card(folder)
    allow_folder(folder)
    return folder / "README.md"


def evaluate_mteb(
    encoders: dict[Cell, object],
    tasks: Sequence,
    output: Path,
    shared: Sequence,
    embedder_info,
    settings: dict,
    batch_size: int = 64,
    log: Callable[[str], None] | None = None,
) -> GridResult:
    """Run every task on every cell (`encoders`: cell -> mteb_encoder.CellEncoder), mteb's files of each cell into
    `output/<cell>`, and return the grid of main scores x 100, each task's under its main score's name. `shared`:
    the SharedPass objects whose vectors are dropped after each task; `embedder_info`: what the grid records of the
    model (an EncoderCells)."""
    from matryoshka2d.evaluate.mteb_encoder import cell_label

    log = log or (lambda message: print(message, file=sys.stderr))
    for task in tasks:  # every task's data before any encoding: a missing file or an unreachable hub fails first
        load_task(task)
    started, start = provenance(), time.perf_counter()
    staging = {cell: temporary_folder(output, cell_label(cell)) for cell in encoders}
    scores, described, timing = [], {}, {}
    try:
        for task in tasks:
            described[task.metadata.name] = task_record(task)
            rows, timing[task.metadata.name] = _evaluate_task(task, encoders, staging, shared, batch_size, log)
            scores += rows
            for one in shared:
                one.forget()
            task.unload_data()
        for cell, folder in staging.items():
            remove_tree(output / cell_label(cell))  # an earlier run's, replaced under --overwrite only (checked before)
            move_into_place(folder, output / cell_label(cell))
    finally:
        for folder in staging.values():
            remove_tree(folder)
    seconds = {"total": time.perf_counter() - start, "tasks": timing}
    metrics = list(dict.fromkeys(record["main_score"] for record in described.values()))
    settings = {**settings, "metric": "each task's mteb main score x 100, under its own name", "tasks": described}
    settings["mteb_folders"] = {cell_label(cell): str(output / cell_label(cell)) for cell in encoders}
    settings["mteb"] = _version("mteb")
    names = [task.metadata.name for task in tasks]
    return grid_result(
        "mteb", metrics, names, scores, list(encoders), model_record(embedder_info), settings, seconds, started
    )


def _evaluate_task(task, encoders, staging, shared, batch_size, log) -> tuple[list[dict], dict]:
    """One task on every cell: its score rows, and its times (the shared encoding pass, each cell's scoring). Each
    cell's result file is rewritten with its own evaluation time once the task's pass is known in full."""
    import mteb
    from mteb.cache import ResultCache

    from matryoshka2d.evaluate.mteb_encoder import cell_label

    name, metric = task.metadata.name, task.metadata.main_score

    def encoded() -> float:
        return sum(one.seconds for one in shared)

    before, rows, scoring, results = encoded(), [], {}, {}
    for cell, encoder in encoders.items():
        start, encoding = time.perf_counter(), encoded()
        result = mteb.evaluate(
            encoder,
            task,
            cache=ResultCache(staging[cell]),
            overwrite_strategy="always",
            co2_tracker=False,
            show_progress_bar=False,
            encode_kwargs={"batch_size": batch_size, "show_progress_bar": False},
        )
        if result.exceptions:
            raise TaskLoadError(f"task {name}, cell {cell_label(cell)}: {result.exceptions[0].exception}")
        (results[cell],) = result.task_results
        scoring[cell] = max(0.0, time.perf_counter() - start - (encoded() - encoding))
        score = 100 * float(results[cell].get_score())
        rows.append({"dataset": name, "layer": cell[0], "dim": cell[1], metric: score})
        routed = ", ".join(f"{n} texts through the {side}" for side, n in sorted(encoder.routed.items()))
        log(f"{name} at {cell_label(cell)}: {metric} x 100 = {score:.2f} ({routed}; scored in {scoring[cell]:.1f} s)")
        encoder.routed.clear()
    pass_seconds = encoded() - before
    for cell, encoder in encoders.items():
        meta = encoder.mteb_model_meta
        path = ResultCache(staging[cell]).get_task_result_path(name, meta.name, meta.revision)
        results[cell].model_copy(update={"evaluation_time": pass_seconds + scoring[cell]}).to_disk(path)
    log(f"{name}: one encoding pass of {pass_seconds:.1f} s for {len(encoders)} cell(s)")
    return rows, {"encoding": pass_seconds, "scoring": {cell_label(cell): s for cell, s in scoring.items()}}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
