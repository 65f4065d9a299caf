"""The asymmetric method: task loss on (query at layer n, documents at layer N), and it trains a tiny model."""

import numpy as np
import pytest
import torch

from helpers.models import tiny_run
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import make_method
from matryoshka2d.training.trainer import Trainer


def test_plan_samples_a_shallow_query_layer_and_keeps_the_full_view():
    method = make_method("asymmetric", 6, 384)
    seen = set()
    for seed in range(100):
        plan = method.plan(np.random.default_rng(seed))
        assert [(v.layer, v.dim) for v in plan.views] == [(6, 384)]
        assert plan.layers == sorted({plan.info["n"], 6})
        seen.add(plan.info["n"])
    assert seen == {1, 2, 3, 4, 5}
    fixed = make_method("asymmetric", 6, 384, query_layers=[3], dims=[128])
    plan = fixed.plan(np.random.default_rng(0))
    assert plan.info == {"n": 3, "d": 128} and fixed.widths() == {128, 384}


def test_the_task_loss_sees_shallow_queries_and_deep_documents():
    method = make_method("asymmetric", 4, 8, query_layers=[2], align_weight=0.0, full_weight=0.0)
    plan = method.plan(np.random.default_rng(0))
    cols = {layer: [torch.full((3, 8), float(layer) * (c + 1)) for c in range(3)] for layer in (2, 4)}
    states = {layer: EmbeddedBatch(c, "triplets") for layer, c in cols.items()}
    seen = []

    def task_loss(batch):
        seen.append([float(c[0, 0]) for c in batch.columns])
        return torch.tensor(0.0)

    method.loss(plan, states, task_loss)
    assert seen[1] == [2.0, 8.0, 12.0]  # query column from layer 2, documents from layer 4


def test_bad_options_name_the_problem():
    with pytest.raises(ValueError, match=r"query_layers \[6\] out of range: choose from 1..5"):
        make_method("asymmetric", 6, 384, query_layers=[6])
    with pytest.raises(ValueError, match=r"dims \[384\] out of range"):
        make_method("asymmetric", 6, 384, dims=[384])


def test_trains_a_tiny_model_and_keeps_shallow_queries_in_the_last_layer_space(tiny_dir, triplets, sts_dev, tmp_path):
    """Its loss falls over 30 steps, and afterwards a sentence's layer-2 vector is closer to its layer-4 vector
    than after the same 30 steps of plain training (which only shapes the last layer)."""
    closeness = {}
    for method in ("asymmetric", "plain"):
        cfg = tiny_run(tiny_dir, triplets, sts_dev, tmp_path / method, method=method, steps=30, loss="cosent")
        if method == "asymmetric":
            cfg.method_options = {"query_layers": [2], "dims": [16]}
        trainer = Trainer(cfg)
        losses = [trainer.train_step()["loss"] for _ in range(30)]
        if method == "asymmetric":
            assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses
        texts = [line.split("\t")[0] for line in triplets.read_text().splitlines()[1:]]
        shallow = trainer.encoder.encode(texts, layer=2, normalize=True)
        deep = trainer.encoder.encode(texts, layer=4, normalize=True)
        closeness[method] = float(np.mean(np.sum(shallow * deep, axis=1)))
    assert closeness["asymmetric"] > closeness["plain"], closeness
