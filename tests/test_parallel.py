"""Data-parallel training (matryoshka2d.training.parallel): two CPU processes under torchrun train the very weights one
process trains on the same batches, and a two-process run resumes exactly from its checkpoint."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers.data import write_triplets
from matryoshka2d.cli import main
from matryoshka2d.compress.smae import pretrain_trainer
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.parallel import Processes, without_option


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel-data")
    write_triplets(folder / "triplets.tsv", 21, seed=1)  # batches of 7: the processes' shares differ (4 + 3 rows)
    dev = ["sentence1\tsentence2\tscore", "red cat\tred cat\t5", "red cat\tblue dog\t1", "big bird\tbig bird runs\t4"]
    (folder / "dev.tsv").write_text("\n".join([*dev, "old dog\thappy cat\t0"]) + "\n")
    return folder


def train_args(model, data, out, *extra):
    return [
        "train",
        "--model",
        str(model),
        "--pooling",
        "mean",
        "--data",
        str(data / "triplets.tsv"),
        "--eval-file",
        str(data / "dev.tsv"),
        "--batch-size",
        "7",
        "--lr",
        "1e-3",
        "--warmup-ratio",
        "0",
        "--output",
        str(out),
        *extra,
    ]


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def losses(folder):
    lines = (folder / "train_log.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_shares_and_own_rows():
    two = Processes(world=2, rank=1)
    assert two.share(7) == [4, 3] and two.share(1) == [1, 0]
    assert two.own_rows(np.arange(10, 17)).tolist() == [14, 15, 16]
    assert two.own_rows(np.array([5])).tolist() == [5]  # an empty share encodes a stand-in row, dropped later
    assert without_option(["train", "--processes", "2", "--steps", "3"], "--processes") == ["train", "--steps", "3"]
    assert without_option(["train", "--processes=2"], "--processes") == ["train"]


def test_two_processes_train_the_weights_of_one(no_dropout_dir, data, tmp_path):
    """2dmse's views, in-batch negatives and the KL between layers see the whole batch in both processes."""
    common = ["--method", "2dmse", "--steps", "4", "--save-steps", "0", "--log-every", "1"]
    assert main(train_args(no_dropout_dir, data, tmp_path / "one", *common)) == 0
    assert main(train_args(no_dropout_dir, data, tmp_path / "two", *common, "--processes", "2")) == 0
    meta = json.loads((tmp_path / "two" / "matryoshka2d.json").read_text())
    assert meta["processes"] == 2
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=2e-5)
    assert len(losses(tmp_path / "two")) == 4  # rank 0 alone writes the log


def test_a_two_process_run_with_accumulation_is_one_process_run_and_resumes_to_the_same_weights(
    no_dropout_dir, data, tmp_path
):
    """Gradient caching across processes: batches of 7 in micro-batches of 2, 2, 2 and 1 rows, each split over
    two processes (the last one leaves process 1 a stand-in row only), give the whole batch's step, that of
    one process without accumulation; and a killed run resumes to the very weights of an uninterrupted one."""
    method = ["--method", "ese", "--method-option", "k=16", "--method-option", "beta=1", "--steps", "4"]
    common = [*method, "--save-steps", "2", "--log-every", "1", "--processes", "2", "--gradient-accumulation", "4"]
    assert main(train_args(no_dropout_dir, data, tmp_path / "whole", *common)) == 0
    assert main(train_args(no_dropout_dir, data, tmp_path / "one", *method, "--save-steps", "0")) == 0
    np.testing.assert_allclose(losses(tmp_path / "whole"), losses(tmp_path / "one"), rtol=1e-5)
    whole, one = weights(tmp_path / "whole"), weights(tmp_path / "one")
    for key in one:
        torch.testing.assert_close(whole[key], one[key], rtol=1e-4, atol=2e-5)
    # As if killed after step 2: only the step-2 checkpoint is there.
    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    step2 = tmp_path / "whole" / "checkpoints" / "step-0000002"
    shutil.copytree(step2, tmp_path / "cut" / "checkpoints" / step2.name)
    assert main(train_args(no_dropout_dir, data, tmp_path / "cut", *common, "--resume")) == 0
    cut = weights(tmp_path / "cut")
    for key in whole:
        torch.testing.assert_close(cut[key], whole[key], rtol=0, atol=1e-6)


def test_processes_must_be_positive(no_dropout_dir, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:  # refused where it is parsed (rule 4)
        main(train_args(no_dropout_dir, data, tmp_path / "x", "--processes", "0"))
    assert exit_code.value.code == 2
    assert "--processes: must be at least 1, got 0" in capsys.readouterr().err


def test_a_failing_process_stops_the_run_with_its_message(no_dropout_dir, data, tmp_path, capfd):
    """k larger than the model fails in every process before training: exit 2, the message, no hang."""
    args = train_args(no_dropout_dir, data, tmp_path / "bad", "--method", "ese", "--steps", "2", "--processes", "2")
    assert main(args) == 2
    err = capfd.readouterr().err
    assert "compression size k=128 must be within 1..32" in err and "Traceback" not in err


def test_pretraining_says_it_runs_in_one_process(no_dropout_dir, data, tmp_path, monkeypatch):
    monkeypatch.setattr(Processes, "from_env", classmethod(lambda cls, device: cls(world=2, rank=0)))
    config = TrainConfig(
        data=[str(data / "triplets.tsv")], output=str(tmp_path / "p"), model=str(no_dropout_dir), method="smae"
    )
    with pytest.raises(ValueError, match="runs in one process"):
        pretrain_trainer(config)
