"""The server as a product (issue 40): the API key, /metrics, the bound on waiting work, the drain on SIGTERM,
input_type routing to a query encoder or a query cell, and adaptive depth (its ladder on a synthetic cost model: no
timing here; the ladder's own tests are tests/test_ladder.py). In-process apps through FastAPI's TestClient; real
`serve` processes where a signal or the log is what is tested."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import TINY, WORDS, tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.deploy.admission import Admission
from matryoshka2d.deploy.depth import LayerCost, aligned_layers, along_depth
from matryoshka2d.deploy.ladder import Ladder, Rung
from matryoshka2d.deploy.server import ServerLimits, create_app
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads import fit_heads

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [" ".join(WORDS[i : i + 4]) for i in range(0, len(WORDS) - 4)]
KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def aligned(tokenizer):
    """A tiny 4-layer model with closed-form exit heads: exits aligned to its last layer."""
    encoder = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="aligned")
    sentences = [" ".join(np.random.default_rng(i).choice(WORDS, 6)) for i in range(80)]
    heads, _ = fit_heads(encoder, [sentences])
    encoder.set_exit_heads(heads)
    return encoder


@pytest.fixture(scope="module")
def plain(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="plain")


class FixedCost(LayerCost):
    """A synthetic cost model: what the server observes does not move it (the tests time nothing)."""

    def observe(self, layer, tokens, ms):
        pass


def line(per_layer_ms: dict[int, tuple[float, float]], kind=LayerCost) -> LayerCost:
    """A cost model whose line per layer is exactly (fixed ms, ms per token)."""
    return kind({n: [(0.0, a), (100.0, a + 100 * b)] for n, (a, b) in per_layer_ms.items()})


def fixed_cost(per_layer_ms: dict[int, tuple[float, float]]) -> LayerCost:
    return line(per_layer_ms, FixedCost)


def ladder_of(encoder: str, layers: list[int], cost: LayerCost) -> Ladder:
    """A ladder of `encoder`'s layers, the deepest of quality 1 and each shallower one a tenth less a layer."""
    deepest = max(layers)
    return Ladder([Rung(encoder, n, 1 - 0.1 * (deepest - n), cost=cost) for n in layers], 50.0, cores=1.0)


# -- the cost model, on synthetic lines -----------------------------------------------------------------------------
SYNTHETIC = {1: (1.0, 0.02), 2: (1.0, 0.04), 3: (1.0, 0.06), 4: (1.0, 0.08)}  # ms = 1 + 0.02 x layer x tokens


def test_the_cost_line_is_the_measured_points_and_follows_what_the_server_observes():
    cost = line(SYNTHETIC)
    assert cost.predict(3, 100) == pytest.approx(7.0) and cost.predict(1, 0) == pytest.approx(1.0)
    for _ in range(200):  # the machine got twice as slow (calls at layer 3 say so): every layer follows
        cost.observe(3, 50, 2 * (1 + 0.06 * 50))
        cost.observe(3, 200, 2 * (1 + 0.06 * 200))
    assert cost.predict(3, 100) == pytest.approx(14.0, rel=0.01)
    assert cost.predict(2, 100) == pytest.approx(10.0, rel=0.01)  # a layer not chosen since is not left stale
    assert cost.describe()["speed_against_the_start"] == pytest.approx(0.5, rel=0.01)


def test_a_layer_timed_off_the_line_of_the_others_is_put_back_on_it_and_the_static_cell_keeps_its_time():
    measured = {0: 0.3, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0, 5: 7.0, 6: 7.0}  # layer 5 timed during a burst of load
    fitted = along_depth(measured)
    assert fitted[0] == 0.3
    assert [round(fitted[n], 6) for n in range(1, 7)] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert along_depth({3: 4.0, 6: 9.0}) == {3: 4.0, 6: 9.0}  # two exits: nothing to fit a line through
    assert along_depth({1: 5.0, 2: 4.0, 3: 3.0}) == {1: 5.0, 2: 4.0, 3: 3.0}  # falling with depth: kept as measured


class Gate:
    """A backend that answers each text with its layer (in every number), once its gate is open."""

    def __init__(self, tokenizer, layers=4, width=8):
        self.tokenizer, self.pooling, self.max_length = tokenizer, "mean", 128
        self.num_layers, self.hidden_size, self.layers = layers, width, list(range(1, layers + 1))
        self.open = threading.Event()
        self.calls: list[tuple[int, int]] = []

    def pooled(self, texts, layer, encoded=None):
        self.open.wait(timeout=30)
        self.calls.append((layer, len(texts)))
        return np.full((len(texts), self.hidden_size), float(layer), dtype=np.float32)

    def describe(self):
        return {"backend": "gate", "precision": "fp32"}


# -- the guards --------------------------------------------------------------------------------------------------
def test_every_route_but_health_needs_the_key_in_openai_shape(plain):
    app = create_app(plain, "tiny", admission=Admission(KEY))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/tiny", None),
            ("GET", "/metrics", None),
            ("POST", "/v1/embeddings", {"model": "tiny", "input": "red cat"}),
            ("GET", "/no/such/route", None),
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                reply = client.request(method, path, json=body, headers=headers)
                assert reply.status_code == 401, (path, headers)
                error = reply.json()["error"]
                assert error["code"] == "invalid_api_key" and KEY not in error["message"]
                assert reply.headers["www-authenticate"] == "Bearer"
        good = {"Authorization": f"Bearer {KEY}"}
        assert (
            client.post("/v1/embeddings", json={"model": "tiny", "input": "red cat"}, headers=good).status_code == 200
        )
        assert client.get("/metrics", headers=good).status_code == 200


def test_an_empty_key_is_refused_at_start(plain, monkeypatch):
    with pytest.raises(ValueError, match="--api-key"):
        Admission("  ")
    monkeypatch.setenv("MATRYOSHKA2D_API_KEY", KEY)
    assert Admission.from_options(None, 10).needs_key


def test_metrics_parse_as_prometheus_text_and_count_what_happened(aligned):
    from prometheus_client.parser import text_string_to_metric_families

    app = create_app(aligned, "tiny", ladder=ladder_of("tiny", [1, 2, 3, 4], fixed_cost(SYNTHETIC)))
    with TestClient(app) as client:
        client.post("/v1/embeddings", json={"model": "tiny", "input": ["red cat", "blue dog"]})
        client.post("/v1/embeddings", json={"model": "tiny", "input": "red cat", "layer": 2})
        client.post("/v1/embeddings", json={"model": "nope", "input": "red cat"})
        text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("matryoshka2d_requests_total", (("route", "/v1/embeddings"), ("status", "200")))] == 2
    assert samples[("matryoshka2d_requests_total", (("route", "/v1/embeddings"), ("status", "404")))] == 1
    assert samples[("matryoshka2d_embeddings_total", (("encoder", "tiny"), ("layer", "4")))] == 2
    assert samples[("matryoshka2d_embeddings_total", (("encoder", "tiny"), ("layer", "2")))] == 1
    assert samples[("matryoshka2d_rung_quality", (("encoder", "tiny"), ("layer", "3")))] == pytest.approx(0.9)
    assert samples[("matryoshka2d_rung_share", (("encoder", "tiny"), ("layer", "4")))] == 1.0  # nothing waits
    for phase in ("http", "parse", "tokenize", "queue", "handoff", "model", "answer"):
        assert samples[("matryoshka2d_phase_duration_seconds_count", (("phase", phase),))] == 2
    assert samples[("matryoshka2d_tokens_total", (("encoder", "tiny"),))] > 0
    assert samples[("matryoshka2d_queue_texts", ())] == 0
    for name in (
        "matryoshka2d_request_duration_seconds",
        "matryoshka2d_batch_texts",
        "matryoshka2d_model_duration_seconds",
        "matryoshka2d_phase_duration_seconds",
    ):
        assert families[name].type == "histogram"


def test_past_the_bound_a_request_gets_429_with_retry_after_and_nothing_queued_is_dropped(tokenizer):
    gate = Gate(tokenizer)
    app = create_app(gate, "gate", ServerLimits(max_batch=2, max_queued_texts=6))
    with TestClient(app) as client, ThreadPoolExecutor(8) as pool:
        body = {"model": "gate", "input": ["a b", "c d"], "layer": 2}
        waiting = [pool.submit(client.post, "/v1/embeddings", json=body) for _ in range(4)]
        deadline = time.monotonic() + 20  # one batch runs (held at the gate), three requests (6 texts) wait
        while app.state.batcher.queued_texts < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = client.post("/v1/embeddings", json=body)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "model_overloaded" and "--max-queued-texts" in refused.text
        # a full queue refuses before the body is read: under overload most requests are refused, and a refusal
        # that parses, checks and tokenizes first takes that time from the core the model needs
        unread = client.post("/v1/embeddings", content=b"{not json", headers={"Content-Type": "application/json"})
        assert unread.status_code == 429 and int(unread.headers["retry-after"]) >= 1
        assert "6 texts are waiting (the bound is 6, --max-queued-texts)" in unread.json()["error"]["message"]
        assert client.post("/v1/embeddings", json={"model": "gate", "input": [], "layer": 2}).status_code == 429
        gate.open.set()
        answers = [w.result(timeout=30) for w in waiting]
    assert [a.status_code for a in answers] == [200] * 4  # every accepted request answered
    assert sum(n for _, n in gate.calls) == 8


def test_the_bound_in_time_refuses_a_queue_the_model_needs_too_long_for():
    """--max-queue-ms: a request that would join a queue of more than that much model time (its texts times the
    recent time per text) is refused with 429 and Retry-After, under the bound in texts; an empty queue takes all."""
    from matryoshka2d.deploy.api import ApiError

    admission = Admission(max_queued_texts=1024, max_queue_ms=1000)
    admission.admit(texts=1, queued=100, drain_seconds=0.9)  # 900 ms waiting: let in
    admission.admit(texts=1, queued=0, drain_seconds=0.0)  # nothing waits or runs: always let in
    with pytest.raises(ApiError) as refused:  # nothing waits, but the call in flight needs 1.5 s more
        admission.admit(texts=1, queued=0, drain_seconds=1.5)
    assert refused.value.status == 429 and "the call running need about 1500 ms" in str(refused.value)
    with pytest.raises(ApiError) as refused:
        admission.admit(texts=1, queued=100, drain_seconds=2.3)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "3"
    assert "need about 2300 ms of the model" in str(refused.value) and "--max-queue-ms" in str(refused.value)
    Admission(max_queued_texts=8).admit(texts=1, queued=7, drain_seconds=60.0)  # no bound in time unless asked
    for bad in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--max-queue-ms must be a positive number"):
            Admission(max_queue_ms=bad)


def test_the_time_the_model_needs_counts_the_rest_of_the_call_in_flight(tokenizer):
    """A call answers its texts together at its end: a request that joins now waits for the rest of the call the
    model runs, then for what queued before it. drain_seconds (--max-queue-ms, Retry-After) counts both."""
    from matryoshka2d.deploy.micro_batching import MicroBatcher

    gate = Gate(tokenizer)  # closed: the first call stays in flight

    async def run():
        batcher = MicroBatcher(gate, max_batch=64, max_wait=0.0)
        batcher.start()
        try:
            batcher.ms_per_text = 100.0  # the model's recent wall time per text
            first = asyncio.ensure_future(batcher.answer([f"t{i}" for i in range(10)], 2))
            while batcher._running is None:  # the call of 10 texts has started (the queue is empty again)
                await asyncio.sleep(0.001)
            in_flight = batcher.drain_seconds()
            second = asyncio.ensure_future(batcher.answer(["u1", "u2", "u3"], 2))
            await asyncio.sleep(0.01)
            behind = batcher.drain_seconds()
            gate.open.set()
            await asyncio.gather(first, second)
            return in_flight, behind, batcher.drain_seconds()
        finally:
            gate.open.set()
            await batcher.stop()

    in_flight, behind, after = asyncio.run(run())
    assert 0.9 < in_flight <= 1.0  # 10 texts at 100 ms a text, a few ms of which have passed: nothing queued
    assert behind == pytest.approx(in_flight + 0.3, abs=0.05)  # three texts queued behind it
    assert after == 0.0  # nothing runs or waits


def test_a_request_larger_than_the_bound_is_taken_when_nothing_waits(tokenizer):
    gate = Gate(tokenizer)
    gate.open.set()
    app = create_app(gate, "gate", ServerLimits(max_queued_texts=2))
    with TestClient(app) as client:
        assert client.post("/v1/embeddings", json={"model": "gate", "input": ["a"] * 5}).status_code == 200


def test_while_draining_every_request_gets_503_and_health_says_so(plain):
    app = create_app(plain, "tiny")
    with TestClient(app) as client:
        app.state.admission.draining = True
        for path in ("/health", "/v1/models"):
            reply = client.get(path)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"


def test_serve_puts_what_it_loaded_out_of_the_collectors_reach_before_it_answers(plain, monkeypatch):
    """A full collection over the model and its libraries stops the event loop and the model thread for ~200 ms;
    `serve` freezes them before the first request, so that only the requests' own objects are ever walked."""
    import gc

    from matryoshka2d.deploy import server

    frozen_at_start = []
    monkeypatch.setattr(server._DrainingServer, "run", lambda self: frozen_at_start.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        server.serve(plain, "tiny", port=0)
        assert frozen_at_start and frozen_at_start[0] > 10_000  # torch, FastAPI and the model: far more than 10,000
    finally:
        gc.unfreeze()  # the suite goes on in this process: its objects are collected as usual again


# -- request bodies: bounded before conversion, never a 500 ------------------------------------------------------
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


@pytest.mark.parametrize("field", list(BODIES))
def test_a_number_of_thousands_of_digits_in_any_field_is_a_400(plain, field):
    raw = BODIES[field]
    app = create_app(plain, "tiny")
    with TestClient(app) as client:
        reply = client.post("/v1/embeddings", content=raw, headers={"Content-Type": "application/json"})
    if field == "user":  # OpenAI's free-form field: taken and ignored, whatever it holds
        assert reply.status_code == 200
    else:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field.split("[")[0]
        assert "5000 digits" in reply.json()["error"]["message"]


def test_a_body_nested_past_the_parser_is_a_400(plain):
    app = create_app(plain, "tiny")
    with TestClient(app) as client:
        raw = '{"model": "tiny", "input": ' + "[" * 100000 + "]" * 100000 + "}"
        reply = client.post("/v1/embeddings", content=raw)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


def test_the_event_loops_token_ids_are_the_tokenizers_own_whatever_state_its_backend_is_in(tokenizer, monkeypatch):
    import copy

    from matryoshka2d.deploy.server import token_ids

    counter = copy.deepcopy(tokenizer)
    texts = ["red cat", "", "  spaced   out  ", "Ünïcödé naïve café – 東京", "[SEP] [CLS] inside", "word " * 600]
    expected = dict(tokenizer(texts, add_special_tokens=True, verbose=False))
    assert counter.backend_tokenizer.truncation is not None  # minilm's tokenizer.json cuts at 128 and pads
    assert token_ids(counter, texts) == expected  # so the wrapper runs, and sets the backend back
    assert counter.backend_tokenizer.truncation is None and counter.backend_tokenizer.padding is None
    with monkeypatch.context() as patched:  # from here on the backend alone answers, with the same ids
        patched.setattr(type(counter), "__call__", lambda *a, **k: pytest.fail("the wrapper ran"))
        assert token_ids(counter, texts) == expected
    counter(["x"], truncation=True, max_length=4)  # a call that cuts leaves the backend cutting...
    assert token_ids(counter, texts) == expected  # ...so the wrapper runs again: the long text stays whole
    assert len(token_ids(counter, texts)["input_ids"][-1]) == 602


# -- queries and documents in one model ----------------------------------------------------------------------------
def embed(client, **body):
    reply = client.post("/v1/embeddings", json={"model": "tiny", "input": ["red cat sleeps", "blue dog"], **body})
    return reply


def test_input_type_routes_queries_to_the_query_encoder_and_documents_to_the_full_cell(plain, tokenizer):
    import transformers as tf

    config = tf.BertConfig(vocab_size=tokenizer.vocab_size, **{**TINY, "num_hidden_layers": 2})
    query = ElasticEncoder.from_modules(tf.AutoModel.from_config(config).eval(), tokenizer, name="q")  # a "student"
    texts = ["red cat sleeps", "blue dog"]
    plain_app = create_app(plain, "tiny")
    paired_app = create_app(plain, "tiny", query_models={"tiny-q": query})
    with TestClient(plain_app) as before, TestClient(paired_app) as client:
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
    app = create_app(plain, "tiny", query_cell=(2, 16))
    texts = ["red cat sleeps", "blue dog"]
    with TestClient(app) as client:
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
            create_app(plain, "tiny", query_models={name: plain})


# -- adaptive depth ------------------------------------------------------------------------------------------------
def test_adaptive_answers_say_their_layer_and_a_named_layer_is_kept(aligned):
    app = create_app(aligned, "tiny", ladder=ladder_of("tiny", aligned_layers(aligned), fixed_cost(SYNTHETIC)))
    with TestClient(app) as client:
        adaptive = embed(client)
        assert adaptive.headers["x-matryoshka2d-layer"] == "4"  # nothing waits: the full depth
        assert [(d["layer"], d["encoder"]) for d in adaptive.json()["data"]] == [(4, "tiny"), (4, "tiny")]
        timing = dict(part.split("=") for part in adaptive.headers["x-matryoshka2d-phases"].split(","))
        assert set(timing) == {"http", "parse", "tokenize", "queue", "handoff", "model", "answer"}
        assert float(adaptive.headers["x-total-time"]) >= float(adaptive.headers["x-inference-time"]) > 0
        assert embed(client, layer="auto").json()["layer"] == 4
        named = embed(client, layer=2).json()
        assert named["layer"] == 2 and named["data"][0]["layer"] == 2
        np.testing.assert_allclose(
            named["data"][0]["embedding"], aligned.encode("red cat sleeps", layer=2, normalize=True), atol=1e-5
        )
    with TestClient(create_app(aligned, "tiny")) as client:
        refused = embed(client, layer="auto")
        assert refused.status_code == 400 and "--adaptive-depth" in refused.json()["error"]["message"]


def test_adaptive_depth_is_refused_on_a_model_without_aligned_exits(tiny_dir, capsys):
    serve = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0", "--adaptive-depth"]
    assert main(serve) == 2
    err = capsys.readouterr().err
    assert "not aligned to its last layer" in err and "distill --mode shared" in err and "--query-model" in err
    assert main(["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0", "--target-ms", "40"]) == 2
    assert "add --adaptive-depth" in capsys.readouterr().err


# -- a real server: the drain on SIGTERM, and a log without the key --------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_under_load_answers_every_accepted_request_and_exits_0_and_the_key_is_in_no_log(tiny_dir):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MATRYOSHKA2D_API_KEY": KEY}
    command = [sys.executable, "-m", "matryoshka2d.cli", "serve", "--model", str(tiny_dir), "--pooling", "mean"]
    server = subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "debug", "--served-name", "tiny"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def call(i: int):
        data = json.dumps({"model": "tiny", "input": [f"{WORDS[i % len(WORDS)]} cat number {i}"] * 4}).encode()
        request = urllib.request.Request(
            url + "/v1/embeddings", data=data, headers={"Authorization": f"Bearer {KEY}"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return "refused"  # not accepted: the listener is closed

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        assert call(0) == 200
        with ThreadPoolExecutor(16) as pool:
            replies = [pool.submit(call, i) for i in range(200)]
            time.sleep(0.3)
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=60)  # how long the drain takes under load: benchmarks/serve_overload.py
            statuses = [r.result(timeout=60) for r in replies]
    finally:
        if server.poll() is None:
            server.kill()
    log = server.stdout.read().decode()
    assert code == 0, log[-2000:]
    assert set(statuses) <= {200, 503, "refused"} and statuses.count(200) > 0  # nothing accepted was lost
    assert KEY not in log


def test_a_pair_folder_is_served_as_one_model_whose_queries_take_its_query_route(tiny_dir, tmp_path, monkeypatch):
    """`serve --model PAIR` (export --query-cell / --query-model): input_type "query" runs the pair's query route,
    as sentence-transformers' encode_query does; "document" its document route, as encode_document."""
    from sentence_transformers import SentenceTransformer

    from matryoshka2d.deploy import server

    pair = tmp_path / "pair"
    assert (
        main(["export", "--model", str(tiny_dir), "--pooling", "mean", "--query-cell", "2x16", "--output", str(pair)])
        == 0
    )
    started = {}
    monkeypatch.setattr(server, "serve", lambda model, name, **kw: started.update(model=model, name=name, **kw))
    assert main(["serve", "--model", str(pair), "--served-name", "pair", "--port", "0"]) == 0
    assert list(started["query_models"]) == ["pair-query"]
    texts = ["red cat sleeps", "blue dog"]
    plain = SentenceTransformer(str(pair), device="cpu")
    app = create_app(started["model"], "pair", query_models=started["query_models"])
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


def test_a_request_whose_client_went_away_is_not_run(tokenizer):
    """Under overload clients time out; the model must not spend itself on answers nobody waits for: the request's
    future is cancelled when its connection closes, and the batcher skips it."""
    from matryoshka2d.deploy.api import ApiError
    from matryoshka2d.deploy.micro_batching import MicroBatcher
    from matryoshka2d.deploy.server import _unless_gone

    class Gone:  # a request whose client has closed the connection
        async def receive(self):
            return {"type": "http.disconnect"}

    gate = Gate(tokenizer)

    async def run():
        batcher = MicroBatcher(gate, max_batch=1, max_wait=0.0)
        batcher.start()
        try:
            first = asyncio.ensure_future(batcher.answer(["held at the gate"], 2))
            await asyncio.sleep(0.05)  # the first batch runs (held); the next request waits in the queue
            with pytest.raises(ApiError) as refused:
                await _unless_gone(Gone(), batcher.answer(["nobody waits for me"], 2))
            gate.open.set()
            await first
            await asyncio.sleep(0.1)
            return refused.value.status
        finally:
            await batcher.stop()

    assert asyncio.run(run()) == 499
    assert gate.calls == [(2, 1)]  # only the first request ran


def test_the_overload_benchmark_bounds_what_any_choice_of_layers_keeps_at_a_load(monkeypatch):
    """benchmarks/serve_overload.py prints, beside adaptive depth's nDCG share, the most any mix of layers could keep
    at that load: at a load between two layers' capacities it mixes those two, using all of the core."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from serve_overload import depth_bound

    depth = [
        {"layer": 1, "of_full": 4.0, "ndcg_share_of_flat": 80.0},
        {"layer": 2, "of_full": 2.0, "ndcg_share_of_flat": 90.0},
        {"layer": 3, "of_full": 1.0, "ndcg_share_of_flat": 100.0},
    ]
    assert depth_bound(depth, 0.5) == pytest.approx(100.0)  # room for every request at full depth
    # at 1.5x: f at layer 3 and 1 - f at layer 2 fill the core: f / 1 + (1 - f) / 2 = 1 / 1.5, f = 1/3
    assert depth_bound(depth, 1.5) == pytest.approx(100 / 3 + 90 * 2 / 3)
    # at 3x: 1/3 at layer 2 and 2/3 at layer 1 (a mix of layers 3 and 1 fits only 1/9 at layer 3: 82.2)
    assert depth_bound(depth, 3.0) == pytest.approx(90 / 3 + 80 * 2 / 3)
    assert depth_bound(depth, 5.0) is None  # not even layer 1 keeps up
