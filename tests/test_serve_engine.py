"""The engine (serve/engine.py) turns a parsed request into an answer: the vectors equal offline encode's at every
cell (minilm-l6 with the server's default cell and --truncate), one tokenizer call whose ids the model takes, texts
bounded by their characters before the tokenizer sees them, long requests tokenized off the event loop, and a
request whose client went away never run. In-process: build_app on models in memory, TestClient, the official
openai client riding on it."""

import threading
import time

import numpy as np
import pytest

from helpers.data import SENTENCES
from helpers.models import tiny_transformer
from helpers.server import FakeBackend, InProcess, app_of
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve import texts as serve_texts

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [s for s in SENTENCES if s]


@pytest.fixture(scope="module")
def plain(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="plain")


@pytest.fixture(scope="module")
def minilm_server(minilm):
    """minilm-l6 served with --truncate and a default cell of (2, 16): one app for the two tests that read it; each
    asks for what it checks."""
    app = app_of(minilm, "minilm-l6", truncate=True, default_layer=2, default_dimensions=16)
    with InProcess(app) as server:
        yield server


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


def test_a_request_is_tokenized_once_and_long_texts_are_cut_as_encode_cuts_them(tiny_bert, tmp_path):
    """The endpoint counts tokens with the tokenizer and hands those ids to the model: the backend's own tokenizer
    is never called (it was, a second time, for every text); with --truncate a long text's ids are cut as the
    tokenizer cuts them, so the vectors equal encode's."""
    folder = tiny_bert.save(tmp_path / "tiny")
    model, tiny_local = ElasticEncoder(str(folder), device="cpu"), ElasticEncoder(str(folder), device="cpu")
    app = app_of(model, truncate=True)
    real, calls = model.tokenizer, []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *args, **kwargs):
            calls.append(args)
            return real(*args, **kwargs)

    model.tokenizer = Spy()
    texts = ["a cat sat", "the dog ran far away", "a cat sat", "word " * 3000]
    with InProcess(app) as server:
        reply = server.http.post("/v1/embeddings", json={"model": "tiny", "input": texts, "layer": 2, "dimensions": 16})
    assert reply.status_code == 200 and calls == []
    body = reply.json()
    assert body["truncated_inputs"] == 1 and body["usage"]["prompt_tokens"] > model.max_length
    got = np.array([row["embedding"] for row in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, tiny_local.encode(texts, layer=2, dim=16, normalize=True), atol=1e-5)


# -- texts and their characters, before the tokenizer ----------------------------------------------------------------
@pytest.fixture
def tokenizer_calls(monkeypatch):
    """Every call of the server's tokenizer: (characters of the longest text, the thread it ran on)."""
    calls, real = [], serve_texts.token_ids

    def spy(counter, texts):
        calls.append((max(map(len, texts)), threading.current_thread().name))
        return real(counter, texts)

    monkeypatch.setattr(serve_texts, "token_ids", spy)
    return calls


def test_an_eight_megabyte_text_is_refused_by_its_characters_before_the_tokenizer_sees_it(plain, tokenizer_calls):
    huge = "red cat " * (1024 * 1024)  # 8 MB of text: 8 s of the event loop when it was tokenized to be refused
    with InProcess(app_of(plain, max_body_bytes=9 * 1024 * 1024)) as server:
        reply = server.http.post("/v1/embeddings", json={"model": "tiny", "input": ["blue dog", huge]})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "input"
        assert "input[1] has 8388608 characters" in error["message"] and "--max-input-chars" in error["message"]
        assert tokenizer_calls == []  # refused by a count of characters: the tokenizer never ran
        assert server.http.get("/health").status_code == 200


def test_with_truncate_a_text_past_the_characters_read_is_cut_there_and_equals_encodes_cut(plain, tokenizer_calls):
    app = app_of(plain, truncate=True, max_input_chars=4000)
    text = " ".join(["red cat sleeps on the old mat"] * 3000)  # 90,000 characters, far past 512 tokens
    with InProcess(app) as server:
        reply = server.http.post("/v1/embeddings", json={"model": "tiny", "input": [text, "blue dog"], "layer": 2})
        assert reply.status_code == 200 and reply.json()["truncated_inputs"] == 1
        assert max(n for n, _ in tokenizer_calls) <= 4000  # the tokenizer saw the first 4,000 characters only
        got = np.array([d["embedding"] for d in reply.json()["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, plain.encode([text, "blue dog"], layer=2, normalize=True), atol=1e-5)
        # first characters that make fewer tokens than the model reads: cutting there would not be the text's cut
        spaced = "red" + " " * 5000 + "cat"
        reply = server.http.post("/v1/embeddings", json={"model": "tiny", "input": spaced})
    assert reply.status_code == 400 and "make only" in reply.json()["error"]["message"]


def test_a_request_of_many_characters_is_tokenized_off_the_event_loop_so_health_answers_meanwhile(plain, monkeypatch):
    """A request that is long to tokenize (2,048 texts within every bound make a few MB) must not hold the event
    loop: its tokenizing runs on a thread of its own, and /health answers while it runs."""
    real, held, threads, answers = serve_texts.token_ids, threading.Event(), [], []

    def slow(counter, texts):  # a tokenizing that takes as long as the test holds it (at most 10 s)
        threads.append(threading.current_thread().name)
        if sum(map(len, texts)) > 10_000:  # the large request only
            held.wait(10)
        return real(counter, texts)

    monkeypatch.setattr(serve_texts, "token_ids", slow)
    texts = [f"red cat number {i} " * 20 for i in range(64)]  # about 24,000 characters
    with InProcess(app_of(plain)) as server:
        client = server.http
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


def test_the_event_loops_token_ids_are_the_tokenizers_own_whatever_state_its_backend_is_in(tokenizer, monkeypatch):
    import copy

    from matryoshka2d.serve.texts import token_ids

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


def test_a_request_whose_client_went_away_is_not_run(tokenizer):
    """Under overload clients time out; the model must not spend itself on answers nobody waits for: the request's
    future is cancelled when its connection closes, and the batcher skips it."""
    import asyncio

    from matryoshka2d.serve.batching import MicroBatcher
    from matryoshka2d.serve.http import unless_gone
    from matryoshka2d.serve.protocol import ApiError

    class Gone:  # a request whose client has closed the connection
        async def receive(self):
            return {"type": "http.disconnect"}

    gate = FakeBackend(tokenizer)

    async def run():
        batcher = MicroBatcher(gate, max_batch=1, max_wait=0.0)
        batcher.start()
        try:
            first = asyncio.ensure_future(batcher.answer(["held at the gate"], 2))
            await asyncio.sleep(0.05)  # the first batch runs (held); the next request waits in the queue
            with pytest.raises(ApiError) as refused:
                await unless_gone(Gone().receive, batcher.submit(["nobody waits for me"], 2), busy=True)
            gate.open.set()
            await first
            await asyncio.sleep(0.1)
            return refused.value.status
        finally:
            await batcher.stop()

    assert asyncio.run(run()) == 499
    assert gate.calls == [(2, 1)]  # only the first request ran


def test_a_fake_backend_of_a_given_cost_is_answered_through_the_engine_in_its_shape(tokenizer):
    """The engine runs any object of the Backend protocol: the answer is the backend's vector at the layer asked,
    cut to its width and made unit length, and the headers time its model call."""
    backend = FakeBackend(tokenizer, layers=4, width=8, seconds=0.02)
    backend.open.set()
    with InProcess(app_of(backend, "fake")) as server:
        reply = server.http.post(
            "/v1/embeddings", json={"model": "fake", "input": ["a b", "c"], "layer": 3, "dimensions": 4}
        )
    assert reply.status_code == 200 and backend.calls == [(3, 2)]
    np.testing.assert_allclose([d["embedding"] for d in reply.json()["data"]], np.full((2, 4), 0.5), atol=1e-7)
    assert float(reply.headers["x-inference-time"]) >= 20.0 and reply.headers["x-matryoshka2d-layer"] == "3"
