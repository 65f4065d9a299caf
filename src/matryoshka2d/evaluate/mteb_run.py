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

mteb is optional: this module imports it only inside functions; `require_mteb` says how to install it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from matryoshka2d.evaluate.grid import Cell
from matryoshka2d.evaluate.results import GridResult, grid_result, model_record, provenance
from matryoshka2d.outputs import move_into_place, remove_tree, temporary_folder

INSTALL = "pip install 'matryoshka2d[mteb]'"
METRIC = "main_score"  # each task's own main score (cosine_spearman, ndcg_at_10, accuracy, ...) x 100


class MtebMissingError(ValueError):
    """mteb is not installed."""


def require_mteb() -> None:
    """Import mteb, or say how to install it (an error `main` prints as one line, exit 2)."""
    try:
        import mteb  # noqa: F401
    except ImportError as exc:
        raise MtebMissingError(f"`eval mteb` needs mteb, which is not installed ({exc}): {INSTALL}") from None


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
    `output/<cell>`, and return the grid of main scores x 100. `shared`: the SharedPass objects whose vectors are
    dropped after each task; `embedder_info`: what the grid records of the model (an EncoderCells)."""
    import mteb
    from mteb.cache import ResultCache

    from matryoshka2d.evaluate.mteb_encoder import cell_label

    log = log or (lambda message: print(message, file=sys.stderr))
    for task in tasks:  # every task's data before any encoding: a missing file or an unreachable hub fails first
        load_task(task)
    started, start = provenance(), time.perf_counter()
    staging = {cell: temporary_folder(output, cell_label(cell)) for cell in encoders}
    scores, described = [], {}
    try:
        for task in tasks:
            name = task.metadata.name
            described[name] = task_record(task)
            for cell, encoder in encoders.items():
                t0 = time.perf_counter()
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
                (task_result,) = result.task_results
                score = 100 * float(task_result.get_score())
                scores.append({"dataset": name, "layer": cell[0], "dim": cell[1], METRIC: score})
                routed = ", ".join(f"{n} texts through the {side}" for side, n in sorted(encoder.routed.items()))
                log(
                    f"{name} at {cell_label(cell)}: {task.metadata.main_score} x 100 = {score:.2f} ({routed}; "
                    f"{time.perf_counter() - t0:.1f} s)"
                )
                encoder.routed.clear()
            for one in shared:
                one.forget()
            task.unload_data()
        for cell, folder in staging.items():
            remove_tree(output / cell_label(cell))  # an earlier run's, replaced under --overwrite only (checked before)
            move_into_place(folder, output / cell_label(cell))
    finally:
        for folder in staging.values():
            remove_tree(folder)
    seconds = {"total": time.perf_counter() - start}
    settings = {**settings, "metric": f"each task's mteb main score x 100 ({METRIC})", "tasks": described}
    settings["mteb_folders"] = {cell_label(cell): str(output / cell_label(cell)) for cell in encoders}
    settings["mteb"] = _version("mteb")
    names = [task.metadata.name for task in tasks]
    return grid_result(
        "mteb", [METRIC], names, scores, list(encoders), model_record(embedder_info), settings, seconds, started
    )


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
