"""Checkpoints and model folders never run code: payloads planted in state.pt, pytorch_model.bin, *.pkl and a
config.json auto_map are not executed by any command; checkpoints are safetensors + JSON with a manifest, a
damaged latest one falls back to the previous one, and a resume refuses changed options and keeps the log clean.
"""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from helpers.models import tiny_run
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training import checkpoints
from matryoshka2d.training.checkpoints import CheckpointError
from matryoshka2d.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


class Payload:
    """Unpickling this writes a marker file: the proof that a command executed planted code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def plant_state_pt(folder, marker):
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"step": 1, "history": [], "payload": Payload(marker)}, folder / "state.pt")


def config(tiny_dir, files, out, **kw):
    """Two steps, a checkpoint after each."""
    return tiny_run(tiny_dir, files / "triplets.tsv", files / "dev.tsv", out, **{"save_steps": 1, "steps": 2, **kw})


def train_args(tiny_dir, files, out, *extra):
    return [
        "train",
        "--model",
        str(tiny_dir),
        "--pooling",
        "mean",
        "--data",
        str(files / "triplets.tsv"),
        "--eval-file",
        str(files / "dev.tsv"),
        "--batch-size",
        "8",
        "--steps",
        "2",
        "--save-steps",
        "1",
        "--lr",
        "0.001",
        "--warmup-ratio",
        "0",
        "--output",
        str(out),
        *extra,
    ]


# ---- the format --------------------------------------------------------------------------------------------


def test_checkpoints_hold_no_pickle_and_a_manifest(tiny_dir, files, tmp_path):
    Trainer(config(tiny_dir, files, tmp_path)).run(progress=False)
    folders = sorted((tmp_path / "checkpoints").iterdir())
    assert [p.name for p in folders] == ["step-0000001", "step-0000002"]
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir()) == [
            "config.json",
            "manifest.json",
            "state.json",
            "tensors.safetensors",
        ]
        manifest = json.loads((folder / "manifest.json").read_text())
        for name, entry in manifest["files"].items():
            assert (folder / name).stat().st_size == entry["bytes"] and len(entry["sha256"]) == 64
    state = json.loads((folders[-1] / "state.json").read_text())
    assert state["step"] == 2 and len(state["history"]) == 2 and state["optimizer"]["param_groups"]


# ---- planted payloads ----------------------------------------------------------------------------------------


def test_train_resume_never_unpickles_a_planted_state_pt(tiny_dir, files, tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "marker"
    plant_state_pt(out / "checkpoints" / "step-0000009", marker)
    assert main(train_args(tiny_dir, files, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "old-format checkpoint" in err and "--allow-pickle-checkpoint" in err and "Traceback" not in err
    # Even with the opt-in, torch.load(weights_only=True) refuses the payload.
    assert main(train_args(tiny_dir, files, out, "--resume", "--allow-pickle-checkpoint")) == 2
    assert "cannot be read as plain tensors" in capsys.readouterr().err
    assert not marker.exists()


def test_a_state_pt_planted_beside_a_real_checkpoint_is_ignored(tiny_dir, files, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "marker"
    Trainer(config(tiny_dir, files, out, steps=1)).run(progress=False)
    plant_state_pt(out / "checkpoints" / "step-0000001", marker)
    (out / "checkpoints" / "step-0000001" / "payload.pkl").write_bytes(pickle.dumps(Payload(marker)))
    again = Trainer(config(tiny_dir, files, out, steps=1))
    assert again.resume() and again.step == 1
    assert not marker.exists()


def test_pretrain_resume_never_unpickles(tiny_dir, files, tmp_path, capsys):
    out, marker = tmp_path / "smae", tmp_path / "marker"
    plant_state_pt(out / "checkpoints" / "step-0000003", marker)
    args = ["pretrain", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(files / "corpus.txt")]
    args += ["--steps", "1", "--batch-size", "8", "--sizes", "1:16,2:32", "--output", str(out), "--quiet"]
    args += ["--eval-file", str(files / "dev.tsv")]
    assert main([*args, "--resume"]) == 2
    assert main([*args, "--resume", "--allow-pickle-checkpoint"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert not marker.exists()


def test_two_step_never_unpickles_without_resume(tiny_dir, files, tmp_path, capsys):
    out, marker = tmp_path / "two", tmp_path / "marker"
    for d in (16, 8):
        plant_state_pt(out / "runs" / f"pooler-{d}" / "checkpoints" / "step-0000001", marker)
    args = ["two-step", "--model", str(tiny_dir), "--pooling", "mean", "--target-dim", "8", "--candidate-dims"]
    args += ["16,8", "--data", str(files / "corpus.txt"), "--loss", "simcse", "--steps", "1", "--batch-size", "8"]
    args += ["--validation-file", str(files / "dev.tsv"), "--report-file", str(files / "dev.tsv"), "--quiet"]
    args += ["--output", str(out)]
    assert main(args) == 2
    assert "--allow-pickle-checkpoint" in capsys.readouterr().err
    assert not marker.exists()


@pytest.fixture
def planted_model(tiny_dir, tmp_path):
    """A real model folder with a payload in pytorch_model.bin, a *.pkl, and an auto_map to a code file."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    marker = tmp_path / "marker"
    torch.save({"w": Payload(marker)}, folder / "pytorch_model.bin")
    (folder / "pooler.pkl").write_bytes(pickle.dumps(Payload(marker)))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def test_model_folder_payloads_are_never_executed(planted_model, files, tmp_path, capsys):
    folder, marker = planted_model
    lines = tmp_path / "in.txt"
    lines.write_text("red cat\nblue dog\n")
    assert main(["info", str(folder), "--pooling", "mean"]) == 0
    enc = ["encode", "--model", str(folder), "--pooling", "mean", "--input", str(lines)]
    assert main([*enc, "--output", str(tmp_path / "v.npy")]) == 0
    sts = tmp_path / "data" / "sts" / "raw"
    sts.mkdir(parents=True)
    (sts / "stsb_test.tsv").write_text((files / "dev.tsv").read_text())
    ev = ["eval", "sts", "--model", str(folder), "--pooling", "mean", "--data-dir", str(tmp_path / "data")]
    assert main([*ev, "--datasets", "stsb", "--output", str(tmp_path / "eval"), "--quiet"]) == 0
    assert not marker.exists()
    # Without safetensors weights the folder is refused, the .bin never opened.
    (folder / "model.safetensors").unlink()
    assert main(["info", str(folder), "--pooling", "mean"]) == 2
    assert "convert" in capsys.readouterr().err
    assert main([*enc, "--output", str(tmp_path / "w.npy")]) == 2
    assert not marker.exists()


# ---- damaged checkpoints, legacy checkpoints ---------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "empty", "no-manifest", "flip"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(tiny_dir, files, tmp_path, capsys, damage):
    Trainer(config(tiny_dir, files, tmp_path)).run(progress=False)
    latest = tmp_path / "checkpoints" / "step-0000002"
    tensors = latest / "tensors.safetensors"
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:1000])
    elif damage == "empty":
        tensors.write_bytes(b"")
    elif damage == "no-manifest":
        (latest / "manifest.json").unlink()
    else:
        data = bytearray(tensors.read_bytes())
        data[-5] ^= 0xFF
        tensors.write_bytes(bytes(data))
    again = Trainer(config(tiny_dir, files, tmp_path))
    assert again.resume() and again.step == 1
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint" in err and "step-0000002" in err and "step-0000001" in err


def test_no_intact_checkpoint_is_a_clear_error(tiny_dir, files, tmp_path, capsys):
    Trainer(config(tiny_dir, files, tmp_path)).run(progress=False)
    for folder in (tmp_path / "checkpoints").iterdir():
        (folder / "state.json").write_text("")
    assert main(train_args(tiny_dir, files, tmp_path, "--resume")) == 2
    assert "no intact checkpoint" in capsys.readouterr().err


def test_an_old_pickle_checkpoint_needs_the_flag(tiny_dir, files, tmp_path):
    """A checkpoint as older versions wrote it (state.pt): refused by default, read with weights_only=True when
    the user opts in; configs from before newer options existed count those options at their defaults."""
    trainer = Trainer(config(tiny_dir, files, tmp_path))
    trainer.train_step()
    folder = tmp_path / "checkpoints" / "step-0000001"
    folder.mkdir(parents=True)
    torch.save(
        {
            "encoder": trainer.encoder.state_dict(),
            "method": trainer.method.state_dict(),
            "task_loss": trainer.task_loss.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "step": 1,
            "history": [{"step": 1, "loss": 1.0}],
        },
        folder / "state.pt",
    )
    values = json.loads(json.dumps(trainer.config.__dict__))
    for newer in ("pooler_dim", "freeze_encoder", "lr_schedule"):
        values.pop(newer)
    (folder / "config.json").write_text(json.dumps(values))
    again = Trainer(config(tiny_dir, files, tmp_path))
    with pytest.raises(CheckpointError, match="--allow-pickle-checkpoint"):
        again.resume()
    assert again.resume(allow_pickle=True) and again.step == 1
    for key, value in again.encoder.state_dict().items():
        torch.testing.assert_close(value, trainer.encoder.state_dict()[key], rtol=0, atol=0)


# ---- resume options, the log, the output folder ---------------------------------------------------------------


def test_resume_with_changed_options_refuses_and_names_them(tiny_dir, files, tmp_path, capsys):
    assert main(train_args(tiny_dir, files, tmp_path)) == 0
    args = train_args(tiny_dir, files, tmp_path, "--resume", "--lr", "0.01", "--loss-option", "angle_weight=0.5")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "lr (checkpoint" in err and "loss_options" in err
    # Options that do not change training may change.
    assert main(train_args(tiny_dir, files, tmp_path, "--resume", "--eval-steps", "1")) == 0


def test_a_resumed_log_has_no_duplicate_steps(tiny_dir, files, tmp_path, monkeypatch):
    kw = dict(steps=4, save_steps=2)
    original = Trainer.train_step

    def dying(self):
        if self.step == 3:
            raise KeyboardInterrupt  # after step 3 was logged; the last checkpoint is step 2
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        Trainer(config(tiny_dir, files, tmp_path, **kw)).run(progress=False)
    monkeypatch.setattr(Trainer, "train_step", original)
    with (tmp_path / "train_log.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 0.')  # a line cut short by kill -9
    Trainer(config(tiny_dir, files, tmp_path, **kw)).run(resume=True, progress=False)
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


def test_a_second_train_into_the_same_folder_changes_nothing(tiny_dir, files, tmp_path, capsys):
    assert main(train_args(tiny_dir, files, tmp_path)) == 0
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(train_args(tiny_dir, files, tmp_path, "--lr", "0.01")) == 2
    err = capsys.readouterr().err
    assert "already holds a model or a run" in err and "--overwrite" in err and "--resume" in err
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before
    assert main(train_args(tiny_dir, files, tmp_path, "--lr", "0.01", "--overwrite")) == 0
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


class Killed(Exception):
    pass


def model_files(folder: Path) -> dict:
    """Contents of the model files (what a loader reads), ignoring hidden temporary folders."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


def loads(folder: Path) -> bool:
    """Either loader takes the folder (sentence-transformers is asked only when ours refuses: the answer is the
    same, any of the two, and a load takes a while)."""
    from sentence_transformers import SentenceTransformer

    try:
        ElasticEncoder(str(folder), device="cpu")
        return True
    except Exception:
        pass
    try:
        SentenceTransformer(str(folder), device="cpu")
        return True
    except Exception:
        return False


def test_a_killed_final_save_leaves_the_old_model_no_model_or_the_new_one(tiny_dir, tmp_path, monkeypatch):
    """Kill the save at every file operation in turn: whatever loads is exactly the old or the new model."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    old.add_pooler(8, seed=1)  # the old model has a pooler head, the new one none: a stale head must not survive
    old.save(old_dir, metadata={"which": "old"})
    new = ElasticEncoder(str(tiny_dir), pooling="cls", device="cpu")
    with torch.no_grad():
        new.model.embeddings.word_embeddings.weight.mul_(2)
    new.tokenizer.model_max_length = 77  # and another tokenizer config
    new.save(new_dir, metadata={"which": "new"})
    expected_old, expected_new = model_files(old_dir), model_files(new_dir)
    assert expected_old != expected_new

    def save(folder):
        new.save(folder, metadata={"which": "new"})

    real_replace, real_unlink, real_rmtree = os.replace, Path.unlink, shutil.rmtree
    outcomes = []
    for kill_at in range(40):
        out = tmp_path / f"out-{kill_at}"
        shutil.copytree(old_dir, out)
        (out / "train_log.jsonl").write_text('{"step": 1}\n')
        calls = [0]

        def counted(real, kill_at=kill_at, out=out, calls=calls):
            def wrapper(path, *args, **kwargs):
                target = args[0] if real is real_replace else path  # os.replace(src, dst): the destination
                inside = str(target).startswith(str(out)) and ".saving-model" not in Path(target).relative_to(out).parts
                if inside or str(target) == str(out / ".saving-model"):
                    if calls[0] == kill_at:
                        raise Killed
                    calls[0] += 1
                return real(path, *args, **kwargs)

            return wrapper

        monkeypatch.setattr(os, "replace", counted(real_replace))
        monkeypatch.setattr(Path, "unlink", counted(real_unlink))
        monkeypatch.setattr(shutil, "rmtree", counted(real_rmtree))
        try:
            checkpoints.save_model_atomically(save, out)
            finished = True
        except Killed:
            finished = False
        finally:
            monkeypatch.undo()
        state = model_files(out)
        state.pop("train_log.jsonl")
        if loads(out):
            assert state in (expected_old, expected_new), f"killed at operation {kill_at}: a mixed model loads"
            outcomes.append("old" if state == expected_old else "new")
        else:
            outcomes.append("none")
        assert (out / "train_log.jsonl").is_file()
        if finished:
            assert state == expected_new and not (out / ".saving-model").exists()
            break
    assert outcomes[0] == "old" and outcomes[-1] == "new" and "none" in outcomes
