"""Trainer throughput options on a tiny model: precision choices and their errors, lazy loss read-back,
prefetched tokenization, gradient accumulation and checkpointing; none of them changes what is trained on."""

import json

import numpy as np
import pytest
import torch

from helpers.models import tiny_run
from matryoshka2d.cli import main
from matryoshka2d.training.throughput import PrecisionError, autocast, resolve_precision
from matryoshka2d.training.trainer import Trainer

CPU = torch.device("cpu")


def config(tiny_dir, triplets, sts_dev, out, **kw):
    """2DMSE on the CPU."""
    return tiny_run(tiny_dir, triplets, sts_dev, out, **{"device": "cpu", "method": "2dmse", **kw})


def test_cpu_defaults_to_fp32_and_autocast_is_off():
    assert resolve_precision(None, CPU) == "fp32"
    assert resolve_precision("fp32", CPU) == "fp32"
    with autocast("fp32", CPU):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        ("fp16", r"--precision fp16 needs a CUDA device .* on 'cpu'"),
        ("bf16", r"--precision bf16 is for CUDA devices; the run is on 'cpu'"),
        ("fp8", r"--precision must be one of bf16, fp16, fp32, got 'fp8'"),
    ],
)
def test_precisions_the_device_cannot_use_are_errors(precision, message):
    with pytest.raises(PrecisionError, match=message):
        resolve_precision(precision, CPU)


def test_cli_fp16_on_cpu_names_the_flag(tiny_dir, triplets, tmp_path, capsys):
    code = main(
        ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--output",
         str(tmp_path / "o"), "--steps", "1", "--device", "cpu", "--precision", "fp16"]
    )  # fmt: skip
    assert code == 2
    assert "--precision fp16 needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"log_every": 0}, "--log-every must be at least 1"),
        ({"gradient_accumulation": 9}, "--gradient-accumulation 9 splits a batch of 8"),
    ],
)
def test_bad_throughput_options_are_errors(option, message, tiny_dir, triplets, sts_dev, tmp_path):
    with pytest.raises(ValueError, match=message):
        Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, steps=1, **option))


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.encoder.state_dict().items()}


def test_log_every_changes_neither_the_log_nor_the_weights(tiny_dir, triplets, sts_dev, tmp_path):
    runs = {}
    for every in (1, 3):
        trainer = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path / str(every), steps=7, log_every=every))
        trainer.run(progress=False)
        lines = [json.loads(x) for x in (tmp_path / str(every) / "train_log.jsonl").read_text().splitlines()]
        steps = [r for r in lines if "loss" in r]
        assert [r["step"] for r in steps] == list(range(1, 8))
        assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in steps)
        runs[every] = (weights(trainer), [r["loss"] for r in steps])
    assert runs[1][1] == runs[3][1]
    assert all(torch.equal(runs[1][0][k], runs[3][0][k]) for k in runs[1][0])


def test_prefetched_batches_are_the_seeded_batches(tiny_dir, triplets, sts_dev, tmp_path):
    trainer = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, steps=5))
    for step in (0, 1, 3, 2):  # out of order too, as after a resume
        got = trainer._prefetch.get(step, step + 1)
        columns, _ = trainer.data.rows(trainer.batch_indices(step))
        expected = trainer.encoder.tokenizer(list(columns[0]))["input_ids"]
        assert got[0][0].column_ids(0) == expected
    trainer._prefetch.close()


def test_gradient_accumulation_trains_on_the_same_rows(tiny_dir, triplets, sts_dev, tmp_path):
    trainer = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, steps=3, gradient_accumulation=3))
    micro = trainer.prepare_batch(0)
    assert len(micro) == 3
    tokens = [ids for batch, _, _ in micro for ids in batch.column_ids(0)]
    columns, _ = trainer.data.rows(trainer.batch_indices(0))
    assert tokens == trainer.encoder.tokenizer(list(columns[0]))["input_ids"]
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    assert all(np.isfinite(losses))


def test_gradient_checkpointing_gives_the_same_step(tiny_dir, triplets, sts_dev, tmp_path):
    results = []
    for checkpointing in (False, True):
        trainer = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, steps=2, gradient_checkpointing=checkpointing))
        losses = [trainer.train_step()["loss"] for _ in range(2)]
        results.append((losses, weights(trainer)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    for k, v in results[0][1].items():
        torch.testing.assert_close(v, results[1][1][k], rtol=1e-4, atol=1e-6)
