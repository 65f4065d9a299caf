"""Tiny models built in code and the options of short runs on them: tests run offline and in seconds."""

import json

import torch

from matryoshka2d.training.config import TrainConfig

TINY = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 64}


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


def tiny_run(model_dir, data, eval_file, out, /, **changes) -> TrainConfig:
    """The options of a few steps on a tiny model: batch 8, lr 1e-3, no warm-up, no checkpoints; `changes`
    override any of them."""
    options = dict(
        model=str(model_dir),
        pooling="mean",
        data=[str(data)],
        output=str(out),
        batch_size=8,
        eval_file=str(eval_file),
        lr=1e-3,
        warmup_ratio=0.0,
        save_steps=0,
    )
    return TrainConfig(**{**options, **changes})


def distill_config(teacher, data, out, dev, **changes) -> TrainConfig:
    """The options of a short `distill` run (6 steps, batch 16, cosine loss, identity exit heads, one shared
    student); `changes` override any of them."""
    options = dict(
        model=str(teacher),
        pooling="mean",
        method="distill",
        loss="cos",
        data=[str(data)],
        output=str(out),
        batch_size=16,
        steps=6,
        lr=1e-3,
        warmup_ratio=0.0,
        save_steps=0,
        eval_file=str(dev),
        exit_heads="identity",
        method_options={"mode": "shared"},
    )
    return TrainConfig(**{**options, **changes})


def set_heads_record(folder, **changes) -> None:
    """Change fields of the exit heads record in a model folder's matryoshka2d.json (as a hand-edit would)."""
    meta_path = folder / "matryoshka2d.json"
    meta = json.loads(meta_path.read_text())
    meta["exit_heads"].update(changes)
    meta_path.write_text(json.dumps(meta))


def wide_bert_folder(folder, tokenizer):
    """A random BERT of 12 layers x 384 (minilm-l6's width, twice its depth) saved with `tokenizer` in `folder`: a
    text of about 450 tokens is a good fraction of a second of a core, so the server tests that signal a server with
    requests in flight find them still running."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=1536,
    )
    tf.AutoModel.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
