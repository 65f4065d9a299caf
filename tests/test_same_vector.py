"""The same text gives the same vector whatever shares its call (issue 61), on every backend and every rung of the
ladder: torch, the fp32 ONNX graphs, the int8 ones, the static cell (layer 0), an exit aligned to the last layer by
its head, and a query encoder (a model of its own, served by the same backends). Each text alone and inside a call
of texts of other lengths, padded to the longest, gives the same vector up to the order of float sums
(|alone - together| / |alone| at most graph_check.BATCH_RTOL). int8 with one activation scale per call, as
onnxruntime's dynamic quantization makes it, moves a text's vector with its neighbours: that graph fails the check
and is never served. Tiny random models built in code."""

import copy
import json
import shutil

import numpy as np
import pytest

from helpers.data import WORDS
from helpers.models import TINY, tiny_transformer
from matryoshka2d.export.graph_check import BATCH_RTOL, check_graph, moved_by_call, reference, run_reference
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve.backends import OnnxBackend, TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")

# Lengths from one word piece to a hundred: a call of them pads the short ones many times over.
TEXTS = [
    "red",
    "a big cat sleeps",
    "the old dog runs and the small bird eats while the happy fish swims",
    " ".join(WORDS * 5),
    "blue",
    "green bird jumps over the sad cat",
]


def one_call_per_request(monkeypatch):
    """A backend's texts in one padded call, however different their lengths (the backends cut a request into
    length groups where the padding costs more than a call: here it never does)."""
    monkeypatch.setattr("matryoshka2d.serve.backends.ONNX_CALL_OVERHEAD_TOKENS", {None: 1e9, "int8": 1e9})
    monkeypatch.setattr("matryoshka2d.models.batching.TORCH_CALL_OVERHEAD_TOKENS", {"cpu": 1e9})


@pytest.fixture(scope="module")
def rungs_model(tokenizer):
    """A tiny 4-layer BERT whose exits carry closed-form heads into its last layer's space (the ladder's aligned
    exits) and which holds a static cell (a random table and its identity head) as layer 0."""
    import torch

    from matryoshka2d.models.heads_fit import fit_heads
    from matryoshka2d.models.static import StaticCell

    encoder = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="rungs")
    sentences = [" ".join(np.random.default_rng(i).choice(WORDS, 6)) for i in range(80)]
    heads, _ = fit_heads(encoder, [sentences])
    encoder.set_exit_heads(heads)
    torch.manual_seed(1)
    table = torch.randn(tokenizer.vocab_size, encoder.hidden_size)
    encoder.set_static_cell(StaticCell.build(tokenizer.backend_tokenizer, table, encoder.hidden_size))
    return encoder


@pytest.fixture(scope="module")
def query_encoder(tokenizer):
    """A query encoder: another model (two layers), served as a model of its own."""
    import torch
    import transformers

    torch.manual_seed(2)
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, **{**TINY, "num_hidden_layers": 2})
    model = transformers.AutoModel.from_config(config).eval()
    return ElasticEncoder.from_modules(model, tokenizer, name="query-encoder")


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The ONNX graph cache of the module's models (each graph is exported once: an export takes seconds)."""
    return tmp_path_factory.mktemp("same-vector-graphs")


@pytest.fixture(scope="module")
def full_depth_graph(rungs_model, graphs):
    """The cached fp32 graph of the full depth (layer 4) of the rungs' model."""
    return backend_of("onnx", rungs_model, graphs, [4]).paths[4]


def backend_of(kind: str, encoder: ElasticEncoder, cache, layers):
    if kind == "torch":
        return TorchBackend(encoder, layers=layers)
    pytest.importorskip("onnxruntime")
    quantize = "int8" if kind == "onnx-int8" else None
    return OnnxBackend(encoder, quantize, layers, cache_folder=cache, threads=1, log=lambda line: None)


def moved(alone: np.ndarray, together: np.ndarray) -> float:
    """The largest |alone - together| / |alone| over the rows."""
    return float((np.linalg.norm(alone - together, axis=1) / np.linalg.norm(alone, axis=1)).max())


def assert_same_vectors(backend, layer: int, texts: list[str]) -> None:
    """Each text alone, then the texts in one call and in another order with a neighbour fewer: one vector each."""
    alone = np.concatenate([backend.pooled([text], layer) for text in texts])
    order = list(range(len(texts)))[::-1][:-1]
    for what, rows in (("inside one call", list(range(len(texts)))), ("inside a call in another order", order)):
        move = moved(alone[rows], backend.pooled([texts[i] for i in rows], layer))
        assert move <= BATCH_RTOL, f"layer {layer}: a text's vector alone and {what} differs by {move:.1e}"


@pytest.mark.parametrize("kind", ["torch", "onnx", "onnx-int8"])
def test_every_rung_gives_a_text_its_vector_whatever_shares_its_call(kind, rungs_model, graphs, monkeypatch):
    one_call_per_request(monkeypatch)
    backend = backend_of(kind, rungs_model, graphs, [0, 2, 4])
    assert backend.layers == [0, 2, 4]  # the static cell, an aligned exit (its head), the full depth
    for layer in backend.layers:
        assert_same_vectors(backend, layer, TEXTS)


@pytest.mark.parametrize("kind", ["torch", "onnx", "onnx-int8"])
def test_a_query_encoder_gives_a_text_its_vector_whatever_shares_its_call(kind, query_encoder, graphs, monkeypatch):
    one_call_per_request(monkeypatch)
    assert_same_vectors(backend_of(kind, query_encoder, graphs, [2]), 2, TEXTS)


def test_a_request_of_mixed_lengths_is_answered_as_each_text_alone(rungs_model, graphs):
    """As the server calls it (its own length groups): texts alone and inside requests of 8 of mixed lengths."""
    backend = backend_of("onnx-int8", rungs_model, graphs, [0, 2, 4])
    rng = np.random.default_rng(0)
    for _ in range(3):
        request = [" ".join(rng.choice(WORDS, rng.integers(1, 60))) for _ in range(8)]
        assert_same_vectors(backend, 4, request)


def per_call_int8(fp32, target):
    """int8 as onnxruntime's dynamic quantization makes it, one activation scale per call (the recipe before)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(fp32), str(target), weight_type=QuantType.QInt8, per_channel=True)
    return target


def test_int8_with_one_scale_per_call_moves_with_its_call_and_is_not_served(rungs_model, full_depth_graph, tmp_path):
    from matryoshka2d.export.onnx_graphs import quantize_int8

    features, _ = reference(rungs_model, 4)
    per_call = per_call_int8(full_depth_graph, tmp_path / "per-call.onnx")
    assert moved_by_call(per_call, features, run_reference(per_call, features)) > 10 * BATCH_RTOL
    problem = check_graph(rungs_model, per_call, 4, "int8", {})
    assert problem is not None and "another vector alone than inside a call" in problem
    rows = quantize_int8(full_depth_graph, tmp_path / "rows.onnx")
    assert moved_by_call(rows, features, run_reference(rows, features)) < BATCH_RTOL / 10
    assert check_graph(rungs_model, rows, 4, "int8", {}) is None


def test_a_cached_int8_graph_of_the_per_call_recipe_is_rebuilt(rungs_model, full_depth_graph, graphs, tmp_path):
    """A per-call int8 graph left in a cache (its manifest re-signed to pass for the current recipe) fails its
    check when a process first uses it, and is rebuilt with one scale per row."""
    from matryoshka2d.files import file_sha256

    shutil.copytree(graphs, tmp_path / "cache")
    backend = backend_of("onnx-int8", rungs_model, tmp_path / "cache", [4])
    graph = backend.paths[4]
    manifest_path = graph.parent / "manifest.json"
    assert json.loads(manifest_path.read_text())["graphs"][graph.name]["moved_by_call"] <= BATCH_RTOL
    per_call_int8(full_depth_graph, graph)
    manifest = json.loads(manifest_path.read_text())
    manifest["graphs"][graph.name]["sha256"] = file_sha256(graph)
    manifest_path.write_text(json.dumps(manifest))
    lines = []
    rebuilt = OnnxBackend(rungs_model, "int8", [4], cache_folder=tmp_path / "cache", threads=1, log=lines.append)
    assert any("another vector alone than inside a call" in line for line in lines), lines
    assert moved(rebuilt.pooled(TEXTS[:1], 4), rebuilt.pooled(TEXTS, 4)[:1]) <= BATCH_RTOL


def test_a_dynamically_quantized_activation_the_rewrite_does_not_know_is_named(tmp_path):
    """A DynamicQuantizeLinear feeding anything but MatMulInteger with constant weights cannot get a scale per row:
    quantize_int8 refuses the graph, naming the node, rather than keep a scale per call."""
    from onnx import TensorProto, helper

    from matryoshka2d.export.int8_rows import RowScaleError, scale_rows

    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="quantize-x"),
        helper.make_node("MatMulInteger", ["q", "q", "z", "z"], ["y"], name="x-times-x"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [2, 2])],
    )
    with pytest.raises(RowScaleError, match="'x-times-x' .*only MatMulInteger with constant weights"):
        scale_rows(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_static_cell_on_a_tokenizer_that_pads_gives_a_text_its_vector_whatever_shares_its_call(tokenizer):
    """A tokenizer.json may switch padding on: the cell's mean would then count the call's pad tokens."""
    import torch
    from tokenizers import Tokenizer

    from matryoshka2d.models.static import StaticCell

    padding = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    padding.enable_padding(pad_id=0, pad_token="[PAD]")
    assert len({len(e.ids) for e in padding.encode_batch(TEXTS)}) == 1  # it pads every text to the longest
    cell = StaticCell.build(padding, torch.randn(tokenizer.vocab_size, 8), 8)
    alone = np.concatenate([cell.encode([text]) for text in TEXTS])
    np.testing.assert_allclose(cell.encode(TEXTS), alone, atol=1e-6, rtol=0)
    assert padding.padding is not None  # the tokenizer given is left as it was


@pytest.mark.parametrize("kind", ["torch", "onnx", "onnx-int8"])
def test_a_decoder_padded_on_the_left_gives_a_text_its_vector_whatever_shares_its_call(
    kind, tokenizer, graphs, monkeypatch
):
    """A decoder (a tiny Llama) whose tokenizer pads on the left: the pads come first, positions count from them."""
    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    decoder = ElasticEncoder.from_modules(tiny_transformer("llama", left.vocab_size), left, name="left-llama")
    one_call_per_request(monkeypatch)
    assert_same_vectors(backend_of(kind, decoder, graphs, [4]), 4, TEXTS)


def test_every_int8_graph_is_made_by_the_one_recipe():
    """`export --quantize int8`, `export pair`, `serve --quantize int8`, `eval --backend onnx-int8` and `pick` all
    quantize through onnx_graphs.quantize_int8: no other module calls onnxruntime's quantizers."""
    import ast
    from pathlib import Path

    import matryoshka2d

    quantizers = {"quantize_dynamic", "quantize_static", "quantize", "MatMulNBitsQuantizer"}
    callers = set()
    for path in Path(matryoshka2d.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            imported = {alias.name for alias in node.names} if isinstance(node, ast.ImportFrom) else set()
            if (getattr(node, "module", None) or "").startswith("onnxruntime.quantization") and quantizers & imported:
                callers.add(path.name)
    assert callers == {"onnx_graphs.py"}
