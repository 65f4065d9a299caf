"""What a run writes to disk, written so that nothing in it can run code and a kill leaves no half.

Checkpoints (OUTPUT/checkpoints/step-NNNNNNN/):
- `tensors.safetensors`: every tensor (encoder, method, task loss, the optimizer's per-parameter state, torch's
  RNG state), flat keys such as `encoder.model.embeddings.word_embeddings.weight` or `optimizer.3.exp_avg`;
- `state.json`: the step, the loss history, the scheduler's state, the optimizer's layout (parameter groups and
  any non-tensor state), numpy's and Python's RNG states;
- `config.json`: the training options of the run;
- `manifest.json`, written last: the size and sha256 of each of those files, checked before anything is read.
No file is unpickled: safetensors and JSON cannot carry code. A checkpoint written by an older version
(`state.pt`, a pickle) is read only when the caller opts in (`--allow-pickle-checkpoint`), and then with
`torch.load(weights_only=True)`, which refuses arbitrary objects.

The final model (`save_model_atomically`) is written into a hidden temporary folder inside the output folder,
then moved in file by file in an order that keeps the folder either the previous complete model, not loadable
at all, or the new complete model: the entry points (`config.json`, `modules.json`) go first on the way out
and last on the way in.

Every write, rename and delete goes through the one writer (matryoshka2d.outputs): a link in the place of a file
is replaced, never written through, and a link in the place of a folder is refused, never followed for deletion.
Every read goes through the one confined reader (confined.ConfinedFolder): a checkpoint holding a link that leaves
it is refused before any of its files is opened.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

from matryoshka2d import outputs
from matryoshka2d.confined import ConfinedFolder, OutsideFolderError, inside
from matryoshka2d.files import file_sha256

TENSORS, STATE, CONFIG, MANIFEST = "tensors.safetensors", "state.json", "config.json", "manifest.json"
LEGACY = "state.pt"
FORMAT = "matryoshka2d-checkpoint"
PICKLE_FLAG = "--allow-pickle-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or in a format that is not read without opting in; names which."""


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


# ---- writing ---------------------------------------------------------------------------------------------


def _flatten(prefix: str, state: dict, tensors: dict[str, torch.Tensor]) -> None:
    for key, value in state.items():
        # A copy on the CPU: safetensors refuses tensors that share memory (tied weights).
        tensors[f"{prefix}.{key}"] = value.detach().to("cpu").contiguous().clone()


def _optimizer_parts(state_dict: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """The optimizer's per-parameter tensors go to `tensors`; its layout and any other value is returned."""
    other: dict[str, dict] = {}
    for index, values in state_dict["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value.detach().to("cpu").contiguous().clone()
            else:
                other.setdefault(str(index), {})[name] = value
    return {"param_groups": state_dict["param_groups"], "other_state": other, "indices": list(state_dict["state"])}


def write_checkpoint(
    folder: Path,
    modules: dict[str, torch.nn.Module],
    optimizer,
    scheduler,
    step: int,
    history: list,
    config: dict,
    scaler=None,
) -> None:
    """Write a complete checkpoint into `folder` (a fresh temporary folder the caller renames afterwards).
    `scaler`: fp16 training's GradScaler, whose state (a few numbers) goes into the JSON."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        _flatten(name, module.state_dict(), tensors)
    optimizer_layout = _optimizer_parts(optimizer.state_dict(), tensors)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    np_state = np.random.get_state()
    state = {
        "format": FORMAT,
        "version": 1,
        "step": step,
        "history": history,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "optimizer": optimizer_layout,
        "rng": {
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        },
    }
    with outputs.writing(folder / TENSORS) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    outputs.write_text(folder / STATE, json.dumps(state))
    outputs.write_text(folder / CONFIG, json.dumps(config, indent=2))
    files = {}
    for name in (TENSORS, STATE, CONFIG):
        _fsync(folder / name)
        files[name] = {"bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
    outputs.write_text(folder / MANIFEST, json.dumps({"format": FORMAT, "version": 1, "files": files}, indent=2))
    _fsync(folder / MANIFEST)


# ---- reading ---------------------------------------------------------------------------------------------


def confined(folder: Path) -> ConfinedFolder:
    """The checkpoint folder, its links checked before anything in it is opened (a link that leaves it, to another
    run's files or anywhere, is a CheckpointError naming it)."""
    try:
        return ConfinedFolder(folder, "checkpoint")
    except OutsideFolderError as exc:
        raise CheckpointError(str(exc)) from None


def _path(checkpoint: ConfinedFolder, name: str, named_by: Path, field: str) -> Path:
    try:
        return checkpoint.path(name, named_by, field)
    except OutsideFolderError as exc:
        raise CheckpointError(str(exc)) from None


def verify(folder: Path) -> None:
    """Check the manifest against the files (sizes, then sha256); raise CheckpointError naming the problem."""
    checkpoint = confined(folder)
    manifest_path = _path(checkpoint, MANIFEST, folder, "the checkpoint's manifest")
    if not manifest_path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (the checkpoint was not finished)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from None
    for name in (TENSORS, STATE, CONFIG):
        path = _path(checkpoint, name, manifest_path, "files")  # before the file is opened or hashed
        expected = files.get(name) if isinstance(files, dict) else None
        if not expected:
            raise CheckpointError(f"{manifest_path}: does not list {name}")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {expected.get('bytes')} (truncated?)")
        if file_sha256(path) != expected.get("sha256"):
            raise CheckpointError(f"{path}: sha256 differs from the manifest (the file was changed or damaged)")


def read_config(folder: Path) -> dict:
    path = _path(confined(folder), CONFIG, folder / MANIFEST, "files")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / CONFIG}: unreadable ({exc})") from None


def read_checkpoint(folder: Path, device) -> dict:
    """A verified checkpoint as {"tensors": {prefix: state_dict}, "optimizer": ..., "scheduler": ..., ...}."""
    from safetensors.torch import load_file

    verify(folder)
    checkpoint = ConfinedFolder(folder, "checkpoint", check=False)  # verify checked its links
    state = json.loads(_path(checkpoint, STATE, folder / MANIFEST, "files").read_text(encoding="utf-8"))
    flat = load_file(str(_path(checkpoint, TENSORS, folder / MANIFEST, "files")), device="cpu")
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        prefix, _, rest = key.partition(".")
        groups.setdefault(prefix, {})[rest] = value
    layout = state["optimizer"]
    per_param: dict[int, dict] = {int(i): {} for i in layout["indices"]}
    for key, value in groups.pop("optimizer", {}).items():
        index, _, name = key.partition(".")
        per_param[int(index)][name] = value
    for index, values in layout["other_state"].items():
        per_param[int(index)].update(values)
    for group in layout["param_groups"]:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    optimizer = {"state": per_param, "param_groups": layout["param_groups"]}
    rng = groups.pop("rng", {})
    return {
        "modules": {k: {n: t.to(device) for n, t in v.items()} for k, v in groups.items()},
        "optimizer": optimizer,
        "scheduler": state["scheduler"],
        "scaler": state.get("scaler"),
        "step": int(state["step"]),
        "history": state["history"],
        "rng": {
            "torch": rng.get("torch"),
            "cuda": [rng[k] for k in sorted(rng) if k.startswith("cuda.")],
            **state.get("rng", {}),
        },
    }


def read_legacy(folder: Path, device, allow_pickle: bool) -> dict:
    """A checkpoint from before this format: `state.pt`, a pickle. Read only if the user opted in."""
    path = _path(confined(folder), LEGACY, folder, "an old-format checkpoint")
    if not allow_pickle:
        raise CheckpointError(
            f"{path} is an old-format checkpoint (a pickle file; unpickling a file can run code planted in it). "
            f"If you wrote it yourself, resume with {PICKLE_FLAG}; otherwise delete {folder}"
        )
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: cannot be read as plain tensors and values ({str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path}: not a matryoshka2d checkpoint")
    optimizer = state["optimizer"]
    return {
        "modules": {k: state[k] for k in ("encoder", "method", "task_loss") if k in state},
        "optimizer": optimizer,
        "scheduler": state["scheduler"],
        "scaler": state.get("scaler"),
        "step": int(state["step"]),
        "history": state["history"],
        "rng": {},
    }


def restore_rng(rng: dict) -> None:
    if rng.get("torch") is not None:
        torch.set_rng_state(rng["torch"].to("cpu", torch.uint8))
    if rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to("cpu", torch.uint8) for s in rng["cuda"]])
    if rng.get("numpy"):
        kind, keys, *rest = rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    if rng.get("python"):
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))


def candidates(root: Path) -> list[Path]:
    """Checkpoint folders, newest first (finished ones only: temporary folders start with a dot)."""
    found = [
        p
        for p in root.glob("step-*")
        if p.is_dir() and ((p / MANIFEST).exists() or (p / LEGACY).exists() or (p / TENSORS).exists())
    ]
    return sorted(found, reverse=True)


def load_latest(root: Path, device, allow_pickle: bool = False, check_config=None) -> tuple[Path, dict] | None:
    """The newest checkpoint that is complete and intact; a damaged one is skipped with a warning naming it.

    `check_config(folder, saved_config)` may raise to refuse a checkpoint of another run (that is an error,
    not a reason to fall back)."""
    if root.is_symlink():  # another run's checkpoints: never read as this run's (nor written or deleted)
        raise CheckpointError(
            f"{root} is a symbolic link (-> {os.readlink(root)}): a run reads only checkpoints of its own; nothing "
            "was read: remove the link"
        )
    problems = []
    for folder in candidates(root):
        legacy = not (folder / MANIFEST).exists() and (folder / LEGACY).exists()
        try:
            try:  # a checkpoint folder that is a link out of the run is not read
                inside(root, folder.name, root, "a checkpoint folder")
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            confined(folder)  # nor one holding a link out (before its config is read)
            if check_config is not None and (folder / CONFIG).is_file():
                check_config(folder, read_config(folder))
            state = read_legacy(folder, device, allow_pickle) if legacy else read_checkpoint(folder, device)
        except CheckpointError as exc:
            if legacy and not allow_pickle:
                raise
            problems.append(str(exc))
            print(f"warning: skipping damaged checkpoint: {exc}", file=sys.stderr)
            continue
        if problems:
            print(f"warning: resuming from the previous checkpoint {folder}", file=sys.stderr)
        return folder, state
    if problems:
        raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(problems))
    return None


# ---- the final model -------------------------------------------------------------------------------------

# Files through which sentence-transformers, transformers and ElasticEncoder open a model folder. Without
# config.json nothing loads; modules.json decides whether the Dense head is used, so it goes in before it.
ENTRY_POINTS = ("modules.json", "config.json")
RUN_FILES = ("train_log.jsonl", "checkpoints")


def _is_model_file(name: str) -> bool:
    """Files an earlier model save may have left that must not mix with a new one (stale tokenizer, head)."""
    lowered = name.lower()
    return (
        lowered.endswith((".safetensors", ".safetensors.index.json", ".model"))
        or lowered.startswith(("tokenizer", "special_tokens", "added_tokens", "vocab", "merges", "sentence_"))
        or lowered
        in (
            "2_dense",
            "1_pooling",
            "config_sentence_transformers.json",
            "matryoshka2d.json",
            "generation_config.json",
            "modules.json",
            "config.json",
            "static",  # a static cell (models.static)
        )
    )


SAVING = "saving-model"  # the temporary folder's name: OUT/.saving-model.m2d-tmp-XXXX (.saving-model before)


def _remove(path: Path) -> None:
    """A file or folder the save replaces: a link in its place is removed as a link (what it points at, another
    model's files, is never touched); a folder of its own is deleted."""
    if path.is_dir() and not path.is_symlink():
        outputs.remove_tree(path)
    else:
        outputs.remove_file(path)


def save_model_atomically(save, out: Path) -> Path:
    """`save(folder)` writes a complete model folder; it is written to a hidden temporary folder in OUT, then moved
    into OUT so that a kill at any point leaves OUT as the previous model, not loadable, or the new model."""
    out = outputs.make_folder(out)
    for left in out.glob(f".{SAVING}*"):  # what a killed save left
        _remove(left)
    tmp = outputs.temporary_folder(out, SAVING)
    try:
        save(tmp)
        new = sorted(p.name for p in tmp.iterdir())
        for path in tmp.rglob("*"):
            if path.is_file():
                _fsync(path)
        # 1. Close the doors: from here until step 3 ends the folder loads nowhere.
        for name in reversed(ENTRY_POINTS):
            outputs.remove_file(out / name)
        # 2. Take out what the previous model had and the new one does not (e.g. its pooler head, tokenizer.json).
        for old in out.iterdir():
            if old.name in new or old.name.startswith(".") or old.name in RUN_FILES or not _is_model_file(old.name):
                continue
            _remove(old)
        # 3. Move the new files in, entry points last (modules.json, then config.json).
        order = [n for n in new if n not in ENTRY_POINTS] + [n for n in ENTRY_POINTS if n in new]
        for name in order:
            target = out / name
            if (tmp / name).is_dir() or target.is_dir():  # a folder is not renamed over: the old one goes first
                _remove(target)
            outputs.move_into_place(tmp / name, target)
    finally:
        outputs.remove_tree(tmp)
    return out
