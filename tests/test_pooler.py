"""The pooler head (D -> d, tanh): its output is the embedding at every exit, it saves as a sentence-transformers
Dense module that loads with the same embeddings, and the trainer can add it and train it alone."""

import json

import numpy as np
import pytest
import torch

from helpers.models import tiny_run, tiny_transformer
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.pooler import PoolerHead, pool
from matryoshka2d.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["a red cat runs", "the old dog sleeps in the sun", "big birds", "a red cat runs"]


@pytest.fixture
def encoder(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean")


def test_the_head_output_is_the_embedding_at_every_exit(encoder):
    head = encoder.add_pooler(8, seed=3)
    assert (encoder.hidden_size, encoder.transformer_size) == (8, 32)
    assert encoder.info()["pooler"] == "dense 32->8 tanh"
    assert encoder.encode(TEXTS).shape == (4, 8)
    at_two = encoder.encode(TEXTS, layer=2)
    features = encoder.tokenize(TEXTS)
    with torch.no_grad():
        hidden = encoder.token_states(features, [2])[2]
        expected = torch.tanh(head.linear(pool(hidden, features["attention_mask"], "mean"))).numpy()
    np.testing.assert_allclose(at_two, expected, atol=1e-5)
    grid = encoder.encode_grid(TEXTS, layers=[1, 4], dims=[4, 8])
    assert grid[(1, 4)].shape == (4, 4)
    np.testing.assert_allclose(grid[(1, 4)], grid[(1, 8)][:, :4])
    with pytest.raises(BackboneError, match=r"dim 9 is out of range .* have 8 numbers"):
        encoder.encode(TEXTS, dim=9)
    assert encoder.set_pooler(None) is head and encoder.hidden_size == 32
    assert encoder.encode(TEXTS).shape == (4, 32)


def test_saved_head_loads_in_sentence_transformers_with_the_same_embeddings(encoder, tmp_path):
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    encoder.add_pooler(8, seed=1)
    out = encoder.save(tmp_path / "m")
    modules = json.loads((out / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Dense"]
    config = json.loads((out / "2_Dense" / "config.json").read_text())
    # sentence-transformers writes the module itself; these are the fields that define the head.
    assert config | {"in_features": 32, "activation_function": "torch.nn.modules.activation.Tanh"} == config
    assert {k: config[k] for k in ("in_features", "out_features", "bias", "activation_function")} == {
        "in_features": 32,
        "out_features": 8,
        "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh",
    }
    assert sorted(load_file(out / "2_Dense" / "model.safetensors")) == ["linear.bias", "linear.weight"]
    ours = ElasticEncoder(str(out), device="cpu")
    assert ours.hidden_size == 8
    theirs = SentenceTransformer(str(out), device="cpu")
    assert theirs.get_embedding_dimension() == 8
    np.testing.assert_allclose(ours.encode(TEXTS), theirs.encode(TEXTS), atol=1e-5)
    np.testing.assert_allclose(ours.encode(TEXTS), encoder.encode(TEXTS), atol=1e-6)
    AutoModel.from_pretrained(str(out))  # the transformer part is untouched
    # Saving again without the head leaves no stale Dense folder behind.
    ours.set_pooler(None)
    ours.save(out)
    assert not (out / "2_Dense").exists() and len(json.loads((out / "modules.json").read_text())) == 2


def test_pooler_errors(encoder, tmp_path):
    for bad in (0, 33, 2.5, True):
        with pytest.raises(BackboneError, match="pooler dim"):
            encoder.add_pooler(bad)
    with pytest.raises(BackboneError, match="a pooler taking 16 numbers does not fit"):
        encoder.set_pooler(PoolerHead(16, 4))
    with pytest.raises(BackboneError, match="activation 'torch.nn.ReLU' is not supported"):
        PoolerHead(32, 4, activation="torch.nn.ReLU")
    folder = tmp_path / "2_Dense"
    PoolerHead.fresh(32, 4).save(folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(BackboneError, match=r"has no model.safetensors \(found pytorch_model.bin"):
        PoolerHead.load(folder)


def test_a_model_with_a_head_that_does_not_fit_is_refused(encoder, tmp_path):
    encoder.add_pooler(8)
    out = encoder.save(tmp_path / "m")
    config = json.loads((out / "2_Dense" / "config.json").read_text())
    (out / "2_Dense" / "config.json").write_text(json.dumps({**config, "in_features": 16}))
    with pytest.raises(BackboneError, match=r"2_Dense'\): sentence-transformers could not load it"):
        ElasticEncoder(str(out), device="cpu")


def config(tiny_dir, files, out, **kw):
    """Three steps of CoSENT."""
    return tiny_run(tiny_dir, files / "triplets.tsv", files / "dev.tsv", out, **{"steps": 3, "loss": "cosent", **kw})


def test_trainer_adds_a_pooler_and_a_frozen_encoder_keeps_every_weight(tiny_dir, files, tmp_path):
    first = Trainer(config(tiny_dir, files, tmp_path / "e2e", pooler_dim=8)).run(progress=False)
    meta = json.loads((first / "matryoshka2d.json").read_text())
    assert meta["final_eval"]["eval"].endswith("@(4,8)")
    trainer = Trainer(config(tiny_dir, files, tmp_path / "frozen", model=str(first), pooler_dim=8, freeze_encoder=True))
    before = {k: v.clone() for k, v in trainer.encoder.state_dict().items()}
    head_before = trainer.encoder.head.linear.weight.detach().clone()
    trainer.run(progress=False)
    after = trainer.encoder.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(k.startswith("head.") for k in changed), changed
    assert not torch.equal(head_before, trainer.encoder.head.linear.weight)  # it started from the trained head
    saved = ElasticEncoder(str(tmp_path / "frozen"), device="cpu")
    for name, value in saved.model.state_dict().items():
        torch.testing.assert_close(value, before[f"model.{name}"], rtol=0, atol=0, msg=name)


def test_pooler_with_the_softmax_loss_and_option_errors(tiny_dir, files, tmp_path):
    trainer = Trainer(config(tiny_dir, files, tmp_path, data=[str(files / "nli.tsv")], loss="softmax", pooler_dim=8))
    assert set(trainer.task_loss.heads) == {"8"}
    assert np.isfinite(trainer.train_step()["loss"])
    with pytest.raises(ValueError, match="freeze_encoder trains only the pooler head"):
        Trainer(config(tiny_dir, files, tmp_path, freeze_encoder=True))
    with pytest.raises(BackboneError, match="pooler dim 64 is out of range"):
        Trainer(config(tiny_dir, files, tmp_path, pooler_dim=64))
