"""What a Trainer (matryoshka2d.training.trainer) does around its optimizer steps: the STS-B dev evaluation,
checkpoints and an exact resume, and the run itself: the output folder prepared, the steps logged, the final
evaluation and the model saved with what the run recorded.

RunLoop is the Trainer's base class: its methods read what the Trainer builds (config, encoder, method, task loss,
data, optimizer, scheduler, run folder, processes) and call its `train_step`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from matryoshka2d import outputs
from matryoshka2d.evaluate.sts import sts_dev_score
from matryoshka2d.paths import sts_dev_file
from matryoshka2d.training import checkpoints, exit_heads
from matryoshka2d.training.config import DEFAULT_LOSSES, check_resumable, eval_cells, resolved_paths
from matryoshka2d.training.data import read_training_data
from matryoshka2d.training.throughput import host_values


class RunLoop:
    """Evaluation, checkpoints and the run of a Trainer (see the module docstring)."""

    # ---- evaluation, checkpoints --------------------------------------------------------------------

    def eval_path(self) -> Path:
        return Path(self.config.eval_file) if self.config.eval_file else sts_dev_file()

    def check_eval_file(self) -> None:
        """Read the evaluation file now: a typo must not cost a whole run (it is read again at the end)."""
        from matryoshka2d.evaluate.sts import load_pairs

        try:
            path = self.eval_path()
        except FileNotFoundError as exc:
            raise ValueError(f"no evaluation file: {exc}; pass --eval-file") from None
        try:
            load_pairs(path)
        except ValueError as exc:
            flag = "--eval-file" if self.config.eval_file else "the default evaluation file (set --eval-file)"
            raise ValueError(f"{flag}: {exc}") from None

    def evaluate(self) -> list[dict]:
        """One record per evaluated cell (--eval-cell, one or several; default the full model)."""
        path = self.eval_path()
        records = []
        for layer, dim in eval_cells(self.config) or [(self.encoder.num_layers, self.encoder.hidden_size)]:
            keep = getattr(self.method, "keep_layers", None)
            if keep:
                layer = min(layer, keep)
            score = sts_dev_score(self.encoder, path, layer, dim)
            records.append(
                {"step": self.step, "eval": f"{Path(path).name}@({layer},{dim})", "spearman": round(score, 2)}
            )
        return records

    def modules(self) -> dict[str, torch.nn.Module]:
        """What a checkpoint holds the weights of: the encoder, the method's and the task loss's parameters."""
        return {"encoder": self.encoder, "method": self.method, "task_loss": self.task_loss}

    def save_checkpoint(self) -> Path:
        return self.run_dir.save_checkpoint(
            self.step,
            self.modules(),
            self.optimizer,
            self.scheduler,
            self.history,
            self.saved_config(),
            scaler=self.scaler,
            keep=self.config.keep_checkpoints,
        )

    def saved_config(self) -> dict:
        """The run's options as JSON values, with the loss it uses even when that was the default, and the files
        and folders they name resolved (config.resolved_paths: a resume compares files, not spellings)."""
        return json.loads(json.dumps(resolved_paths({**dataclasses.asdict(self.config), "loss": self.loss_name})))

    def check_same_run(self, checkpoint: Path, saved: dict) -> None:
        if saved.get("loss") is None:  # written before the loss was recorded: the data's default loss
            saved = {**saved, "loss": DEFAULT_LOSSES[read_training_data(self.config.data).kind][0]}
        check_resumable(checkpoint, saved, self.saved_config())

    def resume(self, allow_pickle: bool = False) -> bool:
        found = checkpoints.load_latest(
            self.run_dir.checkpoints, self.encoder.device, allow_pickle=allow_pickle, check_config=self.check_same_run
        )
        if found is None:
            return False
        folder, state = found
        try:
            for name, module in self.modules().items():
                module.load_state_dict(state["modules"].get(name, {}))
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise checkpoints.CheckpointError(
                f"{folder}: does not fit this model ({str(exc).splitlines()[0]})"
            ) from None
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        checkpoints.restore_rng(state["rng"])
        self.step, self.history = state["step"], state["history"]
        return True

    # ---- the run: prepare the folder, the steps, the final evaluation and save ------------------------------

    def run(
        self, resume: bool = False, progress: bool = True, overwrite: bool = False, allow_pickle: bool = False
    ) -> Path:
        """Train from step 0 (or from the last checkpoint) to total_steps, evaluate, save the model; returns
        its folder. With several processes, rank 0 alone writes the log, the checkpoints and the model."""
        main = self.processes.main
        self.prepare_run(resume, overwrite, allow_pickle)
        log = outputs.open_for_append(self.run_dir.log_path) if main else _NoLog()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (progress and main), desc=self.config.method)
        start, first_step = time.perf_counter(), self.step
        try:
            self.steps(log, bar)
        finally:
            bar.close()
            log.close()
            self._prefetch.close()
        seconds = time.perf_counter() - start
        if not main:
            self.processes.barrier()  # until rank 0 has saved the model
            self.processes.close()
            return self.out
        saved = self.save_model(seconds, self.step - first_step)
        self.processes.barrier()
        self.processes.close()
        return saved

    def prepare_run(self, resume: bool, overwrite: bool, allow_pickle: bool) -> None:
        """The output folder checked (and cleared for --overwrite), the last checkpoint loaded for --resume."""
        main = self.processes.main
        self.run_dir.check(resume, overwrite)
        if overwrite and not resume and main:
            self.run_dir.clear_run()
        outputs.make_folder(self.out)
        self.processes.barrier()
        if resume:
            if self.resume(allow_pickle=allow_pickle) and main:
                print(f"resumed from step {self.step} of {self.total_steps}")
            if main:
                self.run_dir.trim_log(self.step)
        exit_heads.fit_at_start(self)  # --exit-heads fit: the closed-form start (not after a resume)

    def steps(self, log, bar) -> None:
        """Optimizer steps to total_steps. Their losses stay on the device until a logging or checkpoint step,
        which reads back (one host sync) the records of every step since the last one and logs them."""
        cfg, main, pending = self.config, self.processes.main, []
        self._lazy_records = True
        try:
            while self.step < self.total_steps:
                pending.append(self.train_step())
                bar.update(1)
                last = self.step == self.total_steps
                checkpoint = bool(cfg.save_steps) and self.step % cfg.save_steps == 0
                if last or checkpoint or self.step % cfg.log_every == 0:
                    self.write_records(pending, log, bar)
                    pending = []
                if main and cfg.eval_steps and self.step % cfg.eval_steps == 0 and not last:
                    for result in self.evaluate():
                        log.write(json.dumps(result) + "\n")
                        bar.write(f"step {self.step}: STS {result['eval']} spearman {result['spearman']}")
                if main and checkpoint:
                    self.save_checkpoint()
                log.flush()
        finally:
            self._lazy_records = False

    def write_records(self, records: list[dict], log, bar) -> None:
        for record in records:
            record.update(host_values(record))
            if not math.isfinite(record["loss"]):  # before any checkpoint or model holds what it did to the weights
                kept = checkpoints.candidates(self.run_dir.checkpoints)
                raise ValueError(
                    f"step {record['step']}: the loss is {record['loss']} (not finite); the run stops there, and "
                    + (f"its last checkpoint ({kept[0].name}) is kept: " if kept else "no model is saved: ")
                    + "lower --lr, check the data and the start model, then train again (--resume goes on from the "
                    "last checkpoint)"
                )
            self.history.append({"step": record["step"], "loss": record["loss"]})
            log.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{records[-1]['loss']:.4f}")

    def extra_metadata(self) -> dict:
        """What a subclass records with the model beside the run's record (distillation: its teacher)."""
        return {}

    def complete_saved(self, folder: Path) -> None:
        """What a subclass adds to the saved folder before it is moved into place (distillation: the checksum of a
        query encoder's own weights, read back from the folder)."""

    def save_model(self, seconds: float, steps_run: int) -> Path:
        """The final evaluation, then the model with what the run recorded (matryoshka2d.json), atomically."""
        from matryoshka2d.models.lora import save_and_merge_lora

        final_evals = self.evaluate()
        with outputs.open_for_append(self.run_dir.log_path) as f:
            f.writelines(json.dumps(record) + "\n" for record in final_evals)
        metadata = {
            "method": self.method.config(),
            "trained_widths": sorted(self.method.widths()),  # -> matryoshka_dimensions in config.json
            "loss": self.loss_name,
            "loss_terms": self.task_loss.describe(self.data.kind) if hasattr(self.task_loss, "describe") else None,
            "training": dataclasses.asdict(self.config),
            "examples": len(self.data),
            "data_kind": self.data.kind,
            "steps": self.step,
            "seconds_this_run": round(seconds, 1),
            "seconds_per_step": round(seconds / steps_run, 4) if steps_run else None,
            "processes": self.processes.world,
            "final_eval": final_evals[0],  # the first --eval-cell (or the full model)
            "final_evals": final_evals,  # every --eval-cell
            **self.extra_metadata(),
        }
        self.encoder.eval()
        keep = getattr(self.method, "keep_layers", None)

        def save(folder: Path) -> Path:
            save_and_merge_lora(self.encoder, folder)  # the adapter beside the model; the model saved merged
            saved = self.encoder.save(folder, keep_layers=keep, metadata=metadata)
            self.complete_saved(Path(saved))
            return saved

        return checkpoints.save_model_atomically(save, self.out)


class _NoLog:
    """The log of a process other than rank 0, which writes none (nothing is opened)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
