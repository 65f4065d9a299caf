"""A run's folder: what it holds (model, log, checkpoints), what makes it "taken", and its log after a resume.

OUTPUT/
  train_log.jsonl           one JSON record per logged step and evaluation
  checkpoints/step-NNNNNNN  what a resume needs (matryoshka2d.training.checkpoints)
  matryoshka2d.json, ...    the saved model, written last and atomically

Everything a run writes, renames or deletes goes through the one writer (matryoshka2d.outputs); a `checkpoints/`
that is a symbolic link (to another run's, say) is refused before any work, never followed to delete, fill or read
that run's files. What a resume reads goes through the confined reader (confined.ConfinedFolder): a run folder holding
a link that leaves it is refused before anything in it is opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from matryoshka2d import outputs
from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.outputs import OutputError, check_apart
from matryoshka2d.training import checkpoints

# What makes a folder "hold a model or a run": `train` does not write into it without --resume or --overwrite.
RUN_MARKERS = (
    "train_log.jsonl",
    "checkpoints",
    "matryoshka2d.json",
    "modules.json",
    "config.json",
    "model.safetensors",
)
# What makes a folder hold a saved model (a finished run or any model folder): `--resume` never replaces one.
MODEL_MARKERS = ("matryoshka2d.json", "modules.json", "config.json", "model.safetensors")


class RunDir:
    """The output folder of one training run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def log_path(self) -> Path:
        return self.path / "train_log.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def check(self, resume: bool, overwrite: bool, inputs=()) -> None:
        """A folder holding another model or run is not written into unless the user says so; `inputs`, the
        (option, path) pairs the run reads, must lie apart from it (rule 1, outputs.check_apart). --resume and
        --overwrite are two answers to one question (continue the run there, or start it again), so not both."""
        if resume and overwrite:
            raise ValueError(
                "--resume and --overwrite exclude each other: --resume continues the run in --output from its last "
                "checkpoint, --overwrite deletes its checkpoints and log and trains afresh; give one"
            )
        check_apart(self.path, "--output", inputs)
        if not self.path.exists():
            return
        if not self.path.is_dir():
            raise ValueError(f"--output {self.path} is a file, not a folder")
        if self.checkpoints.is_symlink():  # before any work: --overwrite would delete, --resume read its target
            raise OutputError(
                f"--output {self.path}: {self.checkpoints} is a symbolic link (-> {os.readlink(self.checkpoints)}); "
                "a run keeps its checkpoints in a folder of its own and never reads, fills or deletes them through a "
                "link, which could reach another run's: nothing was done: remove the link or choose another --output"
            )
        if resume:
            self.confined()  # a link out of the run is refused before its checkpoints or log are read
        held = sorted(p.name for p in self.path.iterdir() if p.name in RUN_MARKERS)
        if held and not (resume or overwrite):
            raise ValueError(
                f"--output {self.path} already holds a model or a run ({', '.join(held)}); pass --resume to continue "
                "it, --overwrite to replace it, or choose another --output"
            )
        if resume and not overwrite and not checkpoints.candidates(self.checkpoints):
            model = self.saved_model()
            if model is not None:
                raise ValueError(
                    f"--resume: {self.path} holds {model} and no checkpoint to resume from (no {self.checkpoints}); "
                    "--resume never replaces a model: pass --overwrite instead to train a new one in its place, or "
                    "choose another --output"
                )

    def confined(self) -> ConfinedFolder:
        """The run folder for reading: its links checked first (OutsideFolderError names one that leaves it)."""
        return ConfinedFolder(self.path, "run")

    def saved_model(self) -> str | None:
        """What saved model the folder holds, in words (with its step count when a run wrote it), or None."""
        held = [name for name in MODEL_MARKERS if (self.path / name).exists()]
        if not held:
            return None
        try:
            meta = json.loads(self.confined().read_text("matryoshka2d.json"))
        except (OSError, ValueError):  # a link out (OutsideFolderError) is not read: described by its names
            meta = None
        if isinstance(meta, dict) and isinstance(meta.get("steps"), int):
            method = meta["method"].get("method") if isinstance(meta.get("method"), dict) else None
            how = f", method {method}" if method else ""
            return f"a finished model ({meta['steps']} steps{how}, per matryoshka2d.json)"
        return f"a saved model ({', '.join(held)})"

    def clear_run(self) -> None:
        """--overwrite without --resume: the old checkpoints and log go (the model is replaced when saved). A
        `checkpoints/` that is a link is refused (outputs.remove_tree), never followed; a log that is a link is
        removed as a link."""
        outputs.remove_tree(self.checkpoints)
        outputs.remove_file(self.log_path)

    def trim_log(self, step: int) -> None:
        """After a resume, drop the log records of steps after the checkpoint: they are run again."""
        path = self.confined().path(self.log_path.name)  # a log that links out of the run is refused, not read
        if not path.is_file():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line)
        outputs.write_text(path, "".join(line + "\n" for line in kept))

    def save_checkpoint(self, step: int, modules: dict, optimizer, scheduler, history, config: dict, scaler, keep: int):
        """Write everything a resume needs (safetensors + JSON, with a manifest) into a temporary folder, then
        rename it: a kill leaves no half (matryoshka2d.training.checkpoints). Keeps the newest `keep`."""
        root = outputs.make_folder(self.checkpoints, own=True)  # a link there is refused, never filled
        final = root / f"step-{step:07d}"
        for left in root.glob(".*step-*"):  # what a killed save left (.tmp-step-N before the one writer)
            if left.is_dir() and not left.is_symlink():
                outputs.remove_tree(left)
        tmp = outputs.temporary_folder(root, final.name)
        try:
            checkpoints.write_checkpoint(tmp, modules, optimizer, scheduler, step, history, config, scaler=scaler)
            _remove(final)  # the same step saved before (a run resumed from an earlier checkpoint)
            outputs.move_into_place(tmp, final)
        finally:
            if tmp.exists():
                outputs.remove_tree(tmp)
        for old in sorted(root.glob("step-*"))[:-keep]:
            _remove(old)
        return final


def _remove(path: Path) -> None:
    """A checkpoint folder of the run's own is deleted; a link in its place is removed as a link, never followed."""
    if path.is_symlink() or path.is_file():
        outputs.remove_file(path)
    else:
        outputs.remove_tree(path)
