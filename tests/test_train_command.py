"""`train` refuses a user's mistakes before the first step, in one line (exit 2): a bad option, config file,
eval file or output, a cell outside the model; and it evaluates every --eval-cell it is given."""

import json

import pytest
import torch

from helpers.cli import error_line, exit_code, train_args
from matryoshka2d.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_bad_eval_file_fails_before_the_first_step(tiny_dir, files, tmp_path, capsys):
    out = tmp_path / "run"
    args = train_args(tiny_dir, files, out)
    args[args.index("--eval-file") + 1] = str(tmp_path / "typo.tsv")
    assert main(args) == 2
    error_line(capsys, "--eval-file", "typo.tsv")
    assert not out.exists()  # no step ran, nothing was written


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        # refused where they are parsed (rule 4): argparse's one line, exit 2
        (["--batch-size", "0"], ["--batch-size: must be at least 1, got 0"]),
        (["--steps", "0"], ["--steps: must be at least 1, got 0"]),
        (["--steps", "-1"], ["--steps: must be at least 1, got -1"]),
        (["--epochs", "0"], ["--epochs: must be greater than 0"]),
        (["--max-length", "-5"], ["--max-length: must be at least 1, got -5"]),
        (["--lr", "-1"], ["--lr: must be greater than 0"]),
        (["--warmup-ratio", "2"], ["--warmup-ratio: must be from 0 to 1"]),
        (["--device", "bogus"], ["--device bogus", "cpu"]),
        (["--eval-cell", "9:8"], ["layer 9 is out of range"]),
    ],
)
def test_bad_options_fail_before_the_first_step(tiny_dir, files, tmp_path, capsys, extra, needles):
    out = tmp_path / "run"
    assert exit_code(train_args(tiny_dir, files, out, *extra)) == 2
    error_line(capsys, *needles)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_device_cuda_without_a_gpu(tiny_dir, files, tmp_path, capsys):
    assert main(train_args(tiny_dir, files, tmp_path / "run", "--device", "cuda")) == 2
    error_line(capsys, "--device cuda", "no CUDA GPU", "--device cpu")


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("steps: [1, 2\nlr: 0.1\n", ["line", "not valid YAML"]),
        ('method: ese\nmethod_options: "k=3"\n', ["method_options must be a mapping", "k=3"]),
        ("- steps\n- 3\n", ["expected a mapping"]),
        ("steps: 0\n", ["--steps must be at least 1"]),
    ],
)
def test_bad_config_files(tiny_dir, files, tmp_path, capsys, text, needles):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    args = ["train", "--config", str(cfg), "--model", str(tiny_dir), "--pooling", "mean"]
    args += [
        "--data",
        str(files / "triplets.tsv"),
        "--eval-file",
        str(files / "dev.tsv"),
        "--output",
        str(tmp_path / "o"),
    ]
    assert main(args) == 2
    error_line(capsys, *needles)


def test_an_output_that_is_a_file_or_taken_is_refused_before_the_model_loads(
    tiny_dir, files, tmp_path, capsys, monkeypatch
):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --output was checked")

    monkeypatch.setattr("matryoshka2d.training.trainer.ElasticEncoder", no_model)
    out = tmp_path / "file"
    out.write_text("x")
    assert main(train_args(tiny_dir, files, out)) == 2
    error_line(capsys, "is a file")
    taken = tmp_path / "run"
    taken.mkdir()
    (taken / "train_log.jsonl").write_text("")
    assert main(train_args(tiny_dir, files, taken)) == 2
    error_line(capsys, "already holds a model or a run")
    pretrain = ["pretrain", "--model", str(tiny_dir), "--data", str(files / "triplets.tsv"), "--output", str(taken)]
    assert main(pretrain) == 2
    error_line(capsys, "already holds a model or a run")


def test_every_eval_cell_is_evaluated(tiny_dir, files, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(tiny_dir, files, run, "--eval-cell", "1:16,2:32", "--eval-steps", "1", steps=2)) == 0
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval"]) for r in records if "eval" in r]
    assert evals == [(1, "dev.tsv@(1,16)"), (1, "dev.tsv@(2,32)"), (2, "dev.tsv@(1,16)"), (2, "dev.tsv@(2,32)")]
    meta = json.loads((run / "matryoshka2d.json").read_text())
    assert [r["eval"] for r in meta["final_evals"]] == ["dev.tsv@(1,16)", "dev.tsv@(2,32)"]
    assert meta["final_eval"] == meta["final_evals"][0]
    assert "step 1: STS dev.tsv@(2,32) spearman" in capsys.readouterr().out
    # Each cell is checked against the model before the first step.
    assert main(train_args(tiny_dir, files, tmp_path / "bad", "--eval-cell", "1:16,9:8", steps=2)) == 2
    error_line(capsys, "layer 9 is out of range")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(("extra", "option"), [(["--layer", "0", "--dim", "0"], "--layer"), (["--dim", "0"], "--dim")])
def test_separate_refuses_zero_layer_or_dim(tiny_dir, files, tmp_path, capsys, extra, option):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:  # at parse time, naming the option (rule 4)
        main(train_args(tiny_dir, files, out, "--method", "separate", *extra, steps=2))
    assert stopped.value.code == 2
    error_line(capsys, f"argument {option}: must be at least 1, got 0")
    assert not out.exists()
    # a cell beyond the model is the method's to refuse, naming the model's size
    assert main(train_args(tiny_dir, files, out, "--method", "separate", "--dim", "64", steps=2)) == 2
    error_line(capsys, "separate: the cell (4,64) is outside the model's 4 layers x 32 dims")
    assert not (out / "matryoshka2d.json").exists()
