"""The trainer on a tiny model: the loss falls, gradients reach shallow layers, only needed layers run,
an interrupted run resumes to the very same weights, and the result loads in sentence-transformers."""

import json

import numpy as np
import pytest
import torch

from helpers.models import tiny_run
from matryoshka2d.cli import main
from matryoshka2d.models.backbones import layer_stack
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.trainer import Trainer


@pytest.mark.parametrize("loss", [None, "cosent", "simcse"])
def test_the_training_data_is_read_once(loss, tiny_dir, triplets, sts_dev, tmp_path, monkeypatch):
    """Without --loss the data is read to pick the default loss; that read is the one the run trains on."""
    from matryoshka2d.training import trainer as trainer_module

    calls = []
    read = trainer_module.read_training_data

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sentences", False))
        return read(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "read_training_data", counting)
    trainer = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path, loss=loss))
    assert calls == [loss == "simcse"] and trainer.loss_name == (loss or "angle")
    assert trainer.data.kind == ("sentences" if loss == "simcse" else "triplets")


def test_a_trained_models_card_shows_its_method_and_last_evaluation(tiny_dir, triplets, sts_dev, tmp_path):
    run = tiny_run(tiny_dir, triplets, sts_dev, tmp_path / "run", method="2dmse", steps=2, loss="cosent")
    out = Trainer(run).run(progress=False)
    card = (out / "README.md").read_text()
    final = json.loads((out / "matryoshka2d.json").read_text())["final_eval"]
    assert "- method: 2dmse (`{" in card and "- loss: cosent" in card
    assert f"Spearman x 100 of cosine vs gold {final['spearman']:.2f} on dev.tsv@(4,32)" in card


@pytest.mark.parametrize("method", ["plain", "mrl", "2dmse", "ese", "starbucks"])
def test_twenty_steps_lower_the_loss(method, tiny_dir, triplets, sts_dev, tmp_path):
    options = {"ese": {"k": 16}, "starbucks": {"sizes": [(1, 8), (2, 16), (4, 32)]}}.get(method, {})
    trainer = Trainer(
        tiny_run(tiny_dir, triplets, sts_dev, tmp_path, method=method, steps=20, loss="cosent", method_options=options)
    )
    losses = [trainer.train_step()["loss"] for _ in range(20)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


@pytest.mark.parametrize("method", ["2dmse", "ese", "separate"])
def test_gradients_reach_the_shallow_layers(method, tiny_dir, triplets, sts_dev, tmp_path):
    options = {"separate": {"layer": 1, "dim": 16}, "ese": {"k": 16}}.get(method, {})
    trainer = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path, method=method, steps=1, method_options=options))
    loss, _ = trainer.compute_loss(0)
    loss.backward()
    first = layer_stack(trainer.encoder.model)[0]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in first.parameters())


def test_a_method_runs_only_the_layers_its_views_need(tiny_dir, triplets, sts_dev, tmp_path):
    trainer = Trainer(
        tiny_run(
            tiny_dir,
            triplets,
            sts_dev,
            tmp_path,
            method="starbucks",
            steps=1,
            method_options={"sizes": [(1, 8), (2, 16)]},
            padding_free=False,  # one pass per column, so the count below is per column
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
    straight = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path / "a", **kw))
    straight.run(progress=False)
    expected = {k: v.clone() for k, v in straight.encoder.state_dict().items()}

    interrupted = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path / "b", **kw))
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

    resumed = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path / "b", **kw))
    resumed.run(resume=True, progress=False)
    assert resumed.step == 7
    for key, value in resumed.encoder.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6, msg=key)


def test_resume_refuses_a_different_run(tiny_dir, triplets, sts_dev, tmp_path):
    Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path, steps=2, save_steps=1)).run(progress=False)
    other = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path, steps=2, save_steps=1, method="mrl"))
    with pytest.raises(ValueError, match="differs in method"):
        other.run(resume=True, progress=False)


def test_saved_model_loads_in_sentence_transformers_and_elastic_encoder(tiny_dir, triplets, sts_dev, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path, method="mrl", steps=2)).run(progress=False)
    meta = json.loads((out / "matryoshka2d.json").read_text())
    assert meta["method"]["method"] == "mrl" and meta["training"]["steps"] == 2 and meta["steps"] == 2
    assert "spearman" in meta["final_eval"]
    # mrl put a loss on 8, 16 and 32 (the tiny model's full width): config.json says so for vLLM / SGLang.
    hf_config = json.loads((out / "config.json").read_text())
    assert meta["trained_widths"] == hf_config["matryoshka_dimensions"] == [8, 16, 32] and hf_config["is_matryoshka"]
    texts = ["red cat runs", "old dog sleeps"]
    ours = ElasticEncoder(str(out)).encode(texts, normalize=True)
    theirs = SentenceTransformer(str(out), device="cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_separate_saves_a_cut_model(tiny_dir, triplets, sts_dev, tmp_path):
    out = Trainer(
        tiny_run(
            tiny_dir, triplets, sts_dev, tmp_path, method="separate", steps=2, method_options={"layer": 2, "dim": 16}
        )
    ).run(progress=False)
    cut = ElasticEncoder(str(out))
    assert cut.num_layers == 2
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_cli_train_with_yaml_tiny_run(tiny_dir, triplets, sts_dev, tmp_path, capsys):
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


def test_without_a_loss_the_run_picks_the_one_for_its_kind_of_data_and_says_so(
    tiny_dir, triplets, sts_dev, tmp_path, capsys
):
    trainer = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path / "t", loss=None, steps=1))
    assert trainer.loss_name == "angle"
    assert "loss: angle (default for triplets data" in capsys.readouterr().out
    scored = Trainer(tiny_run(tiny_dir, sts_dev, sts_dev, tmp_path / "s", loss=None, steps=1))
    assert scored.loss_name == "angle" and scored.data.kind == "scored"
    assert "default for scored data" in capsys.readouterr().out
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("red cat runs\nold dog sleeps\nblue bird eats\n")
    plain_text = Trainer(tiny_run(tiny_dir, sentences, sts_dev, tmp_path / "u", loss=None, steps=1))
    assert plain_text.loss_name == "simcse"
    out = plain_text.run(progress=False)
    assert json.loads((out / "matryoshka2d.json").read_text())["loss"] == "simcse"


def test_cli_train_preset_applies_its_recipe_and_flags_override_it(tiny_dir, triplets, sts_dev, tmp_path, capsys):
    args = ["train", "--preset", "ese-angle-emb", "--model", str(tiny_dir), "--pooling", "mean"]
    args += ["--data", str(triplets), "--output", str(tmp_path / "o"), "--steps", "2", "--batch-size", "8"]
    args += ["--eval-file", str(sts_dev), "--method-option", "k=16"]
    assert main(args) == 0
    assert "preset ese-angle-emb: SeanLee97/AnglE" in capsys.readouterr().out
    meta = json.loads((tmp_path / "o" / "matryoshka2d.json").read_text())
    method = meta["method"]
    assert method["layers"] == "angle-emb" and method["shallow_mean"] is True and method["beta"] == 1.0
    assert method["k"] == 16 and method["kl_factor"] == "T" and meta["loss"] == "angle"
    assert meta["training"]["preset"] == "ese-angle-emb"  # which recipe the options came from
    config = tmp_path / "c.yaml"
    config.write_text("preset: ese-angle-emb\n")
    assert main([*args[:-2], "--config", str(config), "--output", str(tmp_path / "p")]) == 2
    assert "'preset' cannot be set in a config file; pass --preset NAME" in capsys.readouterr().err


def test_every_preset_builds_its_method_and_loss_and_cites_a_source():
    from matryoshka2d.losses import make_task_loss
    from matryoshka2d.methods import make_method
    from matryoshka2d.training import presets

    names = presets.available()
    assert {"2dmse-paper", "ese-paper", "ese-angle-emb", "starbucks-paper", "st-matryoshka2d"} <= set(names)
    assert {"2dmse-authors", "2dmse-angle-0.3"} <= set(names)
    for name in names:
        options = presets.load(name)
        TrainConfig.from_dict({**options, "data": ["x.tsv"], "output": "o"})  # only known training options
        make_method(options["method"], 6, 384, **options.get("method_options", {}))
        make_task_loss(options["loss"], **options.get("loss_options", {}))
        assert len(presets.source(name)) > 80
    with pytest.raises(
        ValueError, match="unknown preset 'ese'; choose one of 2dmse-angle-0.3, 2dmse-authors, 2dmse-paper"
    ):
        presets.load("ese")


def test_cli_train_help_lists_presets_and_default_losses(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "  st-matryoshka2d " in out and "  starbucks-paper " in out
    assert "default loss per kind of training data" in out and "  triplets   angle:" in out


def test_a_few_steps_of_the_default_loss_on_nli_triplets_do_not_pull_unrelated_sentences_together(tmp_path):
    """Issue 8: CoSENT on triplets read as 0/1 pairs (the old default) sent the mean cosine of unrelated sentences
    from 0.075 to 0.880 in 60 steps. The default loss on triplets must keep them apart (measured 0.069 -> 0.090
    with these settings, 2026-11-23)."""
    from matryoshka2d.paths import data_dir

    source = data_dir() / "nli" / "train_triplets.tsv"
    if not source.is_file():
        pytest.skip(f"shared NLI triplets not available here: {source}")
    lines = source.read_text(encoding="utf-8").splitlines()
    train_file = tmp_path / "triplets.tsv"
    train_file.write_text("\n".join(lines[:321]) + "\n", encoding="utf-8")
    unrelated = [line.split("\t")[0] for line in lines[5000:5030]]  # anchors of other rows: unrelated to each other

    def mean_cosine(encoder):
        v = encoder.encode(unrelated, normalize=True)
        return float((v @ v.T).sum() - len(v)) / (len(v) * (len(v) - 1))

    cfg = TrainConfig(
        data=[str(train_file)],
        output=str(tmp_path / "o"),
        model="minilm-l6",
        steps=20,
        batch_size=16,
        lr=1e-4,
        max_length=32,
        warmup_ratio=0.0,
        save_steps=0,
        device="cpu",
    )
    trainer = Trainer(cfg)
    assert trainer.loss_name == "angle"
    trainer.encoder.eval()
    before = mean_cosine(trainer.encoder)
    for _ in range(cfg.steps):
        trainer.train_step()
    trainer.encoder.eval()
    after = mean_cosine(trainer.encoder)
    assert after < before + 0.1 and after < 0.3, (before, after)
