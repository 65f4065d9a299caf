"""What a server serves is what it lists (issue 61, item 3), and how a request resolves to an encoder, a layer and
a width: `serve --layers` (torch and onnx), /v1/models without a path of the machine, one 404 `model_not_found`
for a cell or model not served, the served name, queries and documents (input_type) with a query encoder, a query
cell or a pair folder, and the server's default width for routed requests. In-process (build_app + TestClient)."""

import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from helpers.models import TINY, tiny_transformer
from helpers.server import InProcess, app_of, onnx_graphs_of
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve import ServerConfig, build_app

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["red cat sleeps", "blue dog", "A man is playing a guitar."]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_bert):
    return tiny_bert.save(tmp_path_factory.mktemp("models") / "tiny-served")


@pytest.fixture(scope="module")
def plain(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="plain")


def absolute_paths(text: str) -> list[str]:
    """Every string of the JSON text that looks like an absolute path of this machine."""
    return [s for s in re.findall(r'"([^"]*)"', text) if s.startswith("/") and "/" in s[1:]]


def test_a_server_of_two_layers_answers_them_alone_and_lists_them_alone(tiny_folder):
    """Issue 59's acceptance: build_app(ServerConfig(model=T, layers=[2, 4])) in-process: layer 2 equals encode's,
    layer 3 is a 404 model_not_found, /v1/models names layers 2 and 4 only and no path of the machine."""
    app = build_app(ServerConfig(model=str(tiny_folder), layers=[2, 4]))
    with TestClient(app) as client:
        reply = client.post("/v1/embeddings", json={"model": "tiny-served", "input": TEXTS, "layer": 2})
        assert reply.status_code == 200, reply.text
        got = np.array([d["embedding"] for d in reply.json()["data"]], dtype=np.float32)
        expected = ElasticEncoder(str(tiny_folder)).encode(TEXTS, layer=2, normalize=True)
        np.testing.assert_allclose(got, expected, atol=1e-5)
        for body in ({"model": "tiny-served", "layer": 3}, {"model": "tiny-served@3x16"}):
            refused = client.post("/v1/embeddings", json={**body, "input": TEXTS})
            error = refused.json()["error"]
            assert refused.status_code == 404 and error["code"] == "model_not_found", refused.text
            assert "not served here" in error["message"] and "layers 2, 4" in error["message"]
        listed = client.get("/v1/models")
        data = listed.json()["data"]
        assert data[0]["id"] == "tiny-served" and data[0]["layers"] == [2, 4]
        assert {c["layer"] for c in data[1:]} == {2, 4}
        assert [c["id"] for c in data[1:]] == [f"tiny-served@{n}x{d}" for n in (2, 4) for d in (8, 16, 32)]
        assert absolute_paths(listed.text) == [] and str(tiny_folder) not in listed.text
        assert client.post("/v1/embeddings", json={"model": "tiny-served", "input": "x"}).json()["layer"] == 4
        assert client.get("/v1/models/tiny-served@3x16").status_code == 404


def test_the_onnx_backend_lists_its_layers_alone_and_no_graph_cache_path(tiny_folder, tmp_path):
    """`serve --backend onnx --layers 2`: /v1/models said every layer's cells, and the absolute path of the graph
    cache; a request for a layer not served was a 400."""
    pytest.importorskip("onnxruntime")
    graphs = onnx_graphs_of(tiny_folder, tmp_path / "graphs")
    config = ServerConfig(
        model=str(tiny_folder), served_name="tiny", backend="onnx", layers=[2], onnx_cache=str(graphs)
    )
    tiny_local = ElasticEncoder(str(tiny_folder), device="cpu")
    with InProcess(build_app(config), backend="onnx") as onnx_server:
        status, body = onnx_server.call("GET", "/v1/models/tiny")
        assert status == 200 and body["layers"] == [2] and body["backend"] == "onnx" and body["precision"] == "fp32"
        status, body = onnx_server.call("POST", "/v1/embeddings", {"model": "tiny", "input": "x", "layer": 1})
        assert status == 404 and (body["error"]["param"], body["error"]["code"]) == ("layer", "model_not_found")
        assert "layers 2 of the model's layer 1..4" in body["error"]["message"]
        status, body = onnx_server.call("POST", "/v1/embeddings", {"model": "tiny", "input": TEXTS})  # no layer: 2
        got = np.array([d["embedding"] for d in body["data"]])
        np.testing.assert_allclose(got, tiny_local.encode(TEXTS, layer=2, normalize=True), atol=1e-5)
        listed = onnx_server.http.get("/v1/models").text
        assert [c["id"] for c in json.loads(listed)["data"][1:]] == ["tiny@2x8", "tiny@2x16", "tiny@2x32"]
        assert absolute_paths(listed) == [] and str(graphs) not in listed


@pytest.mark.parametrize(
    ("model", "served_name", "name"),
    [
        ("runs/st-ese", None, "st-ese"),
        ("runs/st-ese/", None, "st-ese"),
        ("minilm-l6", None, "minilm-l6"),
        ("sentence-transformers/all-MiniLM-L6-v2", None, "all-MiniLM-L6-v2"),
        ("runs/st-ese", "ese", "ese"),
    ],
)
def test_the_served_name_is_the_model_folders_name_unless_one_is_given(model, served_name, name):
    assert ServerConfig(model=model, served_name=served_name).name == name


def test_serve_names_the_model_by_its_folder_not_the_path_typed(tiny_folder, monkeypatch):
    from matryoshka2d.serve import process

    served = []
    monkeypatch.setattr(process, "serve_app", lambda app, config: served.append(app))
    assert main(["serve", "--model", str(tiny_folder), "--port", "0"]) == 0
    with TestClient(served[0]) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-served"
        reply = client.post("/v1/embeddings", json={"model": "tiny-served", "input": "red cat"})
        assert reply.status_code == 200 and reply.json()["model"] == "tiny-served"
        assert client.post("/v1/embeddings", json={"model": str(tiny_folder), "input": "x"}).status_code == 404


# -- queries and documents in one model ----------------------------------------------------------------------------
def embed(client, **body):
    return client.post("/v1/embeddings", json={"model": "tiny", "input": ["red cat sleeps", "blue dog"], **body})


def test_input_type_routes_queries_to_the_query_encoder_and_documents_to_the_full_cell(plain, tokenizer):
    import transformers as tf

    config = tf.BertConfig(vocab_size=tokenizer.vocab_size, **{**TINY, "num_hidden_layers": 2})
    query = ElasticEncoder.from_modules(tf.AutoModel.from_config(config).eval(), tokenizer, name="q")  # a "student"
    texts = ["red cat sleeps", "blue dog"]
    with TestClient(app_of(plain)) as before, TestClient(app_of(plain, queries={"tiny-q": query})) as client:
        listed = client.get("/v1/models").json()["data"][0]["input_types"]
        assert listed["queries"] == {"encoder": "tiny-q", "layer": 2, "dimensions": 32}
        queries = embed(client, input_type="query")
        assert queries.status_code == 200 and queries.headers["x-matryoshka2d-encoder"] == "tiny-q"
        got = np.array([d["embedding"] for d in queries.json()["data"]])
        np.testing.assert_allclose(got, query.encode(texts, normalize=True), atol=1e-5)
        assert {(d["layer"], d["encoder"]) for d in queries.json()["data"]} == {(2, "tiny-q")}
        documents = embed(client, input_type="document")
        got = np.array([d["embedding"] for d in documents.json()["data"]])
        np.testing.assert_allclose(got, plain.encode(texts, normalize=True), atol=1e-5)
        assert documents.json()["data"][0]["layer"] == 4
        assert embed(client).content == embed(before).content  # no input_type: today's answer, byte for byte
        wrong = embed(client, input_type="query", layer=3)
        assert wrong.status_code == 400 and "query encoder" in wrong.json()["error"]["message"]
        assert embed(client, input_type="passage").status_code == 400


def test_a_query_cell_answers_queries_at_its_cell_and_documents_at_full_depth_and_its_width(plain):
    texts = ["red cat sleeps", "blue dog"]
    with TestClient(app_of(plain, query_cell=(2, 16))) as client:
        queries = embed(client, input_type="query").json()
        np.testing.assert_allclose(
            [d["embedding"] for d in queries["data"]], plain.encode(texts, layer=2, dim=16, normalize=True), atol=1e-5
        )
        documents = embed(client, input_type="document").json()
        np.testing.assert_allclose(
            [d["embedding"] for d in documents["data"]], plain.encode(texts, layer=4, dim=16, normalize=True), atol=1e-5
        )
        assert documents["data"][0]["layer"] == 4 and queries["data"][0]["layer"] == 2
        cell = client.post("/v1/embeddings", json={"model": "tiny@2x16", "input": "a", "input_type": "query"})
        assert cell.status_code == 400 and cell.json()["error"]["param"] == "input_type"


def test_a_query_model_may_not_take_a_name_of_the_served_model(plain):
    for name in ("tiny", "tiny@2x16"):
        with pytest.raises(ValueError, match="is a name of the served model"):
            app_of(plain, queries={name: plain})


def test_default_dimensions_apply_to_requests_with_input_type(plain, tokenizer):
    texts = ["red cat sleeps", "blue dog"]
    query = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="q")
    for options in ({"query_cell": (2, 16)}, {"queries": {"tiny-q": query}}, {}):
        with TestClient(app_of(plain, default_dimensions=8, **options)) as client:
            for body in (
                {"input_type": "query"},
                {"input_type": "document"},
                {},
                {"input_type": "document", "dimensions": 12},
            ):
                reply = client.post("/v1/embeddings", json={"model": "tiny", "input": texts, **body})
                assert reply.status_code == 200, reply.text
                width = body.get("dimensions", 8)
                assert reply.json()["dimensions"] == width and len(reply.json()["data"][0]["embedding"]) == width
            if "queries" in options:  # the query encoder by its name: the server's default width too
                reply = client.post("/v1/embeddings", json={"model": "tiny-q", "input": texts})
                assert reply.json()["dimensions"] == 8
    with TestClient(app_of(plain, default_dimensions=8, query_cell=(2, 16))) as client:
        reply = client.post("/v1/embeddings", json={"model": "tiny", "input": texts, "input_type": "document"})
    np.testing.assert_allclose(
        [d["embedding"] for d in reply.json()["data"]], plain.encode(texts, layer=4, dim=8, normalize=True), atol=1e-5
    )
    with pytest.raises(ValueError, match=r"--default-dimensions 24: .* 16 numbers \(--query-cell 2x16\)"):
        app_of(plain, default_dimensions=24, query_cell=(2, 16))


def test_a_pair_folder_is_served_as_one_model_whose_queries_take_its_query_route(tiny_dir, tmp_path, monkeypatch):
    """`serve --model PAIR` (export --query-cell / --query-model): input_type "query" runs the pair's query route,
    as sentence-transformers' encode_query does; "document" its document route, as encode_document."""
    from sentence_transformers import SentenceTransformer

    from matryoshka2d.serve import process

    pair = tmp_path / "pair"
    assert (
        main(["export", "--model", str(tiny_dir), "--pooling", "mean", "--query-cell", "2x16", "--output", str(pair)])
        == 0
    )
    served = []
    monkeypatch.setattr(process, "serve_app", lambda app, config: served.append(app))
    assert main(["serve", "--model", str(pair), "--served-name", "pair", "--port", "0"]) == 0
    (app,) = served
    assert list(app.state.engine.queries) == ["pair-query"]
    texts = ["red cat sleeps", "blue dog"]
    plain = SentenceTransformer(str(pair), device="cpu")
    with TestClient(app) as client:
        queries = client.post("/v1/embeddings", json={"model": "pair", "input": texts, "input_type": "query"}).json()
        documents = client.post("/v1/embeddings", json={"model": "pair", "input": texts, "input_type": "document"})
        unit = {"normalize_embeddings": True}  # the server's vectors are unit length, as OpenAI's
        np.testing.assert_allclose(
            [d["embedding"] for d in queries["data"]], plain.encode_query(texts, **unit), atol=1e-5
        )
        np.testing.assert_allclose(
            [d["embedding"] for d in documents.json()["data"]], plain.encode_document(texts, **unit), atol=1e-5
        )
    assert main(["serve", "--model", str(pair), "--port", "0", "--query-cell", "1x8"]) == 2
