"""Shared fixtures: tiny random models built in code, so tests run offline and fast."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from matryoshka2d.models.backbones import minilm_dir
from matryoshka2d.models.encoder import ElasticEncoder

TINY = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 64}


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_dir()))


def tiny_transformer(arch: str, vocab_size: int):
    """A randomly initialised 4-layer model of the given architecture (hidden 32)."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "bert":
        cfg = tf.BertConfig(vocab_size=vocab_size, **TINY)
    elif arch == "roberta":
        cfg = tf.RobertaConfig(vocab_size=vocab_size, pad_token_id=0, max_position_embeddings=130, **TINY)
    elif arch == "mpnet":
        cfg = tf.MPNetConfig(vocab_size=vocab_size, pad_token_id=0, max_position_embeddings=130, **TINY)
    elif arch == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=vocab_size, dim=32, n_layers=4, n_heads=4, hidden_dim=64)
    elif arch == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            pad_token_id=0,
        )
    else:
        raise ValueError(arch)
    return tf.AutoModel.from_config(cfg).eval()


@pytest.fixture(scope="session")
def tiny_bert(tokenizer):
    return ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", name="tiny-bert"
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random BERT saved as a plain Hugging Face folder (no sentence-transformers config)."""
    path = tmp_path_factory.mktemp("tiny-bert")
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def no_dropout_dir(tmp_path_factory, tokenizer):
    """A tiny random BERT without dropout, as a folder: runs that see the same rows compute the same numbers."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **TINY
    )
    path = tmp_path_factory.mktemp("tiny-no-dropout")
    tf.AutoModel.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def minilm():
    return ElasticEncoder("minilm-l6", device="cpu")


SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument on a stage in front of a very large and enthusiastic crowd.",
    "The market fell.",
    "",
    "A man is playing a guitar.",
    "Cats sleep most of the day, waking up only to eat and to look out of the window.",
    "Rain.",
]
