"""The OpenAI-compatible server, run as a real uvicorn process on 127.0.0.1 and called over HTTP."""

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import SENTENCES
from matryoshka2d.deploy.backends import OnnxBackend
from matryoshka2d.models.encoder import ElasticEncoder

openai = pytest.importorskip("openai", reason="the official openai client (in the dev extra) is not installed")

TEXTS = [s for s in SENTENCES if s]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`matryoshka2d serve` in a subprocess; stopped at the end of the module."""

    def __init__(self, model: str, name: str, *extra: str):
        self.port = free_port()
        self.backend = extra[extra.index("--backend") + 1] if "--backend" in extra else "torch"
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
        command = [
            sys.executable,
            "-m",
            "matryoshka2d.cli",
            "serve",
            "--model",
            model,
            "--served-name",
            name,
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--log-level",
            "warning",
            *extra,
        ]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {self.process.stdout.read()!r}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("server did not answer /health within 120 s")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def call(self, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
        status, answer = self.call_bytes(method, path, body, raw)
        return status, json.loads(answer)

    def call_bytes(self, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_bert):
    return tiny_bert.save(tmp_path_factory.mktemp("tiny-served"))


@pytest.fixture(scope="module")
def tiny_server(tiny_folder):
    server = Server(str(tiny_folder), "tiny", "--max-inputs", "8", "--max-body-bytes", "20000")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def onnx_graphs(tiny_folder, tmp_path_factory):
    """The cached ONNX graph of layer 2 of the tiny model, built once here (an export takes seconds)."""
    pytest.importorskip("onnxruntime")
    folder = tmp_path_factory.mktemp("graphs")
    OnnxBackend(ElasticEncoder(str(tiny_folder), device="cpu"), layers=[2], cache_folder=folder, log=lambda _: None)
    return folder


@pytest.fixture(scope="module")
def onnx_server(tiny_folder, onnx_graphs):
    limits = ("--max-inputs", "8", "--max-body-bytes", "20000")
    server = Server(
        str(tiny_folder), "tiny", *limits, "--backend", "onnx", "--layers", "2", "--onnx-cache", str(onnx_graphs)
    )
    yield server
    server.stop()


@pytest.fixture(params=["torch", "onnx"])
def any_server(request):
    """Each test that takes it runs against the torch backend and the onnx backend (layer 2 served)."""
    return request.getfixturevalue(f"{request.param}_server" if request.param == "onnx" else "tiny_server")


@pytest.fixture(scope="module")
def tiny_local(tiny_folder):
    return ElasticEncoder(str(tiny_folder), device="cpu")


@pytest.fixture(scope="module")
def minilm_server():
    """minilm-l6 served with --truncate and a default cell of (2, 16): one process for the two tests that read it
    (a server takes seconds to start); each asks for what it checks."""
    server = Server("minilm-l6", "minilm-l6", "--truncate", "--default-layer", "2", "--default-dimensions", "16")
    yield server
    server.stop()


def test_openai_client_gets_the_cell_of_minilm(minilm, minilm_server):
    server = minilm_server
    client = server.client()
    response = client.embeddings.create(model="minilm-l6", input=TEXTS, dimensions=64, extra_body={"layer": 3})
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    expected = minilm.encode(TEXTS, layer=3, dim=64, normalize=True)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    # --truncate: a text over 256 tokens is cut, and the answer says so.
    status, body = server.call("POST", "/v1/embeddings", {"model": "minilm-l6", "input": ["word " * 400]})
    assert status == 200 and body["usage"]["prompt_tokens"] == 256 and body["truncated_inputs"] == 1


def test_float_and_base64_match_encode(any_server, tiny_local):
    tiny_server = any_server
    expected = tiny_local.encode(TEXTS, layer=2, dim=16, normalize=True)
    atol = 1e-6 if tiny_server.backend == "torch" else 1e-5  # onnxruntime's kernels round differently
    client = tiny_server.client()
    as_float = client.embeddings.create(
        model="tiny", input=TEXTS, dimensions=16, encoding_format="float", extra_body={"layer": 2}
    )
    np.testing.assert_allclose([d.embedding for d in as_float.data], expected, atol=1e-5)  # onnx fp32 too
    status, body = tiny_server.call(
        "POST",
        "/v1/embeddings",
        {"model": "tiny", "input": TEXTS, "dimensions": 16, "layer": 2, "encoding_format": "base64"},
    )
    assert status == 200
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]])
    np.testing.assert_allclose(decoded, expected, atol=atol)
    by_client = client.embeddings.create(
        model="tiny", input=TEXTS, dimensions=16, encoding_format="base64", extra_body={"layer": 2}
    )
    # Asked for base64 explicitly, the client hands the strings over as they came.
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in by_client.data])
    np.testing.assert_allclose(decoded, expected, atol=atol)
    # Left to itself, the client asks for base64 and decodes it.
    default = client.embeddings.create(model="tiny", input=TEXTS, dimensions=16, extra_body={"layer": 2})
    np.testing.assert_allclose([d.embedding for d in default.data], expected, atol=atol)


def test_a_single_string_and_the_full_cell_by_default(tiny_server, tiny_local):
    response = tiny_server.client().embeddings.create(model="tiny", input="A man is playing a guitar.")
    assert len(response.data) == 1 and response.model == "tiny"
    expected = tiny_local.encode(["A man is playing a guitar."], normalize=True)[0]  # layer 4, dim 32
    np.testing.assert_allclose(response.data[0].embedding, expected, atol=1e-5)


def test_concurrent_requests_at_different_cells_each_get_their_own(tiny_server, tiny_local):
    cells = [(layer, dim) for layer in (1, 2, 3, 4) for dim in (8, 32)] * 3

    def ask(cell):
        layer, dim = cell
        texts = TEXTS[layer % 3 :]
        status, body = tiny_server.call(
            "POST", "/v1/embeddings", {"model": "tiny", "input": texts, "dimensions": dim, "layer": layer}
        )
        assert status == 200, body
        return texts, cell, np.array([d["embedding"] for d in body["data"]])

    with ThreadPoolExecutor(8) as pool:
        for texts, (layer, dim), got in pool.map(ask, cells):
            np.testing.assert_allclose(got, tiny_local.encode(texts, layer=layer, dim=dim, normalize=True), atol=1e-5)


def test_models_and_health(tiny_server):
    status, body = tiny_server.call("GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    model, *cells = body["data"]
    assert model["id"] == "tiny" and model["layers"] == [1, 2, 3, 4] and model["dimensions"] == 32
    assert (model["default_layer"], model["default_dimensions"]) == (4, 32)
    # Per-cell names: every layer at the nested widths 8, 16, 32.
    assert [c["id"] for c in cells] == [f"tiny@{n}x{d}" for n in (1, 2, 3, 4) for d in (8, 16, 32)]
    assert all(c["parent"] == "tiny" and c["id"] == f"tiny@{c['layer']}x{c['dimensions']}" for c in cells)
    assert [m.id for m in tiny_server.client().models.list()] == ["tiny"] + [c["id"] for c in cells]
    assert tiny_server.call("GET", "/v1/models/tiny")[1]["id"] == "tiny"
    # Any cell in range has a name, listed or not.
    assert tiny_server.call("GET", "/v1/models/tiny@3x20")[1] == {
        **cells[0],
        "id": "tiny@3x20",
        "layer": 3,
        "dimensions": 20,
    }
    assert tiny_server.call("GET", "/health") == (200, {"status": "ok", "model": "tiny", "queued_requests": 0})


BAD_REQUESTS = [
    ({"model": "tiny", "input": []}, 400, "input", "empty_input", "empty list"),
    ({"model": "tiny", "input": ["ok", ""]}, 400, "input", "empty_input", r"input\[1\] is empty"),
    ({"model": "tiny", "input": ["x"] * 9}, 413, "input", "too_many_inputs", "9 items; at most 8"),
    ({"model": "tiny", "input": ["word " * 600]}, 400, "input", "context_length_exceeded", "maximum input length"),
    ({"model": "tiny", "input": "x", "dimensions": 0}, 400, "dimensions", "invalid_value", r"out of range.*1\.\.32"),
    ({"model": "tiny", "input": "x", "dimensions": 33}, 400, "dimensions", "invalid_value", "out of range"),
    ({"model": "tiny", "input": "x", "dimensions": "8"}, 400, "dimensions", "invalid_type", "must be an integer"),
    ({"model": "tiny", "input": "x", "layer": 0}, 400, "layer", "invalid_value", r"4 layers.*1\.\.4"),
    ({"model": "tiny", "input": "x", "layer": 5}, 400, "layer", "invalid_value", "out of range"),
    ({"model": "tiny", "input": "x", "layer": 2.5}, 400, "layer", "invalid_type", "must be an integer"),
    ({"model": "tiny", "input": "x", "layer": True}, 400, "layer", "invalid_type", "must be an integer"),
    ({"model": "tiny", "input": 5}, 400, "input", "invalid_type", "string or a list of strings"),
    ({"model": "tiny", "input": [[1, 2, 3]]}, 400, "input", "invalid_type", "token ids are not supported"),
    ({"model": "tiny", "input": [101, 2023]}, 400, "input", "invalid_type", "check_embedding_ctx_length=False"),
    ({"model": "tiny", "input": ["a", None]}, 400, "input", "invalid_type", r"input\[1\] must be a string"),
    ({"model": "tiny", "input": "x", "encoding_format": "hex"}, 400, "encoding_format", "invalid_value", "float"),
    ({"input": "x"}, 400, "model", "missing_required_parameter", "'model' is required"),
    ({"model": "tiny"}, 400, "input", "missing_required_parameter", "'input' is required"),
    ({"model": 3, "input": "x"}, 400, "model", "invalid_type", "must be a string"),
    ({"model": "gpt-4", "input": "x"}, 404, "model", "model_not_found", "'gpt-4' does not exist"),
    ({"model": "tiny@5x16", "input": "x"}, 404, "model", "model_not_found", r"no such cell.*layer 1\.\.4"),
    ({"model": "tiny@2x33", "input": "x"}, 404, "model", "model_not_found", r"dimensions 1\.\.32"),
    ({"model": "tiny@2", "input": "x"}, 404, "model", "model_not_found", r"tiny@<layer>x<dimensions>"),
    ({"model": "tiny@" + "9" * 5000 + "x16", "input": "x"}, 404, "model", "model_not_found", "no such cell"),
    ({"model": "tiny", "input": ["ok", "a\ud800b"]}, 400, "input", "invalid_value", r"input\[1\].*surrogate"),
    ({"model": "other@2x16", "input": "x"}, 404, "model", "model_not_found", "'other@2x16' does not exist"),
    ({"model": "tiny@2x16", "input": "x", "layer": 3}, 400, "layer", "invalid_value", "names layer 2.*is 3"),
    ({"model": "tiny@2x16", "input": "x", "dimensions": 8}, 400, "dimensions", "invalid_value", "names dimensions"),
    ({"model": "tiny", "input": "x", "embedding_type": "int4"}, 400, "embedding_type", "invalid_value", "ubinary"),
    ({"model": "tiny", "input": "x", "embedding_type": ["int8"]}, 400, "embedding_type", "invalid_value", "int8"),
    ({"model": "tiny", "input": "x", "top_k": 3}, 400, "top_k", "unknown_parameter", "Unknown field"),
    (["not", "an", "object"], 400, None, "invalid_type", "JSON object"),
]


@pytest.mark.parametrize(("body", "status", "param", "code", "message"), BAD_REQUESTS)
def test_errors_have_openai_shape(any_server, body, status, param, code, message):
    got_status, got = any_server.call("POST", "/v1/embeddings", body)
    assert got_status == status
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert (got["error"]["param"], got["error"]["code"]) == (param, code)
    assert got["error"]["type"] == "invalid_request_error"
    assert re.search(message, got["error"]["message"]), got["error"]["message"]


def test_a_cell_name_is_its_layer_and_dimensions_byte_for_byte(tiny_server):
    for encoding in ("float", "base64"):
        for embedding_type in ("float", "ubinary"):
            fields = {"input": TEXTS, "encoding_format": encoding, "embedding_type": embedding_type}
            by_name = tiny_server.call_bytes("POST", "/v1/embeddings", {"model": "tiny@2x16", **fields})
            by_fields = tiny_server.call_bytes(
                "POST", "/v1/embeddings", {"model": "tiny", "layer": 2, "dimensions": 16, **fields}
            )
            assert by_name[0] == 200 and by_name == by_fields
    # Naming the same cell twice is no conflict.
    both = tiny_server.call_bytes("POST", "/v1/embeddings", {"model": "tiny@2x16", "layer": 2, "input": TEXTS})
    assert both == tiny_server.call_bytes("POST", "/v1/embeddings", {"model": "tiny@2x16", "input": TEXTS})
    # The official client can only send the name.
    response = tiny_server.client().embeddings.create(model="tiny@2x16", input=TEXTS, encoding_format="float")
    assert len(response.data[0].embedding) == 16 and response.model == "tiny"


def test_embedding_types_quantise_the_unit_vectors_of_the_cell(tiny_server, tiny_local):
    from sentence_transformers.util.quantization import quantize_embeddings

    expected = tiny_local.encode(TEXTS, layer=3, dim=20, normalize=True)
    bounds = np.array([[-1.0] * 20, [1.0] * 20], dtype=np.float32)
    for kind, dtype, width in (("int8", "i1", 20), ("uint8", "u1", 20), ("binary", "i1", 3), ("ubinary", "u1", 3)):
        ask = {"model": "tiny", "input": TEXTS, "layer": 3, "dimensions": 20, "embedding_type": kind}
        status, as_numbers = tiny_server.call("POST", "/v1/embeddings", ask)
        assert status == 200 and as_numbers["embedding_type"] == kind
        got = np.array([d["embedding"] for d in as_numbers["data"]])
        assert got.shape == (len(TEXTS), width)  # `dimensions` first, then the quantisation
        want = quantize_embeddings(expected, precision=kind, ranges=bounds).astype(int)
        # The float path agrees with encode() to 1e-5, so an int8 code may sit one step off at a bucket's edge.
        assert np.abs(got - want).max() <= (0 if kind.endswith("binary") else 1)
        _, as_bytes = tiny_server.call("POST", "/v1/embeddings", {**ask, "encoding_format": "base64"})
        decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=dtype) for d in as_bytes["data"]])
        np.testing.assert_array_equal(decoded, got)
    # int8 over [-1, 1] keeps the cosine ranking of unit vectors.
    _, body = tiny_server.call("POST", "/v1/embeddings", {**ask, "embedding_type": "int8"})
    codes = np.array([d["embedding"] for d in body["data"]], dtype=np.float32) + 128.5
    np.testing.assert_allclose(codes * (2 / 255) - 1, expected, atol=2 / 255)


def test_default_cell_of_the_server(minilm, minilm_server):
    """The server started with --default-layer 2 --default-dimensions 16 (minilm_server, shared)."""
    server = minilm_server
    status, body = server.call("POST", "/v1/embeddings", {"model": "minilm-l6", "input": TEXTS})
    assert status == 200 and (body["layer"], body["dimensions"]) == (2, 16)
    expected = minilm.encode(TEXTS, layer=2, dim=16, normalize=True)
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], expected, atol=1e-5)
    # A request's own fields, or a cell name, win over the defaults.
    _, body = server.call("POST", "/v1/embeddings", {"model": "minilm-l6", "input": TEXTS, "layer": 4})
    assert (body["layer"], body["dimensions"]) == (4, 16)
    _, body = server.call("POST", "/v1/embeddings", {"model": "minilm-l6@3x8", "input": TEXTS})
    assert (body["layer"], body["dimensions"]) == (3, 8)
    assert server.call("GET", "/v1/models/minilm-l6")[1]["default_layer"] == 2


def test_transport_errors(any_server):
    tiny_server = any_server
    status, body = tiny_server.call("POST", "/v1/embeddings", raw=b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = tiny_server.call(
        "POST", "/v1/embeddings", raw=json.dumps({"model": "tiny", "input": "x" * 30000}).encode()
    )
    assert status == 413 and body["error"]["code"] == "request_too_large" and "20000" in body["error"]["message"]
    status, body = tiny_server.call("GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = tiny_server.call("GET", "/v1/embeddings")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body = tiny_server.call("GET", "/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_the_openai_client_raises_its_own_errors(any_server):
    client = any_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", input=["x"], dimensions=64)
    assert info.value.status_code == 400 and info.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input=["x"])


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-batch", "0", "must be at least 1, got 0"),
        ("--max-queued-texts", "-3", "must be at least 1, got -3"),
        ("--max-wait-ms", "nan", "must be a finite number, got 'nan'"),  # started the server before
        ("--max-wait-ms", "-1", "must be at least 0, got -1"),
        ("--port", "99999", "must be 0..65535 (0: any free port), got 99999"),
        ("--default-dimensions", "1e3", "'1e3' is not a whole number"),
        ("--min-layer", "-1", "must be at least 0, got -1"),
    ],
)
def test_serve_refuses_bad_limits_where_they_are_parsed(option, value, message, capsys):
    from matryoshka2d.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--model", "minilm-l6", option, value])
    assert stopped.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err


# ---- the onnx backend: what differs from torch -----------------------------------------------------------


def test_onnx_server_serves_its_layers_only_and_says_what_it_runs(onnx_server, tiny_local):
    status, body = onnx_server.call("GET", "/v1/models/tiny")
    assert status == 200 and body["layers"] == [2] and body["backend"] == "onnx" and body["precision"] == "fp32"
    status, body = onnx_server.call("POST", "/v1/embeddings", {"model": "tiny", "input": "x", "layer": 1})
    assert status == 400 and (body["error"]["param"], body["error"]["code"]) == ("layer", "invalid_value")
    assert "layers 2 only" in body["error"]["message"]
    status, body = onnx_server.call("POST", "/v1/embeddings", {"model": "tiny", "input": TEXTS})  # no layer: 2
    got = np.array([d["embedding"] for d in body["data"]])
    np.testing.assert_allclose(got, tiny_local.encode(TEXTS, layer=2, normalize=True), atol=1e-5)


class CountedExport:
    """Stands in for the export: copies the graph built once by the fixture (a real export takes seconds) and
    counts the calls, so a test sees whether the cache was used or rebuilt."""

    def __init__(self, graphs):
        (self.source,) = graphs.glob("weights-*/layer-2.onnx")
        self.calls = 0

    def __call__(self, encoder, layer, path):
        assert layer == 2
        self.calls += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.source, path)
        return path


@pytest.fixture
def graph_copy(onnx_graphs, tmp_path, monkeypatch):
    """A copy of the cache: the folder of the tiny model's graphs in it (named by its weights), the counted export."""
    shutil.copytree(onnx_graphs, tmp_path / "graphs")
    export = CountedExport(onnx_graphs)
    monkeypatch.setattr("matryoshka2d.deploy.backends.export_exit", export)
    (folder,) = (tmp_path / "graphs").glob("weights-*")
    return folder, export


def onnx_backend(tiny_local, folder, quantize=None):
    """A backend on the cache that holds `folder`, the folder of the model's graphs."""
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
    assert backend.describe()["session_mb"].keys() == {"2"}  # measured when the session loaded


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
    from matryoshka2d.deploy import backends

    folder, _ = graph_copy
    onnx_backend(tiny_local, folder, quantize="int8")
    quantized, quantize = [], backends.quantize_int8
    monkeypatch.setattr(backends, "quantize_int8", lambda *a: quantized.append(a) or quantize(*a))
    onnx_backend(tiny_local, folder, quantize="int8")
    assert quantized == []  # cached and trusted
    manifest = json.loads((folder / "manifest.json").read_text())
    old_fp32 = "torch.onnx dynamo export of ExitGraph (encoder.forward at the layer), fp32"
    manifest["graphs"]["layer-2.int8.onnx"]["recipe"] = backends.RECIPES["int8"].replace(backends.FP32_RECIPE, old_fp32)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    onnx_backend(tiny_local, folder, quantize="int8")
    assert len(quantized) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quantize", "int8"], "--quantize apply to --backend onnx"),
        (["--layers", "1,3"], "--layers apply to --backend onnx"),
        (["--backend", "onnx", "--layers", "1,x"], "--layers must be comma-separated layer numbers"),
        (["--backend", "onnx", "--layers", "0"], "--layers must be layer numbers of at least 1"),
        (["--backend", "onnx", "--device", "cuda"], "--backend onnx runs on the CPU"),
    ],
)
def test_serve_refuses_backend_flags_that_do_not_fit(capsys, flags, message):
    from matryoshka2d.cli import main

    assert main(["serve", "--model", "minilm-l6", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_layers_the_model_does_not_have(capsys, tiny_folder):
    from matryoshka2d.cli import main

    assert main(["serve", "--model", str(tiny_folder), "--backend", "onnx", "--layers", "2,5"]) == 2
    assert "--layers: 5 is out of range" in capsys.readouterr().err


def test_graphs_are_cached_beside_a_model_folder_and_apart_from_an_installed_one(
    tiny_local, minilm, tmp_path, monkeypatch
):
    from matryoshka2d.deploy.backends import default_cache_folder

    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path))
    assert default_cache_folder(tiny_local, "ab" * 32) == Path(tiny_local.location) / "onnx-serve"
    assert default_cache_folder(minilm, "cd" * 32) == tmp_path / "onnx-serve" / f"minilm-l6-{'cd' * 6}"


def test_serve_refuses_a_default_cell_out_of_range(capsys, tiny_folder):
    from matryoshka2d.cli import main

    assert main(["serve", "--model", str(tiny_folder), "--device", "cpu", "--default-layer", "5"]) == 2
    assert "--default-layer 5: layer 5 is out of range" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_folder), "--device", "cpu", "--default-dimensions", "64"]) == 2
    assert "--default-dimensions 64: dim 64 is out of range" in capsys.readouterr().err


def test_a_request_is_tokenized_once_and_long_texts_are_cut_as_encode_cuts_them(tiny_folder, tiny_local):
    """The endpoint counts tokens with the tokenizer and hands those ids to the model: the backend's own tokenizer
    is never called (it was, a second time, for every text); with --truncate a long text's ids are cut as the
    tokenizer cuts them, so the vectors equal encode's."""
    from fastapi.testclient import TestClient

    from matryoshka2d.deploy.server import ServerLimits, create_app

    model = ElasticEncoder(str(tiny_folder), device="cpu")
    app = create_app(model, "tiny", ServerLimits(truncate=True))
    real, calls = model.tokenizer, []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *args, **kwargs):
            calls.append(args)
            return real(*args, **kwargs)

    model.tokenizer = Spy()
    texts = ["a cat sat", "the dog ran far away", "a cat sat", "word " * 3000]
    with TestClient(app) as client:
        reply = client.post("/v1/embeddings", json={"model": "tiny", "input": texts, "layer": 2, "dimensions": 16})
    assert reply.status_code == 200 and calls == []
    body = reply.json()
    assert body["truncated_inputs"] == 1 and body["usage"]["prompt_tokens"] > model.max_length
    got = np.array([row["embedding"] for row in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, tiny_local.encode(texts, layer=2, dim=16, normalize=True), atol=1e-5)


def test_pooled_states_from_given_token_ids_equal_its_own(tiny_local):
    texts = ["a cat sat", "the dog ran", "a cat sat", "word " * 3000]
    encoded = dict(tiny_local.tokenizer(texts, truncation=True, max_length=tiny_local.max_length))
    given = tiny_local.pooled_states(texts, [1, 2], encoded=encoded)
    own = tiny_local.pooled_states(texts, [1, 2])
    for n in (1, 2):
        np.testing.assert_array_equal(given[n], own[n])
    with pytest.raises(ValueError, match="encoded holds 4 rows for 3 texts"):
        tiny_local.pooled_states(texts[:3], [1], encoded=encoded)


@contextlib.asynccontextmanager
async def started(batcher):
    """A MicroBatcher running for the block, stopped after it."""
    batcher.start()
    try:
        yield batcher
    finally:
        await batcher.stop()


class ReleasingBackend:
    """A model backend that answers each text with its layer and counts how often its memory was released."""

    def __init__(self):
        self.released = 0

    def pooled(self, texts, layer, encoded=None):
        return np.full((len(texts), 4), layer, dtype=np.float32)

    def release_memory(self):
        self.released += 1


def test_the_heap_is_trimmed_when_the_queue_runs_dry_not_after_every_batch(monkeypatch):
    """malloc_trim after every batch cost 6% of a small cell's model time; under load it runs at most every
    TRIM_INTERVAL seconds, and once the queue is empty, so memory at rest is given back all the same."""
    import asyncio

    from matryoshka2d.deploy import micro_batching

    trims = []
    monkeypatch.setattr(micro_batching, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(micro_batching, "REST_AFTER", 0.05)
    backend = ReleasingBackend()

    async def load():
        async with started(micro_batching.MicroBatcher(backend, max_batch=4, max_wait=0.0)) as batcher:
            replies = await asyncio.gather(*(batcher.encode([f"text {i}"], 2) for i in range(40)))
            await asyncio.sleep(0.2)  # the queue is dry: one trim
            return batcher.batches, batcher.trims, replies

    batches, count, replies = asyncio.run(load())
    assert batches >= 10 and all(r.shape == (1, 4) and r[0, 0] == 2 for r in replies)
    assert count == len(trims) == 1 and backend.released == 1  # at rest the backend's arenas go back too


def test_a_closed_loop_of_clients_is_not_rest_between_batches(monkeypatch):
    """Clients that each wait for their reply before sending again leave the queue empty between every two
    batches. That is load, not rest: the backend's arenas are released once the queue stays empty for
    REST_AFTER seconds, not after each batch."""
    import asyncio

    from matryoshka2d.deploy import micro_batching

    monkeypatch.setattr(micro_batching, "trim_heap", lambda: None)
    monkeypatch.setattr(micro_batching, "REST_AFTER", 0.2)
    backend = ReleasingBackend()

    async def closed_loop():
        async with started(micro_batching.MicroBatcher(backend, max_batch=8, max_wait=0.0)) as batcher:

            async def client(i):
                for round_ in range(10):
                    (reply,) = await batcher.encode([f"client {i} round {round_}"], 3)
                    assert reply[0] == 3

            await asyncio.gather(*(client(i) for i in range(4)))
            busy = batcher.batches, backend.released
            await asyncio.sleep(0.5)  # now the queue stays empty: rest
            return busy, backend.released

    (batches, released_under_load), released_at_rest = asyncio.run(closed_loop())
    assert batches >= 10 and released_under_load == 0
    assert released_at_rest == 1


def test_response_numbers_read_back_as_the_float32_vectors_exactly():
    from matryoshka2d.deploy.api import encode_rows, reply_bytes
    from matryoshka2d.views import unit_rows

    vectors = np.random.default_rng(0).standard_normal((5, 48)).astype(np.float32)
    body = json.loads(reply_bytes({"data": encode_rows(vectors, "float", "float")}))
    read = np.array([row["embedding"] for row in body["data"]], dtype=np.float32)
    assert np.array_equal(read, unit_rows(vectors).astype(np.float32))  # shortest float32 decimals, exact
    assert [row["index"] for row in body["data"]] == list(range(5))
    as_int8 = json.loads(reply_bytes({"data": encode_rows(vectors, "float", "int8")}))["data"][0]["embedding"]
    assert all(isinstance(x, int) and -128 <= x <= 127 for x in as_int8)
    packed = json.loads(reply_bytes({"data": encode_rows(vectors, "base64", "float")}))["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), "<f4"), read[0])
    vectors[2, 3] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        encode_rows(vectors, "float", "float")


def test_a_lone_request_never_waits_for_company_but_queued_ones_are_batched():
    """Issue 32, case 18: the micro-batch wait doubled a lone request's latency. With a wait of an hour, a lone
    request is still answered (nothing else is queued); requests already queued are batched together."""
    import asyncio

    from matryoshka2d.deploy import micro_batching

    backend = ReleasingBackend()

    async def run():
        async with started(micro_batching.MicroBatcher(backend, max_batch=64, max_wait=3600.0)) as batcher:
            (alone,) = await asyncio.wait_for(batcher.encode(["just me"], 1), timeout=30)
            before = batcher.batches
            together = await asyncio.wait_for(
                asyncio.gather(*(batcher.encode([f"t{i}"], 1) for i in range(64))), timeout=30
            )  # 64 texts fill the batch: the wait ends with a full batch, not the hour
            return alone, batcher.batches - before, together

    alone, batches, together = asyncio.run(run())
    assert alone[0] == 1 and len(together) == 64 and batches <= 2


def test_by_default_a_batch_takes_what_queued_and_waits_for_no_more():
    """A wait for company left the model idle with work in hand (full depth's p99 at 82 queries a second on one
    core: 99.8 ms with a 5 ms wait, 37.4 without; 2026-11-26). The server's, the command's and the batcher's
    default agree, and with it the requests queued behind a busy call go together the moment it ends, though the
    batch (256 texts) is far from full."""
    import asyncio
    import threading

    from matryoshka2d.cli import build_parser
    from matryoshka2d.deploy import micro_batching
    from matryoshka2d.deploy.server import ServerLimits

    limits = ServerLimits()
    serve_args = build_parser().parse_args(["serve", "--model", "m"])
    assert serve_args.max_wait_ms / 1000 == limits.max_wait == micro_batching.DEFAULT_MAX_WAIT

    class Gated(ReleasingBackend):
        """Each call waits until the test lets it go, and says when it has started and with which texts."""

        def __init__(self):
            super().__init__()
            self.calls, self.started, self.go = [], threading.Semaphore(0), threading.Semaphore(0)

        def pooled(self, texts, layer, encoded=None):
            self.calls.append(list(texts))
            self.started.release()
            self.go.acquire(timeout=30)
            return super().pooled(texts, layer, encoded)

    backend = Gated()

    async def run():
        loop = asyncio.get_running_loop()
        async with started(micro_batching.MicroBatcher(backend, limits.max_batch, limits.max_wait)) as batcher:
            first = asyncio.ensure_future(batcher.encode(["busy"], 1))
            await loop.run_in_executor(None, backend.started.acquire)  # the model is busy with "busy"
            queued = [asyncio.ensure_future(batcher.encode([t], 1)) for t in ("a", "b")]
            await asyncio.sleep(0)
            backend.go.release()  # "busy" ends: a and b go at once, together
            await asyncio.wait_for(loop.run_in_executor(None, backend.started.acquire), timeout=30)
            backend.go.release()
            await asyncio.wait_for(asyncio.gather(first, *queued), timeout=30)

    asyncio.run(run())
    assert backend.calls == [["busy"], ["a", "b"]]


def test_the_onnx_backend_needs_the_api_key_on_every_route_but_health(tiny_folder, onnx_graphs):
    """The key is checked in front of every route (deploy/admission.Guard), whatever runs the model."""
    from fastapi.testclient import TestClient

    from matryoshka2d.deploy.admission import Admission
    from matryoshka2d.deploy.server import create_app

    backend = OnnxBackend(
        ElasticEncoder(str(tiny_folder), device="cpu"), layers=[2], cache_folder=onnx_graphs, log=lambda _: None
    )
    with TestClient(create_app(backend, "tiny", admission=Admission("k3y"))) as client:
        assert client.get("/health").status_code == 200
        body = {"model": "tiny", "input": "red cat"}
        for path in ("/v1/models", "/metrics"):
            assert client.get(path).status_code == 401
        assert client.post("/v1/embeddings", json=body).status_code == 401
        reply = client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer k3y"})
        assert reply.status_code == 200 and reply.json()["layer"] == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_model_runs_below_the_event_loop():
    """Under overload the event loop must get the core to read requests and refuse what is over the bound (429),
    not leave them unread in the socket backlog while the model holds the core: the model thread's nice value is
    the process's plus MODEL_THREAD_NICENESS, the event loop's is untouched."""
    import asyncio
    import threading

    from matryoshka2d.deploy import micro_batching

    class NiceBackend(ReleasingBackend):
        def pooled(self, texts, layer, encoded=None):
            thread = threading.get_native_id()
            self.nice = os.getpriority(os.PRIO_PROCESS, thread)
            return super().pooled(texts, layer, encoded)

    backend = NiceBackend()

    async def run():
        async with started(micro_batching.MicroBatcher(backend, max_batch=8, max_wait=0.0)) as batcher:
            await asyncio.wait_for(batcher.encode(["a"], 1), timeout=30)
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    loop_nice = asyncio.run(run())
    assert loop_nice == os.getpriority(os.PRIO_PROCESS, 0)
    assert backend.nice == min(19, loop_nice + micro_batching.MODEL_THREAD_NICENESS)


def test_the_drain_rate_counts_the_event_loops_time_between_calls():
    """ms_per_text (Retry-After, --max-queue-ms) is the wall time per text at which the queue drains: with the model
    taking 10 ms a call and the event loop busy 30 ms between calls, about 40 ms a text, not the model's 10."""
    import asyncio

    from matryoshka2d.deploy import micro_batching

    class Slow(ReleasingBackend):
        def pooled(self, texts, layer, encoded=None):
            time.sleep(0.01)
            return super().pooled(texts, layer, encoded)

    async def run():
        async with started(micro_batching.MicroBatcher(Slow(), max_batch=1, max_wait=0.0)) as batcher:

            async def busy_loop():  # the event loop's own work (reading, refusing requests) between model calls
                while True:
                    await asyncio.sleep(0)
                    time.sleep(0.03)

            hog = asyncio.create_task(busy_loop())
            await asyncio.gather(*(batcher.encode([f"t{i}"], 1) for i in range(12)))
            hog.cancel()
            return batcher.ms_per_text

    assert asyncio.run(run()) >= 25
