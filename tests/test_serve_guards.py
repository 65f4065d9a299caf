"""The server's request path bounded before work (issue 52, item 5): the body while it streams, texts and their
characters before the tokenizer, no tokenizing of large requests on the event loop, headers safe for any served
name, HEAD wherever GET is served, the API key checked at start, --default-dimensions for routed requests, and a
drain (SIGTERM or SIGINT) that ends within --drain-seconds with OpenAI-shaped 503s and exit 0.

In-process apps through FastAPI's TestClient or a direct ASGI call; real `serve` processes where a signal, the
exit code or uvicorn's own reading of a chunked body is what is tested."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import unquote

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.deploy import server
from matryoshka2d.deploy.admission import Admission
from matryoshka2d.deploy.server import ServerLimits, create_app
from matryoshka2d.models.encoder import ElasticEncoder

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "k3y-for-guards"


@pytest.fixture(scope="module")
def plain(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="plain")


# -- the body, bounded while it streams ----------------------------------------------------------------------------
def call_asgi(app, method: str, path: str, chunks, headers=()) -> tuple[int, dict, bytes, int]:
    """One request straight through the ASGI app, its body sent chunk by chunk as a chunked upload arrives (no
    Content-Length): (status, headers, body, chunks the app asked for). TestClient cannot: it reads a streamed body
    whole before the app sees any of it."""
    pulled, sent = [0], []
    source = iter(chunks)

    async def receive():
        try:
            chunk = next(source)
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body, pulled[0]


def test_a_chunked_body_past_the_bound_is_refused_while_it_streams_never_read_whole(plain):
    app = create_app(plain, "tiny", ServerLimits(max_body_bytes=10_000))
    endless = (b'{"model": "tiny", "input": "' if i == 0 else b"x" * 1000 for i in range(100_000))  # 100 MB
    status, headers, body, pulled = call_asgi(app, "POST", "/v1/embeddings", endless)
    error = json.loads(body)["error"]
    assert status == 413 and error["code"] == "request_too_large" and "10000" in error["message"]
    assert pulled <= 12  # reading stopped at the first chunk past 10,000 bytes
    assert headers["connection"] == "close"  # the unread rest cannot be a next request
    # a chunked body within the bound is read whole: its chunks together are the request (here one without input)
    status, _, body, pulled = call_asgi(app, "POST", "/v1/embeddings", [b'{"model": ', b'"tiny"', b"}"])
    assert status == 400 and json.loads(body)["error"]["message"] == "'input' is required" and pulled == 3


# -- texts and their characters, before the tokenizer ----------------------------------------------------------------
@pytest.fixture
def tokenizer_calls(monkeypatch):
    """Every call of the server's tokenizer: (characters of the longest text, the thread it ran on)."""
    calls, real = [], server.token_ids

    def spy(counter, texts):
        calls.append((max(map(len, texts)), threading.current_thread().name))
        return real(counter, texts)

    monkeypatch.setattr(server, "token_ids", spy)
    return calls


def test_an_eight_megabyte_text_is_refused_by_its_characters_before_the_tokenizer_sees_it(plain, tokenizer_calls):
    app = create_app(plain, "tiny", ServerLimits(max_body_bytes=9 * 1024 * 1024))
    huge = "red cat " * (1024 * 1024)  # 8 MB of text: 8 s of the event loop when it was tokenized to be refused
    with TestClient(app) as client:
        reply = client.post("/v1/embeddings", json={"model": "tiny", "input": ["blue dog", huge]})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "input"
        assert "input[1] has 8388608 characters" in error["message"] and "--max-input-chars" in error["message"]
        assert tokenizer_calls == []  # refused by a count of characters: the tokenizer never ran
        assert client.get("/health").status_code == 200


def test_with_truncate_a_text_past_the_characters_read_is_cut_there_and_equals_encodes_cut(plain, tokenizer_calls):
    app = create_app(plain, "tiny", ServerLimits(truncate=True, max_input_chars=4000))
    text = " ".join(["red cat sleeps on the old mat"] * 3000)  # 90,000 characters, far past 512 tokens
    with TestClient(app) as client:
        reply = client.post("/v1/embeddings", json={"model": "tiny", "input": [text, "blue dog"], "layer": 2})
    assert reply.status_code == 200 and reply.json()["truncated_inputs"] == 1
    assert max(n for n, _ in tokenizer_calls) <= 4000  # the tokenizer saw the first 4,000 characters only
    got = np.array([d["embedding"] for d in reply.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, plain.encode([text, "blue dog"], layer=2, normalize=True), atol=1e-5)
    # first characters that make fewer tokens than the model reads: cutting there would not be the text's cut
    spaced = "red" + " " * 5000 + "cat"
    with TestClient(app) as client:
        reply = client.post("/v1/embeddings", json={"model": "tiny", "input": spaced})
    assert reply.status_code == 400 and "make only" in reply.json()["error"]["message"]


def test_a_request_of_many_characters_is_tokenized_off_the_event_loop_so_health_answers_meanwhile(plain, monkeypatch):
    """A request that is long to tokenize (2,048 texts within every bound make a few MB) must not hold the event
    loop: its tokenizing runs on a thread of its own, and /health answers while it runs."""
    real, held, threads, answers = server.token_ids, threading.Event(), [], []

    def slow(counter, texts):  # a tokenizing that takes as long as the test holds it (at most 10 s)
        threads.append(threading.current_thread().name)
        if sum(map(len, texts)) > 10_000:  # the large request only
            held.wait(10)
        return real(counter, texts)

    monkeypatch.setattr(server, "token_ids", slow)
    app = create_app(plain, "tiny")
    texts = [f"red cat number {i} " * 20 for i in range(64)]  # about 24,000 characters
    with TestClient(app) as client:
        big = threading.Thread(
            target=lambda: answers.append(client.post("/v1/embeddings", json={"model": "tiny", "input": texts}))
        )
        big.start()
        deadline = time.monotonic() + 30
        while not threads and time.monotonic() < deadline:  # the large request is being tokenized
            time.sleep(0.01)
        started = time.perf_counter()
        health = client.get("/health")
        waited = time.perf_counter() - started
        small = client.post("/v1/embeddings", json={"model": "tiny", "input": "blue dog"})
        held.set()
        big.join(30)
    assert health.status_code == 200 and small.status_code == 200
    assert waited < 5.0  # on the loop, /health waited for the whole 10 s
    assert threads[0].startswith("matryoshka2d-tokenizer")  # the large request's, off the loop
    assert threads[1] == threading.current_thread().name or not threads[1].startswith("matryoshka2d-tokenizer")
    assert answers[0].status_code == 200


# -- headers for any name, HEAD wherever GET -----------------------------------------------------------------------
def test_a_served_name_of_any_characters_answers_with_headers_that_read_back_as_the_name(plain, tokenizer):
    name, query_name = "modèle-日本", "requête\tq"
    query = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="q")
    app = create_app(plain, name, query_models={query_name: query})
    with TestClient(app) as client:
        for model, body in ((name, {}), (query_name, {}), (name, {"input_type": "query"})):
            reply = client.post("/v1/embeddings", json={"model": model, "input": ["red cat"], **body})
            assert reply.status_code == 200, reply.text  # every answer was a 500 (latin-1 cannot hold 日本)
            header = reply.headers["x-matryoshka2d-encoder"]
            assert header.isascii() and unquote(header) == reply.json()["model"]
        assert client.get("/v1/models").json()["data"][0]["id"] == name
    assert server.header_value("minilm-l6@3x128") == "minilm-l6@3x128"  # an ASCII name is sent as it is


def get_routes(app) -> list[str]:
    """Every path the app answers GET on, a model's name in place of a path parameter."""
    paths = [r.path for r in app.routes if "GET" in getattr(r, "methods", ())]
    return [p.replace("{name:path}", "tiny") for p in paths if not p.startswith(("/docs", "/redoc", "/openapi"))]


def test_every_get_route_answers_head_with_its_headers_and_no_body(plain):
    app = create_app(plain, "tiny", admission=Admission(KEY))
    key = {"Authorization": f"Bearer {KEY}"}
    routes = get_routes(app)
    assert {"/health", "/v1/models", "/v1/models/tiny", "/metrics"} <= set(routes)
    with TestClient(app) as client:
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


# -- the API key, checked at start ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "why"),
    [
        (KEY + "\n", "whitespace around it"),
        ("  " + KEY, "whitespace around it"),
        ("", "is empty"),
        ("k3y\x1bx", "U+001B at character 3"),
        ("k\u00e9y-for-guards", "U+00E9 at character 1"),
    ],
)
def test_an_api_key_no_client_can_send_is_refused_at_start_naming_where_it_came_from(
    tiny_dir, key, why, monkeypatch, capsys
):
    monkeypatch.setattr(server, "serve", lambda *a, **kw: pytest.fail("the server started"))
    command = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0"]
    assert main([*command, "--api-key", key]) == 2
    err = capsys.readouterr().err
    assert "matryoshka2d serve: error: --api-key: the API key" in err and why in err and err.count("\n") == 1
    assert not key.strip() or key.strip() not in err  # the key itself is never printed
    monkeypatch.setenv("MATRYOSHKA2D_API_KEY", key)
    assert main(command) == 2
    assert "MATRYOSHKA2D_API_KEY: the API key" in capsys.readouterr().err


# -- --default-dimensions for routed requests ----------------------------------------------------------------------
def test_default_dimensions_apply_to_requests_with_input_type(plain, tokenizer):
    texts = ["red cat sleeps", "blue dog"]
    query = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="q")
    for options in ({"query_cell": (2, 16)}, {"query_models": {"tiny-q": query}}, {}):
        app = create_app(plain, "tiny", default_dimensions=8, **options)
        with TestClient(app) as client:
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
            if "query_models" in options:  # the query encoder by its name: the server's default width too
                reply = client.post("/v1/embeddings", json={"model": "tiny-q", "input": texts})
                assert reply.json()["dimensions"] == 8
    documents = create_app(plain, "tiny", default_dimensions=8, query_cell=(2, 16))
    with TestClient(documents) as client:
        reply = client.post("/v1/embeddings", json={"model": "tiny", "input": texts, "input_type": "document"})
    np.testing.assert_allclose(
        [d["embedding"] for d in reply.json()["data"]], plain.encode(texts, layer=4, dim=8, normalize=True), atol=1e-5
    )
    with pytest.raises(ValueError, match=r"--default-dimensions 24: .* 16 numbers \(--query-cell 2x16\)"):
        create_app(plain, "tiny", default_dimensions=24, query_cell=(2, 16))


# -- a real server: uvicorn's chunked bodies, and the drain on SIGTERM and SIGINT -----------------------------------
# `serve` whose model call takes 20 s for a text holding "slow": far longer than the drain's 1 s.
SLOW_SERVE = """
import sys, time
from matryoshka2d.deploy import backends
real = backends.TorchBackend.pooled
def pooled(self, texts, layer, encoded=None):
    if any("slow" in text for text in texts):
        print("MODEL CALL STARTED", file=sys.stderr, flush=True)
        time.sleep(20)
    return real(self, texts, layer, encoded)
backends.TorchBackend.pooled = pooled
from matryoshka2d.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url + "/v1/embeddings", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.headers.get("content-type", ""), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("content-type", ""), err.read()


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


def test_sigterm_drains_within_its_deadline_and_answers_what_it_cut_503_in_openai_shape(plain, monkeypatch):
    """The server's own signal handler, in process (the real process below takes SIGINT): SIGTERM turns new requests
    away, and a request whose model call outlives --drain-seconds is answered 503 at the deadline, not when the
    call ends (nor a plain-text 500 when uvicorn cancels it); the signal is not raised again (exit 0)."""
    import uvicorn

    from matryoshka2d.deploy.backends import TorchBackend

    real, release = TorchBackend.pooled, threading.Event()

    def pooled(self, texts, layer, encoded=None):
        if any("slow" in text for text in texts):
            release.wait(20)
        return real(self, texts, layer, encoded)

    monkeypatch.setattr(TorchBackend, "pooled", pooled)
    app, answers = create_app(plain, "tiny"), []
    drainer = server._DrainingServer(uvicorn.Config(app), app.state.admission, drain_seconds=0.5)
    try:
        with TestClient(app) as client:
            drainer.loop = client.portal.call(asyncio.get_running_loop)
            slow = threading.Thread(
                target=lambda: answers.append(client.post("/v1/embeddings", json={"model": "tiny", "input": "slow"}))
            )
            slow.start()
            while not app.state.busy():  # the model call has started
                time.sleep(0.01)
            signalled = time.monotonic()
            drainer.handle_exit(signal.SIGTERM, None)
            slow.join(15)
            took = time.monotonic() - signalled
            assert client.get("/health").status_code == 503
    finally:
        release.set()
    assert drainer.should_exit and drainer._captured_signals == []  # uvicorn raised SIGINT again: exit 130
    assert answers[0].status_code == 503 and answers[0].headers["content-type"] == "application/json"
    error = answers[0].json()["error"]
    assert error["code"] == "server_shutting_down" and "within 0.5 s (--drain-seconds)" in error["message"]
    assert took < 5.0  # the deadline, not the model call's 20 s


def test_ctrl_c_drains_within_drain_seconds_with_openai_503s_and_exits_0_without_tracebacks(tiny_dir):
    """A real `serve` (one process for two checks: starting one is most of the time): uvicorn's reading of a chunked
    upload stops at the bound with a 413, and Ctrl-C drains as SIGTERM does, within --drain-seconds, while a model
    call 20 s long runs."""
    port, log = free_port(), []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    options = ["--port", str(port), "--served-name", "tiny", "--drain-seconds", "1", "--max-body-bytes", "10000"]
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVE, "serve", "--model", str(tiny_dir), "--pooling", "mean", *options],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    threading.Thread(target=lambda: log.extend(process.stdout), daemon=True).start()
    url, slow = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        reply = chunked_past_the_bound(port)
        assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply, reply[:300]
        caller = threading.Thread(target=lambda: slow.append(post(url, {"model": "tiny", "input": "a slow one"})))
        caller.start()
        while not any("MODEL CALL STARTED" in line for line in log) and time.monotonic() < deadline:
            time.sleep(0.05)
        signalled = time.monotonic()
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=30)
        took = time.monotonic() - signalled
        caller.join(30)
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(log)
    assert code == 0, output[-3000:]  # SIGINT was raised again after the drain: 130, with tracebacks
    assert took < 8.0, output[-3000:]  # the drain's 1 s, not the model call's 20 s
    status, kind, body = slow[0]
    assert status == 503 and kind == "application/json", (status, body[:300])  # not uvicorn's plain-text 500
    error = json.loads(body)["error"]
    assert error["code"] == "server_shutting_down" and "--drain-seconds" in error["message"]
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output[-3000:]


def test_a_default_width_the_pair_cannot_give_is_refused_before_the_model_loads(tiny_dir, monkeypatch, capsys):
    from matryoshka2d.cli import args as cli_args

    monkeypatch.setattr(cli_args, "load_encoder", lambda *a, **kw: pytest.fail("the model was loaded"))
    command = ["serve", "--model", str(tiny_dir), "--port", "0", "--query-cell", "2x16", "--default-dimensions", "24"]
    assert main(command) == 2
    assert "--default-dimensions 24: queries and documents of this pair have 16 numbers" in capsys.readouterr().err
