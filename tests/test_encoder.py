"""ElasticEncoder: exits really stop at layer n, cells equal full-forward states, the grid equals cells."""

import numpy as np
import pytest
import torch

from helpers.data import SENTENCES
from helpers.models import tiny_transformer
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.pooler import pool

ARCHS = ["bert", "roberta", "mpnet", "distilbert", "llama"]


def reference(model, tokenizer, texts, layer, pooling):
    """What a user would compute by hand: a full forward pass with every hidden state, then pool one."""
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if model.config.model_type == "bert" else [])
    features = {k: v for k, v in batch.items() if k in names}
    with torch.no_grad():
        out = model(**features, output_hidden_states=True)
    hidden = out.hidden_states[layer]
    n_layers = len(out.hidden_states) - 1
    if model.config.model_type == "llama":
        # Decoders normalise once after the last layer; every exit applies that norm, so the full-depth
        # exit equals the model's own last_hidden_state.
        hidden = out.last_hidden_state if layer == n_layers else model.norm(hidden)
    return pool(hidden, features["attention_mask"], pooling).detach().numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_exit_at_layer_n_equals_pooled_hidden_state_n(arch, tokenizer):
    model = tiny_transformer(arch, tokenizer.vocab_size)
    pooling = "last-token" if arch == "llama" else "mean"
    enc = ElasticEncoder.from_modules(model, tokenizer, pooling=pooling, name=f"tiny-{arch}")
    texts = [t for t in SENTENCES if t]  # the reference pads all at once; ours sorts and batches
    for layer in range(1, 5):
        ours = enc.encode(texts, layer=layer, batch_size=2)
        expected = reference(model, tokenizer, texts, layer, pooling)
        np.testing.assert_allclose(ours, expected, atol=1e-5, err_msg=f"{arch} layer {layer}")


@pytest.mark.parametrize("arch", ARCHS)
def test_exit_at_layer_n_calls_no_layer_above_n(arch, tokenizer):
    model = tiny_transformer(arch, tokenizer.vocab_size)
    enc = ElasticEncoder.from_modules(model, tokenizer, pooling="cls", name=f"tiny-{arch}")
    from matryoshka2d.models.backbones import layer_stack

    calls = [0] * 4
    stack = layer_stack(model)
    handles = [
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)) for i, layer in enumerate(stack)
    ]
    try:
        enc.encode(SENTENCES, layer=2, batch_size=3)  # 6 unique texts -> 2 batches
    finally:
        for h in handles:
            h.remove()
    assert calls == [2, 2, 0, 0]
    assert len(layer_stack(model)) == 4, "the stack must be restored after the call"


def test_pooling_modes_on_padded_batch():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert pool(hidden, right, "mean")[0].tolist() == [1.0, 2.0]
    assert pool(hidden, right, "cls")[0].tolist() == [0.0, 1.0]
    assert pool(hidden, right, "last-token")[0].tolist() == [2.0, 3.0]
    assert pool(hidden, left, "last-token")[0].tolist() == [4.0, 5.0]


def test_grid_equals_per_cell_encode(tiny_bert):
    grid = tiny_bert.encode_grid(SENTENCES, layers=[1, 3, 4], dims=[8, 32], normalize=True)
    assert sorted(grid) == [(1, 8), (1, 32), (3, 8), (3, 32), (4, 8), (4, 32)]
    for (layer, dim), cell in grid.items():
        single = tiny_bert.encode(SENTENCES, layer=layer, dim=dim, normalize=True)
        assert cell.dtype == np.float32 and cell.shape == (len(SENTENCES), dim)
        np.testing.assert_allclose(cell, single, atol=1e-6)


def test_grid_runs_one_pass_per_batch(tiny_bert):
    from matryoshka2d.models.backbones import layer_stack

    first = layer_stack(tiny_bert.model)[0]
    calls = []
    handle = first.register_forward_hook(lambda *_: calls.append(1))
    try:
        tiny_bert.encode_grid(SENTENCES, layers=[1, 2, 3, 4], dims=[8, 16, 32], batch_size=100)
        grid = len(calls)
        tiny_bert.encode(SENTENCES, layer=4, dim=32, batch_size=100)
    finally:
        handle.remove()
    # twelve cells cost the passes of one: a pass per length group of texts (matryoshka2d.models.batching)
    assert grid == len(calls) - grid <= 2


def test_duplicates_are_encoded_once_and_order_is_kept(tiny_bert):
    rows = []
    handle = tiny_bert.model.embeddings.register_forward_hook(lambda _m, _a, out: rows.append(out.shape[0]))
    try:
        texts = ["b b b b b", "a", "b b b b b", "a", "c c"]
        out = tiny_bert.encode(texts)
    finally:
        handle.remove()
    assert sum(rows) == 3
    np.testing.assert_array_equal(out[0], out[2])
    np.testing.assert_array_equal(out[1], out[3])
    np.testing.assert_allclose(out[4], tiny_bert.encode(["c c"])[0], atol=1e-6)


def test_slicing_keeps_first_dims_and_normalize_after_slicing(tiny_bert):
    full = tiny_bert.encode(SENTENCES, layer=2)
    part = tiny_bert.encode(SENTENCES, layer=2, dim=8)
    np.testing.assert_allclose(part, full[:, :8], atol=1e-6)
    unit = tiny_bert.encode(SENTENCES, layer=2, dim=8, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)


def test_single_string_gives_a_vector(tiny_bert):
    assert tiny_bert.encode("hello", dim=16).shape == (16,)


def test_minilm_paraphrase_scores_above_unrelated(minilm):
    v = minilm.encode(
        ["A man is playing a guitar.", "A person plays the guitar.", "The stock market crashed today."],
        normalize=True,
    )
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3


def test_minilm_last_layer_matches_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm.location, device="cpu")
    texts = [t for t in SENTENCES if t]
    np.testing.assert_allclose(minilm.encode(texts, normalize=True), st.encode(texts), atol=1e-5)


def test_minilm_reads_pooling_and_length_from_its_config(minilm):
    info = minilm.info()
    assert (info["layers"], info["hidden_size"], info["pooling"], info["max_length"]) == (6, 384, "mean", 256)
    assert info["parameters"] > 20_000_000


def test_layer_zero_is_the_embedding_output(tiny_bert):
    features = tiny_bert.tokenize(["a red cat", "the dog sleeps on the mat"])
    with torch.no_grad():
        states = tiny_bert.token_states(features, [0, 2])
        reference = tiny_bert.model(**features, output_hidden_states=True).hidden_states
    torch.testing.assert_close(states[0], reference[0])
    torch.testing.assert_close(states[2], reference[2])


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_fact_comes_from_its_row_of_the_table(arch, tokenizer):
    from matryoshka2d.models.backbones import ARCHITECTURES
    from matryoshka2d.models.decoders import is_decoder

    model = tiny_transformer(arch, tokenizer.vocab_size)
    row = ARCHITECTURES[arch]
    enc = ElasticEncoder.from_modules(model, tokenizer, pooling="mean", name=f"tiny-{arch}")
    assert is_decoder(model) == row.decoder
    assert (enc._final_norm is not None) == (row.final_norm is not None)
    # RoBERTa and MPNet number positions after the padding index, so fewer tokens than position embeddings fit;
    # a text longer than the model takes is cut to a length whose positions all exist.
    positions = model.config.max_position_embeddings
    assert enc.max_length == min(tokenizer.model_max_length, positions - row.position_offset)
    assert enc.encode(["word " * 1000]).shape == (1, 32)
