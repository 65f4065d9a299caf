"""A run's folder: what it holds (model, log, checkpoints), what makes it "taken", and its log after a resume.

OUTPUT/
  train_log.jsonl           one JSON record per logged step and evaluation
  checkpoints/step-NNNNNNN  what a resume needs (matryoshka2d.training.checkpoints)
  matryoshka2d.json, ...    the saved model, written last and atomically
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from matryoshka2d.files import check_apart
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
        (option, path) pairs the run reads, must lie apart from it (rule 2, files.check_apart). --resume and
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

    def saved_model(self) -> str | None:
        """What saved model the folder holds, in words (with its step count when a run wrote it), or None."""
        held = [name for name in MODEL_MARKERS if (self.path / name).exists()]
        if not held:
            return None
        try:
            meta = json.loads((self.path / "matryoshka2d.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = None
        if isinstance(meta, dict) and isinstance(meta.get("steps"), int):
            method = meta["method"].get("method") if isinstance(meta.get("method"), dict) else None
            how = f", method {method}" if method else ""
            return f"a finished model ({meta['steps']} steps{how}, per matryoshka2d.json)"
        return f"a saved model ({', '.join(held)})"

    def clear_run(self) -> None:
        """--overwrite without --resume: the old checkpoints and log go (the model is replaced when saved)."""
        shutil.rmtree(self.checkpoints, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)

    def trim_log(self, step: int) -> None:
        """After a resume, drop the log records of steps after the checkpoint: they are run again."""
        path = self.log_path
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
        tmp = path.with_name(".train_log.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)

    def save_checkpoint(self, step: int, modules: dict, optimizer, scheduler, history, config: dict, scaler, keep: int):
        """Write everything a resume needs (safetensors + JSON, with a manifest) into a temporary folder, then
        rename it: a kill leaves no half (matryoshka2d.training.checkpoints). Keeps the newest `keep`."""
        root = self.checkpoints
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{step:07d}"
        tmp = root / f".tmp-step-{step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        checkpoints.write_checkpoint(tmp, modules, optimizer, scheduler, step, history, config, scaler=scaler)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final
