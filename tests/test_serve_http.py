"""The server's HTTP API in OpenAI's shape, in-process through FastAPI's TestClient (the official openai client
rides on it): vectors by float and base64, cells by name, errors, transport, HEAD, headers for any served name,
the body bounded while it streams, and numbers no field holds. Each runs against the torch backend and the onnx
backend where both apply (`any_server`)."""

import base64
import json
import re
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote

import numpy as np
import pytest

from helpers.data import SENTENCES
from helpers.models import tiny_transformer
from helpers.server import InProcess, app_of, call_asgi, onnx_graphs_of
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve import ServerConfig, build_app

openai = pytest.importorskip("openai", reason="the official openai client (in the dev extra) is not installed")
pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [s for s in SENTENCES if s]
LIMITS = {"served_name": "tiny", "max_inputs": 8, "max_body_bytes": 20000}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_bert):
    return tiny_bert.save(tmp_path_factory.mktemp("tiny-served"))


@pytest.fixture(scope="module")
def tiny_local(tiny_folder):
    return ElasticEncoder(str(tiny_folder), device="cpu")


@pytest.fixture(scope="module")
def tiny_server(tiny_folder):
    """The tiny model served from its folder (torch), as `serve --model FOLDER --served-name tiny` loads it."""
    with InProcess(build_app(ServerConfig(model=str(tiny_folder), **LIMITS))) as server:
        yield server


@pytest.fixture(scope="module")
def onnx_server(tiny_folder, tmp_path_factory):
    """The same on onnxruntime, layer 2 only (`--backend onnx --layers 2`)."""
    pytest.importorskip("onnxruntime")
    graphs = onnx_graphs_of(tiny_folder, tmp_path_factory.mktemp("graphs"))
    config = ServerConfig(model=str(tiny_folder), backend="onnx", layers=[2], onnx_cache=str(graphs), **LIMITS)
    with InProcess(build_app(config), backend="onnx") as server:
        yield server


@pytest.fixture(params=["torch", "onnx"])
def any_server(request):
    """Each test that takes it runs against the torch backend and the onnx backend (layer 2 served)."""
    return request.getfixturevalue(f"{request.param}_server" if request.param == "onnx" else "tiny_server")


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


# -- the body, bounded while it streams ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="plain")


def test_a_chunked_body_past_the_bound_is_refused_while_it_streams_never_read_whole(plain):
    app = app_of(plain, max_body_bytes=10_000)
    endless = (b'{"model": "tiny", "input": "' if i == 0 else b"x" * 1000 for i in range(100_000))  # 100 MB
    status, headers, body, pulled = call_asgi(app, "POST", "/v1/embeddings", endless)
    error = json.loads(body)["error"]
    assert status == 413 and error["code"] == "request_too_large" and "10000" in error["message"]
    assert pulled <= 12  # reading stopped at the first chunk past 10,000 bytes
    assert headers["connection"] == "close"  # the unread rest cannot be a next request
    # a chunked body within the bound is read whole: its chunks together are the request (here one without input)
    status, _, body, pulled = call_asgi(app, "POST", "/v1/embeddings", [b'{"model": ', b'"tiny"', b"}"])
    assert status == 400 and json.loads(body)["error"]["message"] == "'input' is required" and pulled == 3


# -- headers for any name, HEAD wherever GET -----------------------------------------------------------------------
def test_a_served_name_of_any_characters_answers_with_headers_that_read_back_as_the_name(plain, tokenizer):
    from matryoshka2d.serve.protocol import header_value

    name, query_name = "modèle-日本", "requête\tq"
    query = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="q")
    with InProcess(app_of(plain, name, queries={query_name: query})) as server:
        for model, body in ((name, {}), (query_name, {}), (name, {"input_type": "query"})):
            reply = server.http.post("/v1/embeddings", json={"model": model, "input": ["red cat"], **body})
            assert reply.status_code == 200, reply.text  # every answer was a 500 (latin-1 cannot hold 日本)
            header = reply.headers["x-matryoshka2d-encoder"]
            assert header.isascii() and unquote(header) == reply.json()["model"]
        assert server.http.get("/v1/models").json()["data"][0]["id"] == name
    assert header_value("minilm-l6@3x128") == "minilm-l6@3x128"  # an ASCII name is sent as it is


KEY = "k3y-for-http"


def get_routes(app) -> list[str]:
    """Every path the app answers GET on, a model's name in place of a path parameter."""
    paths = [r.path for r in app.routes if "GET" in getattr(r, "methods", ())]
    return [p.replace("{name:path}", "tiny") for p in paths if not p.startswith(("/docs", "/redoc", "/openapi"))]


def test_every_get_route_answers_head_with_its_headers_and_no_body(plain):
    app = app_of(plain, api_key=KEY)
    key = {"Authorization": f"Bearer {KEY}"}
    routes = get_routes(app)
    assert {"/health", "/v1/models", "/v1/models/tiny", "/metrics"} <= set(routes)
    with InProcess(app) as server:
        client = server.http
        for path in routes:
            get, head = client.get(path, headers=key), client.head(path, headers=key)
            assert head.status_code == get.status_code == 200, path  # a balancer's HEAD /health was a 405
            assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
        assert client.head("/health").status_code == 200  # open without the key, as its GET
        refused = client.head("/v1/models")
        assert refused.status_code == 401 and refused.content == b""
        assert client.head("/v1/embeddings", headers=key).status_code == 405  # no GET there, no HEAD either
        app.state.admission.draining = True
        assert client.head("/health").status_code == 503  # a draining replica is down for HEAD too


# -- numbers no field holds, bodies nested past the parser: a 400, never a 500 --------------------------------------
HUGE = "9" * 5000
BODIES = {
    "dimensions": f'{{"model": "tiny", "input": "red cat", "dimensions": {HUGE}}}',
    "layer": f'{{"model": "tiny", "input": "red cat", "layer": -{HUGE}}}',
    "user": f'{{"model": "tiny", "input": "red cat", "user": {HUGE}}}',
    "input": f'{{"model": "tiny", "input": {HUGE}}}',
    "input[1]": f'{{"model": "tiny", "input": ["red cat", {HUGE}]}}',
    "encoding_format": f'{{"model": "tiny", "input": "red cat", "encoding_format": {HUGE}}}',
    "input_type": f'{{"model": "tiny", "input": "red cat", "input_type": {HUGE}}}',
    "model": f'{{"model": {HUGE}, "input": "red cat"}}',
}


@pytest.fixture(scope="module")
def plain_server(plain):
    with InProcess(app_of(plain)) as server:
        yield server


@pytest.mark.parametrize("field", list(BODIES))
def test_a_number_of_thousands_of_digits_in_any_field_is_a_400(plain_server, field):
    reply = plain_server.http.post(
        "/v1/embeddings", content=BODIES[field], headers={"Content-Type": "application/json"}
    )
    if field == "user":  # OpenAI's free-form field: taken and ignored, whatever it holds
        assert reply.status_code == 200
    else:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field.split("[")[0]
        assert "5000 digits" in reply.json()["error"]["message"]


def test_a_body_nested_past_the_parser_is_a_400(plain_server):
    raw = '{"model": "tiny", "input": ' + "[" * 100000 + "]" * 100000 + "}"
    reply = plain_server.http.post("/v1/embeddings", content=raw)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


def test_response_numbers_read_back_as_the_float32_vectors_exactly():
    from matryoshka2d.cells import unit_rows
    from matryoshka2d.serve.protocol import encode_rows, reply_bytes

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
