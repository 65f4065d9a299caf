"""`matryoshka2d serve` as a process (serve/process.py): what needs one. `serve --layers 2-4` started from the
command line and the official openai client over the network; the drain a balancer needs (issue 61, item 2): from
SIGTERM until what was accepted is answered, the port stays open and every new request, /health included, is
answered 503 with `Connection: close`, then exit 0; Ctrl-C's drain cut at --drain-seconds with OpenAI-shaped 503s;
uvicorn's reading of a chunked upload. The drain's logic and gc.freeze are also checked in-process, without a
process's start-up."""

import asyncio
import base64
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient

from helpers.data import SENTENCES
from helpers.models import tiny_transformer, wide_bert_folder
from helpers.server import FakeBackend, ServerProcess, app_of, post, request
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve import process

openai = pytest.importorskip("openai", reason="the official openai client (in the dev extra) is not installed")
pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [s for s in SENTENCES if s]
KEY = "s3cret-key-for-the-drain"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_bert):
    return tiny_bert.save(tmp_path_factory.mktemp("tiny-served"))


@pytest.fixture(scope="module")
def layers_2_4(tiny_folder):
    """`serve --layers 2-4`, the tiny model, one process for the tests over the network."""
    server = ServerProcess(tiny_folder, "--served-name", "tiny", "--layers", "2-4", "--log-level", "warning")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_serve_layers_2_to_4_starts_and_answers_layer_3_alone_with_its_neighbours(layers_2_4, tiny_folder):
    """Issue 59's acceptance: `serve --layers 2-4` takes the ranges `eval --layers` takes, for the torch backend too,
    and answers those layers only."""
    tiny_local = ElasticEncoder(str(tiny_folder), device="cpu")
    status, _, body = post(layers_2_4.url, {"model": "tiny", "input": TEXTS, "layer": 3})
    assert status == 200, body
    got = np.array([d["embedding"] for d in json.loads(body)["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, tiny_local.encode(TEXTS, layer=3, normalize=True), atol=1e-5)
    status, _, body = post(layers_2_4.url, {"model": "tiny", "input": TEXTS, "layer": 1})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, listed = layers_2_4.call("GET", "/v1/models")
    assert status == 200 and listed["data"][0]["layers"] == [2, 3, 4]
    assert {c["layer"] for c in listed["data"][1:]} == {2, 3, 4}
    assert "serving tiny (torch): 4 layers (layers 2, 3, 4) x 32 dims" in layers_2_4.output()


def test_the_openai_client_over_the_network_gets_the_cells_and_its_own_errors(layers_2_4, tiny_folder):
    tiny_local = ElasticEncoder(str(tiny_folder), device="cpu")
    client = layers_2_4.client()
    expected = tiny_local.encode(TEXTS, layer=2, dim=16, normalize=True)
    as_float = client.embeddings.create(
        model="tiny", input=TEXTS, dimensions=16, encoding_format="float", extra_body={"layer": 2}
    )
    np.testing.assert_allclose([d.embedding for d in as_float.data], expected, atol=1e-5)
    by_client = client.embeddings.create(
        model="tiny", input=TEXTS, dimensions=16, encoding_format="base64", extra_body={"layer": 2}
    )
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in by_client.data])
    np.testing.assert_allclose(decoded, expected, atol=1e-6)
    default = client.embeddings.create(model="tiny", input="A man is playing a guitar.")  # base64, decoded by it
    full = tiny_local.encode(["A man is playing a guitar."], normalize=True)[0]  # the deepest layer served, 4
    np.testing.assert_allclose(default.data[0].embedding, full, atol=1e-5)
    assert [m.id for m in client.models.list()][:2] == ["tiny", "tiny@2x8"]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", input=["x"], dimensions=64)
    assert info.value.status_code == 400 and info.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input=["x"])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="tiny@1x8", input=["x"])


def slow_serve(seconds: float) -> str:
    """`serve` whose model call takes `seconds` more for a text holding "slow" (however fast the machine is)."""
    return f"""
import sys, time
from matryoshka2d.serve import backends
real = backends.TorchBackend.pooled
def pooled(self, texts, layer, encoded=None):
    if any("slow" in text for text in texts):
        print("MODEL CALL STARTED", file=sys.stderr, flush=True)
        time.sleep({seconds})
    return real(self, texts, layer, encoded)
backends.TorchBackend.pooled = pooled
from matryoshka2d.cli import main
sys.exit(main(sys.argv[1:]))
"""


# `serve` whose model call takes 20 s for a text holding "slow": far longer than the drain's 1 s.
SLOW_SERVE = slow_serve(20)


# -- the drain -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tokenizer):
    """A random BERT of 12 layers x 384 (minilm-l6's width, twice its depth), as a folder: a text of 500 tokens is
    a second of a core, so requests are surely in flight when the signal comes."""
    return wide_bert_folder(tmp_path_factory.mktemp("wide"), tokenizer)


LONG = "red cat sleeps on the old mat " * 70  # about 490 tokens


def test_sigterm_keeps_the_port_open_answering_503_until_what_it_accepted_is_answered_then_exits_0(wide_model):
    """Issue 61's acceptance: 4 requests of long texts in flight, SIGTERM, then 10 new requests and /health, each on
    a new connection: each answered 503 (none refused or reset: the listener closed at the signal), the 4 answered
    200, exit 0. The key (from the environment) is in no line of a debug log. (The first call is made 3 s longer
    than its texts take: on a quiet machine they took 0.2 s, done before the others were queued.)"""
    server = ServerProcess(
        wide_model, "--pooling", "mean", "--served-name", "wide", "--log-level", "debug", "--drain-seconds", "120",
        "--max-queue-ms", "600000",  # requests of seconds queue here on purpose: no deadline refuses them
        code=slow_serve(3), MATRYOSHKA2D_API_KEY=KEY,
    )  # fmt: skip
    key = {"Authorization": f"Bearer {KEY}"}
    try:
        server.wait_ready()
        assert post(server.url, {"model": "wide", "input": "red cat"}, key)[0] == 200
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(post, server.url, {"model": "wide", "input": [f"slow {LONG}"] * 4}, key)  # seconds
            time.sleep(0.5)
            behind = [pool.submit(post, server.url, {"model": "wide", "input": f"{i} {LONG}"}, key) for i in range(3)]
            deadline = time.monotonic() + 60
            while json.loads(request(server.url + "/health")[2])["queued_requests"] < 3:  # all four accepted
                assert time.monotonic() < deadline and not first.done(), server.output()[-3000:]
                time.sleep(0.05)
            server.signal(signal.SIGTERM)
            server.wait_for("Draining: new requests get 503 on the open port; 4 accepted ones", 30)
            new = {"model": "wide", "input": "a new request"}
            during = [request(server.url + "/v1/embeddings", "POST", new, headers=key) for _ in range(10)]
            health = request(server.url + "/health")
            answered_meanwhile = first.done()
            code = server.process.wait(timeout=120)
            answers = [first.result(timeout=30)] + [b.result(timeout=30) for b in behind]
    finally:
        server.stop()
    log = server.output()
    assert [status for status, _, _ in during] == [503] * 10, log[-3000:]
    for _, headers, body in during:
        assert headers["connection"] == "close" and json.loads(body)["error"]["code"] == "server_shutting_down"
    assert health[0] == 503 and json.loads(health[2])["error"]["code"] == "server_shutting_down"
    assert not answered_meanwhile  # the new requests were answered while the accepted ones still ran
    assert [status for status, _, _ in answers] == [200] * 4, answers
    assert code == 0, log[-3000:]
    assert KEY not in log and "Traceback" not in log


def chunked_past_the_bound(port: int) -> bytes:
    """A chunked upload (no Content-Length) 16,000 bytes long and not finished: what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: here\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):
            sock.sendall(b"fa0\r\n" + b"x" * 4000 + b"\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            part = sock.recv(65536)  # the old server waited for the rest of the body: a timeout here
            if not part:
                break
            reply += part
        return reply


def test_ctrl_c_drains_within_drain_seconds_with_openai_503s_and_exits_0_without_tracebacks(tiny_dir):
    """A real `serve` (one process for two checks: starting one is most of the time): uvicorn's reading of a chunked
    upload stops at the bound with a 413, and Ctrl-C drains as SIGTERM does, within --drain-seconds, while a model
    call 20 s long runs."""
    options = ["--pooling", "mean", "--served-name", "tiny", "--drain-seconds", "1", "--max-body-bytes", "10000"]
    server = ServerProcess(tiny_dir, *options, code=SLOW_SERVE)
    slow = []
    try:
        server.wait_ready()
        reply = chunked_past_the_bound(server.port)
        assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply, reply[:300]
        caller = threading.Thread(
            target=lambda: slow.append(post(server.url, {"model": "tiny", "input": "a slow one"}))
        )
        caller.start()
        server.wait_for("MODEL CALL STARTED", 60)
        signalled = time.monotonic()
        server.signal(signal.SIGINT)
        code = server.process.wait(timeout=30)
        took = time.monotonic() - signalled
        caller.join(30)
    finally:
        server.stop()
    output = server.output()
    assert code == 0, output[-3000:]  # SIGINT was raised again after the drain: 130, with tracebacks
    assert took < 8.0, output[-3000:]  # the drain's 1 s, not the model call's 20 s
    status, kind, body = slow[0]
    assert status == 503 and kind == "application/json", (status, body[:300])  # not uvicorn's plain-text 500
    error = json.loads(body)["error"]
    assert error["code"] == "server_shutting_down" and "--drain-seconds" in error["message"]
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output[-3000:]


# -- the drain's logic, in-process -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="plain")


def until(condition, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_the_drain_lets_uvicorn_stop_only_once_what_it_accepted_is_answered(tokenizer):
    """The server's own signal handler, in process: after SIGTERM uvicorn is not told to stop (which closes its
    listeners) while an accepted request is in flight; meanwhile new requests and /health get 503 with Connection:
    close; once the accepted one is answered 200, uvicorn is told to stop."""
    gate = FakeBackend(tokenizer)
    app, answers = app_of(gate, "gate"), []
    drainer = process.DrainingServer(uvicorn.Config(app), app.state.admission, drain_seconds=60)
    try:
        with TestClient(app) as client:
            drainer.loop = client.portal.call(asyncio.get_running_loop)
            accepted = threading.Thread(
                target=lambda: answers.append(client.post("/v1/embeddings", json={"model": "gate", "input": "a"}))
            )
            accepted.start()
            assert until(lambda: app.state.engine.busy())  # its model call has started
            drainer.handle_exit(signal.SIGTERM, None)
            time.sleep(0.3)  # the drain looks every 50 ms: it has looked, and waits
            assert not drainer.should_exit
            refused = client.post("/v1/embeddings", json={"model": "gate", "input": "b"})
            health = client.get("/health")
            assert refused.status_code == health.status_code == 503
            assert (
                refused.headers["connection"] == "close" and refused.json()["error"]["code"] == "server_shutting_down"
            )
            gate.open.set()
            accepted.join(15)
            assert until(lambda: drainer.should_exit)
    finally:
        gate.open.set()
    assert answers[0].status_code == 200 and not drainer.force_exit
    assert drainer._captured_signals == []  # uvicorn raised SIGINT again: exit 130


def test_sigterm_drains_within_its_deadline_and_answers_what_it_cut_503_in_openai_shape(plain, monkeypatch):
    """The server's own signal handler, in process (the real process above takes SIGINT): SIGTERM turns new requests
    away, and a request whose model call outlives --drain-seconds is answered 503 at the deadline, not when the
    call ends (nor a plain-text 500 when uvicorn cancels it); the signal is not raised again (exit 0)."""
    from matryoshka2d.serve.backends import TorchBackend

    real, release = TorchBackend.pooled, threading.Event()

    def pooled(self, texts, layer, encoded=None):
        if any("slow" in text for text in texts):
            release.wait(20)
        return real(self, texts, layer, encoded)

    monkeypatch.setattr(TorchBackend, "pooled", pooled)
    app, answers = app_of(plain), []
    drainer = process.DrainingServer(uvicorn.Config(app), app.state.admission, drain_seconds=0.5)
    try:
        with TestClient(app) as client:
            drainer.loop = client.portal.call(asyncio.get_running_loop)
            slow = threading.Thread(
                target=lambda: answers.append(client.post("/v1/embeddings", json={"model": "tiny", "input": "slow"}))
            )
            slow.start()
            assert until(lambda: app.state.engine.busy())  # the model call has started
            signalled = time.monotonic()
            drainer.handle_exit(signal.SIGTERM, None)
            slow.join(15)
            took = time.monotonic() - signalled
            assert client.get("/health").status_code == 503
            assert until(lambda: drainer.should_exit)
    finally:
        release.set()
    assert drainer._captured_signals == []  # uvicorn raised SIGINT again: exit 130
    assert answers[0].status_code == 503 and answers[0].headers["content-type"] == "application/json"
    error = answers[0].json()["error"]
    assert error["code"] == "server_shutting_down" and "within 0.5 s (--drain-seconds)" in error["message"]
    assert took < 5.0  # the deadline, not the model call's 20 s


def test_serve_puts_what_it_loaded_out_of_the_collectors_reach_before_it_answers(plain, monkeypatch):
    """A full collection over the model and its libraries stops the event loop and the model thread for ~200 ms;
    `serve` freezes them before the first request, so that only the requests' own objects are ever walked."""
    import gc

    from matryoshka2d.serve import ServerConfig

    frozen_at_start = []
    monkeypatch.setattr(process.DrainingServer, "run", lambda self: frozen_at_start.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        process.serve_app(app_of(plain), ServerConfig(model="tiny", port=0))
        assert frozen_at_start and frozen_at_start[0] > 10_000  # torch, FastAPI and the model: far more than 10,000
    finally:
        gc.unfreeze()  # the suite goes on in this process: its objects are collected as usual again
