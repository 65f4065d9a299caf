"""The trainer on a tiny model: the loss falls, gradients reach shallow layers, only needed layers run,
an interrupted run resumes to the very same weights, and the result loads in sentence-transformers."""

import json

import numpy as np
import pytest
import torch

from matryoshka2d.backbones import layer_stack
from matryoshka2d.cli import main
from matryoshka2d.encoder import ElasticEncoder
from matryoshka2d.train import TrainConfig, Trainer

WORDS = [
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "bird",
    "runs",
    "sleeps",
    "eats",
    "big",
    "small",
    "old",
    "new",
    "happy",
    "sad",
]


@pytest.fixture(scope="module")
def triplets(tmp_path_factory):
    rng = np.random.default_rng(0)
    rows = ["anchor\tpositive\tnegative"]
    for _ in range(24):
        a = rng.choice(WORDS, 4)
        rows.append(f"{' '.join(a)}\t{' '.join(a[:3])} {rng.choice(WORDS)}\t{' '.join(rng.choice(WORDS, 4))}")
    path = tmp_path_factory.mktemp("data") / "triplets.tsv"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def sts_dev(tmp_path_factory):
    rows = ["sentence1\tsentence2\tscore", "red cat\tred cat\t5", "red cat\tblue dog\t1", "big bird\tbig bird runs\t4"]
    rows += ["old dog\thappy cat\t0", "sad bird\tsad bird\t5"]
    path = tmp_path_factory.mktemp("dev") / "dev.tsv"
    path.write_text("\n".join(rows) + "\n")
    return path


def config(tiny_dir, triplets, sts_dev, out, **kw):
    base = dict(
        model=str(tiny_dir),
        pooling="mean",
        data=[str(triplets)],
        output=str(out),
        batch_size=8,
        eval_file=str(sts_dev),
        lr=1e-3,
        warmup_ratio=0.0,
        save_steps=0,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("method", ["plain", "mrl", "2dmse", "ese", "starbucks"])
def test_twenty_steps_lower_the_loss(method, tiny_dir, triplets, sts_dev, tmp_path):
    options = {"ese": {"k": 16}, "starbucks": {"sizes": [(1, 8), (2, 16), (4, 32)]}}.get(method, {})
    trainer = Trainer(
        config(tiny_dir, triplets, sts_dev, tmp_path, method=method, steps=20, loss="cosent", method_options=options)
    )
    losses = [trainer.train_step()["loss"] for _ in range(20)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


@pytest.mark.parametrize("method", ["2dmse", "ese", "separate"])
def test_gradients_reach_the_shallow_layers(method, tiny_dir, triplets, sts_dev, tmp_path):
    options = {"separate": {"layer": 1, "dim": 16}, "ese": {"k": 16}}.get(method, {})
    trainer = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, method=method, steps=1, method_options=options))
    loss, _ = trainer.compute_loss(0)
    loss.backward()
    first = layer_stack(trainer.encoder.model)[0]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in first.parameters())


def test_a_method_runs_only_the_layers_its_views_need(tiny_dir, triplets, sts_dev, tmp_path):
    trainer = Trainer(
        config(
            tiny_dir,
            triplets,
            sts_dev,
            tmp_path,
            method="starbucks",
            steps=1,
            method_options={"sizes": [(1, 8), (2, 16)]},
        )
    )
    stack = layer_stack(trainer.encoder.model)
    calls = [0] * len(stack)
    handles = [m.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)) for i, m in enumerate(stack)]
    try:
        trainer.train_step()
    finally:
        for h in handles:
            h.remove()
    assert calls == [3, 3, 0, 0]  # one pass per column (anchor, positive, negative), each up to layer 2
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in stack[3].parameters())


class Killed(Exception):
    pass


def test_resume_after_interruption_gives_the_same_weights(tiny_dir, triplets, sts_dev, tmp_path, monkeypatch):
    # 7 steps over 24 rows at batch 8 crosses an epoch boundary, with 2dmse's random views and dropout.
    kw = dict(method="2dmse", steps=7, save_steps=2)
    straight = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path / "a", **kw))
    straight.run(progress=False)
    expected = {k: v.clone() for k, v in straight.encoder.state_dict().items()}

    interrupted = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path / "b", **kw))
    original_step = Trainer.train_step

    def dying_step(self):
        if self.step == 5:
            raise Killed  # like kill -9 after step 5: the checkpoint of step 4 is the last one on disk
        return original_step(self)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(Killed):
        interrupted.run(progress=False)
    monkeypatch.setattr(Trainer, "train_step", original_step)
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]

    resumed = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path / "b", **kw))
    resumed.run(resume=True, progress=False)
    assert resumed.step == 7
    for key, value in resumed.encoder.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6, msg=key)


def test_resume_refuses_a_different_run(tiny_dir, triplets, sts_dev, tmp_path):
    Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, steps=2, save_steps=1)).run(progress=False)
    other = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, steps=2, save_steps=1, method="mrl"))
    with pytest.raises(ValueError, match="differs in method"):
        other.run(resume=True, progress=False)


def test_saved_model_loads_in_sentence_transformers_and_elastic_encoder(tiny_dir, triplets, sts_dev, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = Trainer(config(tiny_dir, triplets, sts_dev, tmp_path, method="mrl", steps=2)).run(progress=False)
    meta = json.loads((out / "matryoshka2d.json").read_text())
    assert meta["method"]["method"] == "mrl" and meta["training"]["steps"] == 2 and meta["steps"] == 2
    assert "spearman" in meta["final_eval"]
    texts = ["red cat runs", "old dog sleeps"]
    ours = ElasticEncoder(str(out)).encode(texts, normalize=True)
    theirs = SentenceTransformer(str(out), device="cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_separate_saves_a_cut_model(tiny_dir, triplets, sts_dev, tmp_path):
    out = Trainer(
        config(
            tiny_dir, triplets, sts_dev, tmp_path, method="separate", steps=2, method_options={"layer": 2, "dim": 16}
        )
    ).run(progress=False)
    cut = ElasticEncoder(str(out))
    assert cut.num_layers == 2
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_cli_train_with_yaml_config(tiny_dir, triplets, sts_dev, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"model: {tiny_dir}\npooling: mean\nmethod: ese\nloss: angle\nsteps: 2\nbatch_size: 8\n"
        f"eval_file: {sts_dev}\nmethod_options:\n  k: 16\n"
    )
    assert main(["train", "--config", str(cfg), "--data", str(triplets), "--output", str(tmp_path / "o")]) == 0
    meta = json.loads((tmp_path / "o" / "matryoshka2d.json").read_text())
    assert meta["method"]["k"] == 16 and meta["training"]["loss"] == "angle"


def test_cli_train_errors(tmp_path, capsys, triplets):
    assert main(["train", "--data", str(triplets)]) == 2
    assert "train needs --output" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    assert main(["train", "--config", str(bad), "--data", str(triplets), "--output", str(tmp_path / "o")]) == 2
    assert "unknown training option(s): stepz" in capsys.readouterr().err


def test_cli_train_help_lists_every_method(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in ("plain", "mrl", "2dmse", "ese", "starbucks", "separate"):
        assert f"  {name} " in out
