"""What lets a request in (serve/admission.py): the API key on every route but /health, the bound on waiting work
(429 with Retry-After, in texts and in the model's time, before the body is read when what waits refuses any), and
the drain (503 to every new request). In-process, on a fake backend whose gate holds the model."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.models import tiny_transformer
from helpers.server import FakeBackend, InProcess, app_of, onnx_graphs_of, openai_client, post_asgi
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve.admission import DEFAULT_DEADLINE_MS, Admission

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def plain(tokenizer):
    return ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="plain")


def test_every_route_but_health_needs_the_key_in_openai_shape(plain):
    with InProcess(app_of(plain, api_key=KEY)) as server:
        client = server.http
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


def test_the_onnx_backend_needs_the_api_key_on_every_route_but_health(tiny_bert, tmp_path):
    """The key is checked in front of every route (serve/admission.Guard), whatever runs the model."""
    pytest.importorskip("onnxruntime")
    from matryoshka2d.serve.backends import OnnxBackend

    folder = tiny_bert.save(tmp_path / "tiny")
    graphs = onnx_graphs_of(folder, tmp_path / "graphs")
    encoder = ElasticEncoder(str(folder), device="cpu")
    backend = OnnxBackend(encoder, layers=[2], cache_folder=graphs, log=lambda _: None)
    with InProcess(app_of(backend, api_key="k3y")) as server:
        client = server.http
        assert client.get("/health").status_code == 200
        body = {"model": "tiny", "input": "red cat"}
        for path in ("/v1/models", "/metrics"):
            assert client.get(path).status_code == 401
        assert client.post("/v1/embeddings", json=body).status_code == 401
        reply = client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer k3y"})
        assert reply.status_code == 200 and reply.json()["layer"] == 2


def test_an_empty_key_is_refused_at_start(monkeypatch):
    with pytest.raises(ValueError, match="--api-key"):
        Admission("  ")
    monkeypatch.setenv("MATRYOSHKA2D_API_KEY", KEY)
    assert Admission.from_options(None, 10).needs_key


def test_past_the_bound_a_request_gets_429_with_retry_after_and_nothing_queued_is_dropped(tokenizer):
    gate = FakeBackend(tokenizer)
    app = app_of(gate, "gate", max_batch=2, max_queued_texts=6)
    batcher = app.state.engine.main.batcher
    with InProcess(app) as server, ThreadPoolExecutor(8) as pool:
        client = server.http
        body = {"model": "gate", "input": ["a b", "c d"], "layer": 2}
        waiting = [pool.submit(client.post, "/v1/embeddings", json=body) for _ in range(4)]
        deadline = time.monotonic() + 20  # one batch runs (held at the gate), three requests (6 texts) wait
        while batcher.queued_texts < 6 and time.monotonic() < deadline:
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
    recent time per text, at least FLOOR_FACTOR times it) is refused with 429 and Retry-After, under the bound in
    texts; an empty queue takes all."""
    from matryoshka2d.serve.admission import FLOOR_FACTOR
    from matryoshka2d.serve.protocol import ApiError

    admission = Admission(max_queued_texts=1024, max_queue_ms=1000)
    admission.admit(texts=1, queued=100, drain_seconds=0.79)  # 790 ms waiting, 988 with the floor: let in
    with pytest.raises(ApiError) as refused:  # 900 ms waiting: past the deadline once scaled by the floor
        admission.admit(texts=1, queued=100, drain_seconds=0.9)
    assert f"(x {FLOOR_FACTOR:.2f}, how far estimates ran short)" in str(refused.value)
    admission.admit(texts=1, queued=0, drain_seconds=0.0)  # nothing waits or runs: always let in
    with pytest.raises(ApiError) as refused:  # nothing waits, but the call in flight needs 1.5 s more
        admission.admit(texts=1, queued=0, drain_seconds=1.5)
    assert refused.value.status == 429 and "the call running need about 1500 ms" in str(refused.value)
    with pytest.raises(ApiError) as refused:
        admission.admit(texts=1, queued=100, drain_seconds=2.3)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "3"
    assert "need about 2300 ms of the model" in str(refused.value) and "--max-queue-ms" in str(refused.value)
    with pytest.raises(ApiError) as refused:  # by default the deadline is what an interactive client waits
        Admission(max_queued_texts=8).admit(texts=1, queued=7, drain_seconds=60.0)
    assert f"the deadline of {DEFAULT_DEADLINE_MS:g} ms (--max-queue-ms)" in str(refused.value)
    Admission(max_queued_texts=8, max_queue_ms=90_000).admit(texts=1, queued=7, drain_seconds=60.0)
    for bad in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--max-queue-ms must be a positive number"):
            Admission(max_queue_ms=bad)


def test_the_time_the_model_needs_counts_the_rest_of_the_call_in_flight(tokenizer):
    """A call answers its texts together at its end: a request that joins now waits for the rest of the call the
    model runs, then for what queued before it. drain_seconds (--max-queue-ms, Retry-After) counts both."""
    from matryoshka2d.serve.batching import MicroBatcher

    gate = FakeBackend(tokenizer)  # closed: the first call stays in flight

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


def test_a_request_the_model_could_not_answer_by_its_deadline_is_refused_before_any_work(tokenizer, monkeypatch):
    """The deadline (--max-queue-ms, or the client's own shorter one: the OpenAI SDKs send their timeout as
    x-stainless-read-timeout): a request that would wait for the call in flight and what queued, then for its own
    texts, past it, is answered 429 with Retry-After at once: nothing of it is tokenized or queued."""
    import openai

    from matryoshka2d.serve import texts as serve_texts

    tokenized, real = [], serve_texts.token_ids
    monkeypatch.setattr(
        serve_texts, "token_ids", lambda counter, texts: tokenized.append(texts) or real(counter, texts)
    )
    gate = FakeBackend(tokenizer)  # closed: the first request's call stays in flight
    app = app_of(gate, "gate", max_queue_ms=500)
    batcher = app.state.engine.main.batcher
    body = {"model": "gate", "input": "red cat", "layer": 2}
    with InProcess(app) as server, ThreadPoolExecutor(2) as pool:
        client = server.http
        held = pool.submit(client.post, "/v1/embeddings", json=body)
        deadline = time.monotonic() + 20
        while batcher._running is None and time.monotonic() < deadline:  # its call has started
            time.sleep(0.01)
        batcher.ms_per_text = 400.0  # the model's measured time a text: 400 ms for the call in flight, 400 for this
        refused = client.post("/v1/embeddings", json=body)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert (
            error["code"] == "model_overloaded" and "past the deadline of 500 ms (--max-queue-ms)" in error["message"]
        )
        assert len(tokenized) == 1 and batcher.queued_texts == 0  # only the held request was tokenized and queued
        batcher.ms_per_text = 100.0  # now about 200 ms: within the server's deadline, past a client's of 150 ms
        impatient = openai_client(client).with_options(timeout=0.15)
        with pytest.raises(openai.RateLimitError, match="x-stainless-read-timeout"):
            impatient.embeddings.create(model="gate", input="red cat", extra_body={"layer": 2})
        assert len(tokenized) == 1
        patient = pool.submit(client.post, "/v1/embeddings", json=body)
        while batcher.queued_texts < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.open.set()
        assert held.result(timeout=30).status_code == patient.result(timeout=30).status_code == 200


def test_under_overload_the_queue_holds_only_work_that_can_finish_by_the_deadline(tokenizer):
    """A synthetic overload: 60 requests at once on a model that takes 20 ms a call of one text, with a deadline of
    300 ms. Those it could not answer in time are refused at once (429, Retry-After); every one it takes is
    answered within the deadline (give or take a call: the model's time a text is measured, not known)."""
    backend = FakeBackend(tokenizer, seconds=0.02)
    backend.open.set()
    app = app_of(backend, "fake", max_batch=1, max_queue_ms=300)
    body = {"model": "fake", "input": "red cat", "layer": 2}

    async def overload():
        async with app.router.lifespan_context(app):
            for _ in range(3):  # the model's time a text, measured
                assert (await post_asgi(app, body))[0] == 200

            async def timed():
                start = time.perf_counter()
                status, headers, _ = await post_asgi(app, body)
                return status, headers, 1000 * (time.perf_counter() - start)

            return await asyncio.gather(*(timed() for _ in range(60)))

    answers = asyncio.run(overload())
    taken = [ms for status, _, ms in answers if status == 200]
    refused = [headers for status, headers, _ in answers if status == 429]
    assert len(taken) + len(refused) == 60 and len(refused) >= 30 and len(taken) >= 5
    assert all(int(headers["retry-after"]) >= 1 for headers in refused)
    assert max(taken) <= 300 * 1.25, sorted(taken)


def test_a_request_larger_than_the_bound_is_taken_when_nothing_waits(tokenizer):
    gate = FakeBackend(tokenizer)
    gate.open.set()
    with InProcess(app_of(gate, "gate", max_queued_texts=2)) as server:
        assert server.http.post("/v1/embeddings", json={"model": "gate", "input": ["a"] * 5}).status_code == 200


def test_while_draining_every_request_gets_503_and_health_says_so(plain):
    app = app_of(plain)
    with InProcess(app) as server:
        app.state.admission.draining = True
        for path in ("/health", "/v1/models"):
            reply = server.http.get(path)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"
            assert reply.headers["connection"] == "close"  # the balancer's next check opens a new connection


def test_the_event_loops_lag_counts_against_the_deadline_twice():
    """A request's time before the app sees it and after its answer is ready is the event loop's: LoopLag measures
    how late the loop runs what is ready (a loop blocked 120 ms: its tick about 90 ms late), and the admission adds
    it twice to the queue's estimate, so a queue that fits the deadline alone is refused once the loop is that late."""
    from matryoshka2d.serve.admission import FLOOR_FACTOR, LoopLag
    from matryoshka2d.serve.protocol import ApiError

    async def blocked_loop() -> float:
        lag = LoopLag()
        lag.start(asyncio.get_running_loop())
        await asyncio.sleep(0.02)
        time.sleep(0.12)  # the loop runs nothing meanwhile: the tick due within it (at 50 ms) is late
        await asyncio.sleep(0.06)
        lag.stop()
        return lag.seconds

    late = asyncio.run(blocked_loop())
    assert 0.04 <= late <= 0.5, late
    admission = Admission(max_queue_ms=1000)
    drain = (1.0 - 0.01) / FLOOR_FACTOR  # 990 ms with the floor: in time while the loop keeps up
    admission.admit(texts=1, queued=10, drain_seconds=drain)
    admission.loop_lag.worst = late
    with pytest.raises(ApiError) as refused:
        admission.admit(texts=1, queued=10, drain_seconds=drain)
    assert "the event loop's lag twice" in str(refused.value)
