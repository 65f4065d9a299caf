"""Two-step training end to end on a tiny model: the runs, the choice of encoder_opt, the frozen-encoder
pooler fine-tuning, the Table 1/2 report, reuse of finished runs, and the errors."""

import json

import numpy as np
import pytest
import torch

from helpers.data import WORDS
from helpers.models import tiny_transformer
from matryoshka2d.cli import build_parser, main
from matryoshka2d.compress.two_step import TwoStepConfig, run_two_step
from matryoshka2d.models.encoder import ElasticEncoder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("two-step")
    model = root / "model"
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(model)
    tokenizer.save_pretrained(model)
    rng = np.random.default_rng(0)
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 5)) for _ in range(40)) + "\n")
    rows = ["sentence1\tsentence2\tscore"]
    for _ in range(10):
        a = rng.choice(WORDS, 4)
        rows.append(f"{' '.join(a)}\t{' '.join(rng.choice(WORDS, 4))}\t{rng.uniform(0, 5):.1f}")
    (root / "dev.tsv").write_text("\n".join(rows[:6]) + "\n")
    (root / "test.tsv").write_text("\n".join(rows[:1] + rows[6:]) + "\n")
    return root


def test_two_step_end_to_end_writes_its_report(setup, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["two-step", "--model", str(setup / "model"), "--pooling", "mean", "--target-dim", "8"]
    args += ["--candidate-dims", "16,8", "--data", str(setup / "corpus.txt"), "--loss", "simcse"]
    args += ["--steps", "2", "--pooler-steps", "2", "--batch-size", "8", "--lr", "1e-3", "--save-steps", "0"]
    args += ["--validation-file", str(setup / "dev.tsv"), "--report-file", str(setup / "test.tsv"), "--quiet"]
    args += ["--output", str(out)]
    assert main(args) == 0
    result = json.loads((out / "two_step.json").read_text())
    assert result["candidate_dims"] == [16, 8] and result["target_dims"] == [8]
    selection = {s["dim"]: s["validation"] for s in result["selection"]}
    assert result["opt"] == max(selection, key=selection.get)
    row = result["targets"][0]
    assert row["dim"] == 8 and set(row) >= {"end_to_end", "after_step1", "after_step2", "encoder_only"}
    assert all(isinstance(row[k]["report"], float) for k in ("end_to_end", "after_step1", "after_step2"))
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["pooler-16", "pooler-8"]  # d is a candidate
    assert not (out / "runs" / "pooler-8" / "checkpoints").exists()

    # Step 1 put pooler_8 (as trained end to end) on encoder_opt; step 2 changed only that pooler.
    opt = ElasticEncoder(str(out / "runs" / f"pooler-{result['opt']}"), device="cpu")
    e2e = ElasticEncoder(str(out / "runs" / "pooler-8"), device="cpu")
    combined = ElasticEncoder(str(out / "step1-d8"), device="cpu")
    final = ElasticEncoder(str(out / "two-step-d8"), device="cpu")
    assert combined.hidden_size == final.hidden_size == 8
    torch.testing.assert_close(combined.head.linear.weight, e2e.head.linear.weight, rtol=0, atol=0)
    for name, value in final.model.state_dict().items():
        torch.testing.assert_close(value, opt.model.state_dict()[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(final.head.linear.weight, combined.head.linear.weight)
    meta = json.loads((out / "two-step-d8" / "matryoshka2d.json").read_text())
    assert meta["training"]["freeze_encoder"] and meta["training"]["pooler_dim"] == 8

    markdown = (out / "two_step.md").read_text()
    for label in ("end-to-end training", "after step 1", "after step 2", "pooler_d used only in training"):
        assert label in markdown
    assert "| pooler output dim d | 8 |" in markdown and f"opt = {result['opt']}" in markdown
    assert "d=8 (opt=" in capsys.readouterr().out

    # The same command again reuses every finished run; other settings are refused, not silently reused.
    stamp = (out / "runs" / "pooler-16" / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 0
    assert (out / "runs" / "pooler-16" / "model.safetensors").stat().st_mtime_ns == stamp
    assert main([*args, "--lr", "5e-4"]) == 2
    assert "holds a finished run with other settings (lr)" in capsys.readouterr().err


def two_step(setup, tmp_path, **kw):
    base = dict(
        data=[str(setup / "corpus.txt")],
        output=str(tmp_path / "o"),
        target_dims=[8],
        candidate_dims=[16, 8],
        model=str(setup / "model"),
        validation_file=str(setup / "dev.tsv"),
        report_file=str(setup / "test.tsv"),
        train={"pooling": "mean", "steps": 1},
    )
    base.update(kw)
    return run_two_step(TwoStepConfig(**base), progress=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"target_dims": [64]}, "target dim 64 is larger than the model's hidden size 32"),
        ({"candidate_dims": [16, 0]}, "candidate dim 0 must be at least 1"),
        ({"target_dims": []}, "no target dim given"),
        ({"target_dims": ["8"]}, "target dim must be integers"),
        ({"loss": "hinge"}, "Unknown loss 'hinge'"),
        ({"validation_file": "nope.tsv"}, "nope.tsv"),
        ({"train": {"pooling": "mean", "pooler_dim": 4}}, "two-step sets pooler_dim itself"),
    ],
)
def test_two_step_errors_before_any_training(setup, tmp_path, options, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        two_step(setup, tmp_path, **options)
    assert not (tmp_path / "o" / "runs").exists()


def test_dims_are_read_where_they_are_parsed(capsys):
    """--target-dim and --candidate-dims go through cli.args.width_list (matryoshka2d.cells.parse_numbers)."""
    common = ["two-step", "--data", "d", "--output", "o", "--target-dim"]
    args = build_parser().parse_args([*common, "8", "--candidate-dims", "384, 256,128"])
    assert args.target_dim == [8] and args.candidate_dims == [384, 256, 128]
    for value, said in (("16,x", "'x' is not a whole number"), (",", "',' holds an empty item")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*common, value])
        assert f"argument --target-dim: {said}" in capsys.readouterr().err
