"""Issue 32, cases 8, 10 and 19: a cached ONNX graph is checked against torch the first time a process uses it and
rebuilt when it does not reproduce the model or does not load; an int8 server keeps only its int8 graphs
(docs/reliability.md, section 10)."""

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.models import tiny_transformer
from matryoshka2d.files import file_sha256
from matryoshka2d.models.encoder import ElasticEncoder

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers.graphs import CountedExport  # noqa: E402
from matryoshka2d.serve.backends import OnnxBackend  # noqa: E402

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
    monkeypatch.setattr("matryoshka2d.serve.graph_cache.export_exit", export)
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
        from matryoshka2d.export.onnx_graphs import quantize_int8

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
    monkeypatch.setattr("matryoshka2d.serve.graph_cache.export_exit", export)
    root = tmp_path / "empty"
    backend, _ = start(tiny_local, root, "int8")
    assert export.calls == 1  # the fp32 graph, as the input of quantization
    folder = graphs_of(root)
    assert sorted(p.name for p in folder.iterdir()) == ["layer-2.int8.onnx", "manifest.json"]
    assert list(json.loads((folder / "manifest.json").read_text())["graphs"]) == ["layer-2.int8.onnx"]
    served_like_torch(backend, tiny_local, "int8")
    start(tiny_local, folder, "int8")
    assert export.calls == 1  # the int8 graph is cached: no fp32 graph is needed again


@pytest.fixture(scope="module")
def two_models(tokenizer, tmp_path_factory):
    """Two tiny models of one shape and other weights (a teacher and its query encoder, as far as the cache sees)."""
    folders = []
    for seed in (0, 1):
        encoder = ElasticEncoder.from_modules(
            tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", device="cpu"
        )
        with torch.no_grad():  # the second one: other weights of the same shape
            for parameter in encoder.parameters():
                parameter.add_(0.05 * seed * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
        folders.append(encoder.save(tmp_path_factory.mktemp(f"model-{seed}")))
    return [ElasticEncoder(str(f), device="cpu") for f in folders]


@pytest.fixture(scope="module")
def shared_cache(two_models, tmp_path_factory):
    """One cache folder holding the layer-2 fp32 graphs of both models, built by real exports once here."""
    pytest.importorskip("onnxruntime")
    from matryoshka2d.serve.backends import OnnxBackend

    root = tmp_path_factory.mktemp("shared-cache")
    for encoder in two_models:
        OnnxBackend(encoder, layers=[2], cache_folder=root, log=lambda _: None)
    return root


def _backend(encoder, root, quantize=None, layers=(2,)):
    from matryoshka2d.serve.backends import OnnxBackend

    lines = []
    backend = OnnxBackend(encoder, quantize, layers=list(layers), cache_folder=root, log=lines.append)
    return backend, lines


def test_two_models_share_one_cache_folder_without_replacing_each_others_graphs(two_models, shared_cache, tmp_path):
    """Was: the query model's layer-2 graph replaced the teacher's in a shared --onnx-cache, the teacher's cells
    then answered with the query model's vectors, and every restart rebuilt every graph."""
    from matryoshka2d.serve import graph_cache

    root = tmp_path / "cache"
    shutil.copytree(shared_cache, root)
    exports = []
    real = graph_cache.export_exit
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph_cache, "export_exit", lambda *a: exports.append(a[1]) or real(*a))
        for _ in range(2):  # a restart: both servers again
            for encoder in two_models:
                backend, lines = _backend(encoder, root)
                expected = encoder.pooled_states(TEXTS, [2])[2]
                np.testing.assert_allclose(backend.pooled(TEXTS, 2), expected, atol=1e-4)
                assert not any("rebuilt" in line or "building" in line for line in lines), lines
    assert exports == []
    folders = sorted(p.name for p in root.iterdir())
    assert len(folders) == 2 and all(name.startswith("weights-") for name in folders)


@contextlib.contextmanager
def read_only(*folders):
    """Make folders read-only for this process as a user would find them: chattr +i as root (whom permissions do
    not stop), chmod 555 otherwise; skip where neither makes a write fail."""
    as_root = os.geteuid() == 0
    for folder in folders:
        if as_root:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
                pytest.skip("cannot make a folder read-only here (chattr)")
        else:
            folder.chmod(0o555)
    try:
        probe = folders[0] / ".probe"
        try:
            probe.write_text("x")
            probe.unlink()
            pytest.skip("the folder could still be written")
        except OSError:
            pass
        yield
    finally:
        for folder in folders:
            if as_root:
                subprocess.run(["chattr", "-i", str(folder)])
            else:
                folder.chmod(0o755)


def test_a_read_only_cache_is_used_read_only_and_a_missing_graph_there_names_the_option(
    two_models, shared_cache, tmp_path
):
    """Was: a read-only cache holding the graph ignored, or a raw "[Errno 1] Operation not permitted"."""
    from matryoshka2d.export.onnx_graphs import ExportError

    encoder = two_models[0]
    root = tmp_path / "cache"
    shutil.copytree(shared_cache, root)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with read_only(root, *root.iterdir()):
        backend, _ = _backend(encoder, root)
        np.testing.assert_allclose(backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2], atol=1e-4)
        with pytest.raises(ExportError) as refused:
            _backend(encoder, root, layers=(1, 2))  # layer 1 was never built
        message = str(refused.value)
        assert str(root) in message and "--onnx-cache" in message and "layer 1" in message
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_a_read_only_model_folder_with_its_graph_cache_is_served_from_that_cache(two_models, shared_cache, tmp_path):
    from matryoshka2d.serve.graph_cache import CACHE_FOLDER, weights_digest, weights_folder

    model = tmp_path / "model"
    shutil.copytree(two_models[0].location, model)
    sub = weights_folder(weights_digest(two_models[0]))
    shutil.copytree(shared_cache / sub, model / CACHE_FOLDER / sub)
    encoder = ElasticEncoder(str(model), device="cpu")
    with read_only(model, model / CACHE_FOLDER, model / CACHE_FOLDER / sub):
        from matryoshka2d.serve.backends import OnnxBackend

        backend = OnnxBackend(encoder, layers=[2], log=lambda _: None)
        assert backend.cache.root == model / CACHE_FOLDER
        np.testing.assert_allclose(backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2], atol=1e-4)


def _rerecord(folder, name, **changes):
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["graphs"][name] = {**manifest["graphs"][name], "sha256": file_sha256(folder / name), **changes}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def planted_link_message(encoder, shared_cache, tmp_path, content):
    """Serve from a cache whose layer-2 graph is a link to a file outside it (the graph itself, or other bytes),
    the manifest re-signed for that file; the line that refused it, with the cache's place left out."""
    from matryoshka2d.serve import graph_cache
    from matryoshka2d.serve.graph_cache import weights_digest, weights_folder

    root = tmp_path / content
    shutil.copytree(shared_cache, root)
    folder = root / weights_folder(weights_digest(encoder))
    outside = tmp_path / f"outside-{content}.onnx"
    if content == "graph":
        shutil.copyfile(folder / "layer-2.onnx", outside)
    else:
        outside.write_bytes(b"not a graph at all")
    (folder / "layer-2.onnx").unlink()
    (folder / "layer-2.onnx").symlink_to(outside)
    _rerecord(folder, "layer-2.onnx")  # the manifest vouches for the file outside
    kept, read, real = outside.read_bytes(), [], graph_cache.file_sha256
    built = shared_cache / folder.name / "layer-2.onnx"  # a copy stands in for the export (seconds)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph_cache, "file_sha256", lambda p: read.append(Path(p).resolve()) or real(p))
        patch.setattr(graph_cache, "export_exit", lambda encoder, layer, path: Path(shutil.copyfile(built, path)))
        backend, lines = _backend(encoder, root)
    assert outside.resolve() not in read  # not hashed, so nothing is learnt of its contents
    refused = [line for line in lines if "leaves" in line]
    assert len(refused) == 1 and "it is not read" in refused[0], lines
    assert outside.read_bytes() == kept and not (folder / "layer-2.onnx").is_symlink()
    np.testing.assert_allclose(backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2], atol=1e-4)
    return refused[0].replace(str(root), "ROOT")


def test_a_cached_graph_that_links_out_of_the_cache_is_refused_before_it_is_read(two_models, shared_cache, tmp_path):
    """Was: the link was followed, the file outside read and hashed, and the message depended on its checksum."""
    encoder = two_models[0]
    messages = [planted_link_message(encoder, shared_cache, tmp_path, content) for content in ("graph", "other")]
    assert messages[0] == messages[1]  # the message does not depend on what the outside file holds


def test_an_fp32_graph_under_the_int8_name_is_not_scored_or_served_as_int8(two_models, shared_cache, tmp_path):
    """Was: an fp32 graph copied over layer-2.int8.onnx, the manifest re-signed, passed the cosine check as int8."""
    from matryoshka2d.export.graph_check import external_data_inside
    from matryoshka2d.export.onnx_graphs import graph_precision
    from matryoshka2d.serve.graph_cache import weights_digest, weights_folder

    encoder = two_models[0]
    root = tmp_path / "cache"
    shutil.copytree(shared_cache, root)
    folder = root / weights_folder(weights_digest(encoder))
    _backend(encoder, root, "int8")  # the true int8 graph and its manifest entry
    assert graph_precision(external_data_inside(folder / "layer-2.int8.onnx")) == "int8"
    shutil.copyfile(folder / "layer-2.onnx", folder / "layer-2.int8.onnx")
    _rerecord(folder, "layer-2.int8.onnx", min_cosine_vs_torch=1.0)
    backend, lines = _backend(encoder, root, "int8")
    assert any("holds no quantized operator" in line and "rebuilt" in line for line in lines), lines
    assert graph_precision(external_data_inside(backend.paths[2])) == "int8"
    assert backend.describe()["precision"] == "int8"
