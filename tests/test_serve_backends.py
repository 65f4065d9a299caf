"""What runs the model behind the server (serve/backends.py, serve/graph_cache.py): the torch backend at the layers
it serves, and the ONNX graphs, cached beside the model with a checksum manifest, used when they match and rebuilt
when they do not, int8 graphs quantized from the cached fp32 one. No HTTP here."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.data import SENTENCES
from helpers.graphs import CountedExport
from helpers.server import onnx_graphs_of
from matryoshka2d.models.encoder import ElasticEncoder

TEXTS = [s for s in SENTENCES if s]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_bert):
    return tiny_bert.save(tmp_path_factory.mktemp("tiny-served"))


@pytest.fixture(scope="module")
def tiny_local(tiny_folder):
    return ElasticEncoder(str(tiny_folder), device="cpu")


@pytest.fixture(scope="module")
def onnx_graphs(tiny_folder, tmp_path_factory):
    """The cached ONNX graph of layer 2 of the tiny model, built once here (an export takes seconds)."""
    pytest.importorskip("onnxruntime")
    return onnx_graphs_of(tiny_folder, tmp_path_factory.mktemp("graphs"))


def test_the_torch_backend_answers_the_layers_it_serves(tiny_local):
    from matryoshka2d.serve.backends import TorchBackend

    assert TorchBackend(tiny_local).layers == [1, 2, 3, 4]
    backend = TorchBackend(tiny_local, layers=[4, 2])
    assert backend.layers == [2, 4] and backend.describe() == {"backend": "torch", "precision": "float32"}
    np.testing.assert_allclose(backend.pooled(TEXTS, 2), tiny_local.pooled_states(TEXTS, [2])[2], atol=1e-6)
    with pytest.raises(ValueError, match="layer"):
        TorchBackend(tiny_local, layers=[5])


def test_pooled_states_from_given_token_ids_equal_its_own(tiny_local):
    texts = ["a cat sat", "the dog ran", "a cat sat", "word " * 3000]
    encoded = dict(tiny_local.tokenizer(texts, truncation=True, max_length=tiny_local.max_length))
    given = tiny_local.pooled_states(texts, [1, 2], encoded=encoded)
    own = tiny_local.pooled_states(texts, [1, 2])
    for n in (1, 2):
        np.testing.assert_array_equal(given[n], own[n])
    with pytest.raises(ValueError, match="encoded holds 4 rows for 3 texts"):
        tiny_local.pooled_states(texts[:3], [1], encoded=encoded)


@pytest.fixture
def graph_copy(onnx_graphs, tmp_path, monkeypatch):
    """A copy of the cache: the folder of the tiny model's graphs in it (named by its weights), the counted export."""
    shutil.copytree(onnx_graphs, tmp_path / "graphs")
    export = CountedExport(onnx_graphs)
    monkeypatch.setattr("matryoshka2d.serve.graph_cache.export_exit", export)
    (folder,) = (tmp_path / "graphs").glob("weights-*")
    return folder, export


def onnx_backend(tiny_local, folder, quantize=None):
    """A backend on the cache that holds `folder`, the folder of the model's graphs."""
    from matryoshka2d.serve.backends import OnnxBackend

    return OnnxBackend(tiny_local, quantize, layers=[2], cache_folder=folder.parent, log=lambda _: None)


def test_cached_graph_is_used_and_matches_the_encoder(graph_copy, tiny_local):
    folder, export = graph_copy
    backend = onnx_backend(tiny_local, folder)
    assert export.calls == 0
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["graphs"]["layer-2.onnx"]
    assert len(manifest["source_sha256"]) == 64 and len(entry["sha256"]) == 64
    assert entry["max_abs_difference_vs_torch"] <= 1e-4
    texts = [*TEXTS, "word " * 40]
    np.testing.assert_allclose(backend.pooled(texts, 2), tiny_local.pooled_states(texts, [2])[2], atol=1e-4)
    backend.load()
    assert backend.describe()["session_mb"].keys() == {"2"}  # measured when the session loaded
    assert "/" not in json.dumps(backend.describe())  # what /v1/models shows of it: no path of the machine


@pytest.mark.parametrize("damage", ["missing", "damaged", "other weights", "older recipe", "damaged manifest"])
def test_a_missing_or_damaged_graph_is_rebuilt_never_used(graph_copy, tiny_local, damage):
    folder, export = graph_copy
    graph = folder / "layer-2.onnx"
    if damage == "missing":
        graph.unlink()
    elif damage == "damaged":
        data = bytearray(graph.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte: onnxruntime might even load it
        graph.write_bytes(bytes(data))
    elif damage in ("other weights", "older recipe"):
        manifest = json.loads((folder / "manifest.json").read_text())
        if damage == "other weights":
            manifest["source_sha256"] = "0" * 64
        else:
            manifest["graphs"]["layer-2.onnx"]["recipe"] = "an exporter of long ago"
        (folder / "manifest.json").write_text(json.dumps(manifest))
    else:
        (folder / "manifest.json").write_text("{not json")
    backend = onnx_backend(tiny_local, folder)
    assert export.calls == 1
    assert graph.read_bytes() == (export.source).read_bytes()
    np.testing.assert_allclose(backend.pooled(TEXTS, 2), tiny_local.pooled_states(TEXTS, [2])[2], atol=1e-4)
    onnx_backend(tiny_local, folder)
    assert export.calls == 1  # rebuilt once, then trusted again


def test_int8_graphs_agree_with_torch(graph_copy, tiny_local):
    folder, export = graph_copy
    backend = onnx_backend(tiny_local, folder, quantize="int8")
    assert export.calls == 0  # quantized from the cached fp32 graph
    entry = json.loads((folder / "manifest.json").read_text())["graphs"]["layer-2.int8.onnx"]
    assert entry["quantize"] == "int8" and entry["min_cosine_vs_torch"] > 0.99
    got, expected = backend.pooled(TEXTS, 2), tiny_local.pooled_states(TEXTS, [2])[2]
    cosines = np.einsum("ij,ij->i", got, expected) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() > 0.99
    backend.release_memory()  # the arena shrinks at rest; the session answers the same afterwards
    np.testing.assert_array_equal(backend.pooled(TEXTS, 2), got)


def test_an_int8_graph_from_an_older_fp32_recipe_is_rebuilt(graph_copy, tiny_local, monkeypatch):
    """The int8 recipe names the fp32 recipe it quantizes: when the export changes, cached int8 graphs go too."""
    from matryoshka2d.serve import graph_cache

    folder, _ = graph_copy
    onnx_backend(tiny_local, folder, quantize="int8")
    quantized, quantize = [], graph_cache.quantize_int8
    monkeypatch.setattr(graph_cache, "quantize_int8", lambda *a: quantized.append(a) or quantize(*a))
    onnx_backend(tiny_local, folder, quantize="int8")
    assert quantized == []  # cached and trusted
    manifest = json.loads((folder / "manifest.json").read_text())
    old_fp32 = "torch.onnx dynamo export of ExitGraph (encoder.forward at the layer), fp32"
    manifest["graphs"]["layer-2.int8.onnx"]["recipe"] = graph_cache.RECIPES["int8"].replace(
        graph_cache.FP32_RECIPE, old_fp32
    )
    (folder / "manifest.json").write_text(json.dumps(manifest))
    onnx_backend(tiny_local, folder, quantize="int8")
    assert len(quantized) == 1


def test_graphs_are_cached_beside_a_model_folder_and_apart_from_an_installed_one(
    tiny_local, minilm, tmp_path, monkeypatch
):
    from matryoshka2d.serve.graph_cache import default_cache_folder

    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path))
    assert default_cache_folder(tiny_local, "ab" * 32) == Path(tiny_local.location) / "onnx-serve"
    assert default_cache_folder(minilm, "cd" * 32) == tmp_path / "onnx-serve" / f"minilm-l6-{'cd' * 6}"
