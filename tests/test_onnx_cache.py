"""Issue 32, cases 8, 10 and 19: a cached ONNX graph is checked against torch the first time a process uses it and
rebuilt when it does not reproduce the model or does not load; an int8 server keeps only its int8 graphs
(docs/reliability.md, section 10)."""

import json
import shutil

import numpy as np
import pytest

from matryoshka2d.files import file_sha256
from matryoshka2d.models.encoder import ElasticEncoder

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from matryoshka2d.deploy.backends import OnnxBackend  # noqa: E402
from test_serve import CountedExport  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["a red cat", "the old dog sleeps in the sun", "x"]


@pytest.fixture(scope="module")
def tiny_local(tiny_bert, tmp_path_factory):
    return ElasticEncoder(str(tiny_bert.save(tmp_path_factory.mktemp("tiny-onnx"))), device="cpu")


@pytest.fixture(scope="module")
def graphs(tiny_local, tmp_path_factory):
    """The cached fp32 graph of layer 2, built once here (an export takes seconds)."""
    folder = tmp_path_factory.mktemp("graphs")
    OnnxBackend(tiny_local, layers=[2], cache_folder=folder, log=lambda _: None)
    return folder


@pytest.fixture
def cache(graphs, tmp_path, monkeypatch):
    """A copy of the cached graphs: the folder of the tiny model's graphs in it, and the counted export."""
    root = tmp_path / "graphs"
    shutil.copytree(graphs, root)
    export = CountedExport(graphs)
    monkeypatch.setattr("matryoshka2d.deploy.backends.export_exit", export)
    return graphs_of(root), export


def graphs_of(root):
    """The folder of a cache that holds the graphs of the one model the cache was built for."""
    (folder,) = root.glob("weights-*")
    return folder


def start(encoder, folder, quantize=None):
    """A backend serving layer 2 from the cache that holds `folder` (or from `folder` itself, a cache folder still
    empty), and the lines it logged."""
    lines = []
    root = folder.parent if folder.name.startswith("weights-") else folder
    return OnnxBackend(encoder, quantize, layers=[2], cache_folder=root, log=lines.append), lines


def rerecord(folder, name):
    """Write the graph's checksum as it now is into the manifest: the manifest vouches for the planted file."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["graphs"][name]["sha256"] = file_sha256(folder / name)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def another_model(path, target=None):
    """The graph at `path` with its word embeddings redrawn: the same shape, another model's vectors."""
    model = onnx.load(str(path))
    biggest = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    weights = onnx.numpy_helper.to_array(biggest)
    redrawn = np.random.default_rng(0).normal(0, weights.std(), weights.shape).astype(weights.dtype)
    biggest.CopyFrom(onnx.numpy_helper.from_array(redrawn, biggest.name))
    onnx.save(model, str(target or path))
    return target or path


def served_like_torch(backend, encoder, quantize=None):
    got, expected = backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2]
    if quantize is None:
        np.testing.assert_allclose(got, expected, atol=1e-4)
    else:
        cosines = np.einsum("ij,ij->i", got, expected) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosines.min() > 0.99


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_cached_graph_of_another_model_is_rebuilt_though_the_manifest_vouches_for_it(cache, tiny_local, quantize):
    folder, export = cache
    if quantize:
        start(tiny_local, folder, quantize)  # the int8 graph, quantized from the cached fp32 one
        from matryoshka2d.deploy.onnx_graphs import quantize_int8

        planted = another_model(folder / "layer-2.onnx", folder.parent / "other.onnx")
        quantize_int8(planted, folder / "layer-2.int8.onnx")
    else:
        another_model(folder / "layer-2.onnx")
    name = f"layer-2{'.int8' if quantize else ''}.onnx"
    rerecord(folder, name)
    backend, lines = start(tiny_local, folder, quantize)
    problem = "agrees with the model at layer 2 only to a lowest" if quantize else "differs from the model at layer 2"
    rebuilt = [line for line in lines if f"{folder.name}/{name} {problem}" in line and "is rebuilt" in line]
    assert rebuilt, lines
    assert export.calls == (0 if quantize else 1)  # int8: requantized from the cached fp32 graph, which is right
    served_like_torch(backend, tiny_local, quantize)
    _, lines = start(tiny_local, folder, quantize)  # rebuilt once, then trusted again
    assert not any("rebuilt" in line for line in lines)


@pytest.mark.parametrize("damage", ["custom op", "external data outside the folder"])
def test_a_cached_graph_that_onnxruntime_would_refuse_is_rebuilt_not_a_traceback(cache, tiny_local, tmp_path, damage):
    folder, export = cache
    graph = folder / "layer-2.onnx"
    model = onnx.load(str(graph))
    if damage == "custom op":
        model.graph.node[len(model.graph.node) // 2].domain = "com.example"
        model.opset_import.append(onnx.helper.make_opsetid("com.example", 1))
        problem = "does not load or run in onnxruntime"
    else:
        tensor = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
        (tmp_path / "outside.bin").write_bytes(tensor.raw_data)  # the right numbers, in the wrong place
        length = len(tensor.raw_data)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "../outside.bin"), ("offset", "0"), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
        problem = "names '../outside.bin', which leaves"
    graph.write_bytes(model.SerializeToString())
    rerecord(folder, graph.name)
    backend, lines = start(tiny_local, folder)
    assert export.calls == 1
    assert any(problem in line and "it is not used, and is rebuilt" in line for line in lines), lines
    served_like_torch(backend, tiny_local)


def test_an_int8_server_keeps_only_its_int8_graphs(graphs, tiny_local, tmp_path, monkeypatch):
    export = CountedExport(graphs)
    monkeypatch.setattr("matryoshka2d.deploy.backends.export_exit", export)
    root = tmp_path / "empty"
    backend, _ = start(tiny_local, root, "int8")
    assert export.calls == 1  # the fp32 graph, as the input of quantization
    folder = graphs_of(root)
    assert sorted(p.name for p in folder.iterdir()) == ["layer-2.int8.onnx", "manifest.json"]
    assert list(json.loads((folder / "manifest.json").read_text())["graphs"]) == ["layer-2.int8.onnx"]
    served_like_torch(backend, tiny_local, "int8")
    start(tiny_local, folder, "int8")
    assert export.calls == 1  # the int8 graph is cached: no fp32 graph is needed again
