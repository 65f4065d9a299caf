"""Issue 22, the second hardening pass: no finished model is replaced by a resume, two artefacts that meet are
the same model (index and query model, result files and the model pick times, a resumed index build and its
corpus), and damaged indexes and bad flags end in a one-line error (exit 2), never a traceback. The cases and
their messages are listed in docs/reliability.md, section 8."""

import json

import numpy as np
import pytest
import torch

from matryoshka2d.cli import main

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "runs", "sleeps", "eats", "big", "small", "old", "new"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("second-pass-data")
    rows = ["anchor\tpositive\tnegative"]
    for _ in range(16):
        a = rng.choice(WORDS, 4)
        rows.append(f"{' '.join(a)}\t{' '.join(a[:3])} {rng.choice(WORDS)}\t{' '.join(rng.choice(WORDS, 4))}")
    (root / "triplets.tsv").write_text("\n".join(rows) + "\n")
    dev = ["sentence1\tsentence2\tscore", "red cat\tred cat\t5", "red cat\tblue dog\t1", "big bird\tbig bird runs\t4"]
    (root / "dev.tsv").write_text("\n".join([*dev, "old dog\tsmall cat\t0"]) + "\n")
    return root


def train_args(model, files, out, *extra):
    args = ["train", "--model", str(model), "--pooling", "mean", "--data", str(files / "triplets.tsv")]
    args += ["--eval-file", str(files / "dev.tsv"), "--batch-size", "8", "--steps", "2", "--output", str(out)]
    return [*args, *extra]


def one_line_error(capsys, *needles) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- training ---------------------------------------------------------------------------------------------


def test_resume_never_replaces_a_finished_model(tiny_dir, files, tmp_path, capsys):
    """A finished run whose checkpoints were removed: --resume (with another --lr even) refuses, names what is
    there and --overwrite, and changes no file; --overwrite then trains afresh."""
    run = tmp_path / "run"
    assert main(train_args(tiny_dir, files, run, "--save-steps", "0")) == 0
    assert not (run / "checkpoints").exists()
    before = snapshot(run)
    capsys.readouterr()
    assert main(train_args(tiny_dir, files, run, "--resume", "--lr", "0.5")) == 2
    one_line_error(capsys, "--resume", "a finished model (2 steps, method plain", "no checkpoint", "--overwrite")
    assert snapshot(run) == before
    # Any model folder counts, not only our runs.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert main(train_args(tiny_dir, files, plain, "--resume")) == 2
    one_line_error(capsys, "a saved model (config.json)")
    assert main(train_args(tiny_dir, files, run, "--resume", "--overwrite", "--lr", "0.5")) == 0
    assert snapshot(run) != before


def test_every_eval_cell_is_evaluated(tiny_dir, files, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(tiny_dir, files, run, "--eval-cell", "1:16,2:32", "--eval-steps", "1")) == 0
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval"]) for r in records if "eval" in r]
    assert evals == [(1, "dev.tsv@(1,16)"), (1, "dev.tsv@(2,32)"), (2, "dev.tsv@(1,16)"), (2, "dev.tsv@(2,32)")]
    meta = json.loads((run / "matryoshka2d.json").read_text())
    assert [r["eval"] for r in meta["final_evals"]] == ["dev.tsv@(1,16)", "dev.tsv@(2,32)"]
    assert meta["final_eval"] == meta["final_evals"][0]
    assert "step 1: STS dev.tsv@(2,32) spearman" in capsys.readouterr().out
    # Each cell is checked against the model before the first step.
    assert main(train_args(tiny_dir, files, tmp_path / "bad", "--eval-cell", "1:16,9:8")) == 2
    one_line_error(capsys, "layer 9 is out of range")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(("extra", "needle"), [(["--layer", "0", "--dim", "0"], "(0,0)"), (["--dim", "0"], "(4,0)")])
def test_separate_refuses_zero_layer_or_dim(tiny_dir, files, tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    assert main(train_args(tiny_dir, files, out, "--method", "separate", *extra)) == 2
    one_line_error(capsys, f"separate: the cell {needle} is outside the model's 4 layers x 32 dims", "--layer must be")
    assert not (out / "matryoshka2d.json").exists()
