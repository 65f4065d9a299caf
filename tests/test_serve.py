"""The OpenAI-compatible server, run as a real uvicorn process on 127.0.0.1 and called over HTTP."""

import base64
import json
import os
import re
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
                time.sleep(0.2)
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
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

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
def tiny_local(tiny_folder):
    return ElasticEncoder(str(tiny_folder), device="cpu")


def test_openai_client_gets_the_cell_of_minilm():
    server = Server("minilm-l6", "minilm-l6", "--truncate")
    try:
        client = server.client()
        response = client.embeddings.create(model="minilm-l6", input=TEXTS, dimensions=64, extra_body={"layer": 3})
        got = np.array([d.embedding for d in response.data], dtype=np.float32)
        expected = ElasticEncoder("minilm-l6", device="cpu").encode(TEXTS, layer=3, dim=64, normalize=True)
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
        # --truncate: a text over 256 tokens is cut, and the answer says so.
        status, body = server.call("POST", "/v1/embeddings", {"model": "minilm-l6", "input": ["word " * 400]})
        assert status == 200 and body["usage"]["prompt_tokens"] == 256 and body["truncated_inputs"] == 1
    finally:
        server.stop()


def test_float_and_base64_match_encode(tiny_server, tiny_local):
    expected = tiny_local.encode(TEXTS, layer=2, dim=16, normalize=True)
    client = tiny_server.client()
    as_float = client.embeddings.create(
        model="tiny", input=TEXTS, dimensions=16, encoding_format="float", extra_body={"layer": 2}
    )
    np.testing.assert_allclose([d.embedding for d in as_float.data], expected, atol=1e-5)
    status, body = tiny_server.call(
        "POST",
        "/v1/embeddings",
        {"model": "tiny", "input": TEXTS, "dimensions": 16, "layer": 2, "encoding_format": "base64"},
    )
    assert status == 200
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]])
    np.testing.assert_allclose(decoded, expected, atol=1e-6)
    by_client = client.embeddings.create(
        model="tiny", input=TEXTS, dimensions=16, encoding_format="base64", extra_body={"layer": 2}
    )
    # Asked for base64 explicitly, the client hands the strings over as they came.
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in by_client.data])
    np.testing.assert_allclose(decoded, expected, atol=1e-6)
    # Left to itself, the client asks for base64 and decodes it.
    default = client.embeddings.create(model="tiny", input=TEXTS, dimensions=16, extra_body={"layer": 2})
    np.testing.assert_allclose([d.embedding for d in default.data], expected, atol=1e-6)


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
    (model,) = body["data"]
    assert model["id"] == "tiny" and model["layers"] == [1, 2, 3, 4] and model["dimensions"] == 32
    assert [m.id for m in tiny_server.client().models.list()] == ["tiny"]
    assert tiny_server.call("GET", "/v1/models/tiny")[1]["id"] == "tiny"
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
    ({"model": "tiny", "input": [[1, 2, 3]]}, 400, "input", "invalid_type", "token arrays are not supported"),
    ({"model": "tiny", "input": ["a", None]}, 400, "input", "invalid_type", r"input\[1\] must be a string"),
    ({"model": "tiny", "input": "x", "encoding_format": "hex"}, 400, "encoding_format", "invalid_value", "float"),
    ({"input": "x"}, 400, "model", "missing_required_parameter", "'model' is required"),
    ({"model": "tiny"}, 400, "input", "missing_required_parameter", "'input' is required"),
    ({"model": 3, "input": "x"}, 400, "model", "invalid_type", "must be a string"),
    ({"model": "gpt-4", "input": "x"}, 404, "model", "model_not_found", "'gpt-4' does not exist"),
    ({"model": "tiny", "input": "x", "top_k": 3}, 400, "top_k", "unknown_parameter", "Unknown field"),
    (["not", "an", "object"], 400, None, "invalid_type", "JSON object"),
]


@pytest.mark.parametrize(("body", "status", "param", "code", "message"), BAD_REQUESTS)
def test_errors_have_openai_shape(tiny_server, body, status, param, code, message):
    got_status, got = tiny_server.call("POST", "/v1/embeddings", body)
    assert got_status == status
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert (got["error"]["param"], got["error"]["code"]) == (param, code)
    assert got["error"]["type"] == "invalid_request_error"
    assert re.search(message, got["error"]["message"]), got["error"]["message"]


def test_transport_errors(tiny_server):
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


def test_the_openai_client_raises_its_own_errors(tiny_server):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", input=["x"], dimensions=64)
    assert info.value.status_code == 400 and info.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input=["x"])


def test_serve_refuses_bad_limits(capsys):
    from matryoshka2d.cli import main

    assert main(["serve", "--model", "minilm-l6", "--max-batch", "0"]) == 2
    assert "--max-batch must be at least 1, got 0" in capsys.readouterr().err
