"""Micro-batching (serve/batching.py): the heap trimmed at rest and not after every batch, a lone request never
waiting for company, no wait by default, the model thread below the event loop, and the drain rate counting the
event loop's time. On backends of controllable cost; nothing here is an HTTP request."""

import asyncio
import contextlib
import os
import sys
import threading
import time

import numpy as np
import pytest

from matryoshka2d.serve import batching as micro_batching
from matryoshka2d.serve.model_thread import MODEL_THREAD_NICENESS


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


def test_a_lone_request_never_waits_for_company_but_queued_ones_are_batched():
    """Issue 32, case 18: the micro-batch wait doubled a lone request's latency. With a wait of an hour, a lone
    request is still answered (nothing else is queued); requests already queued are batched together."""
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
    core: 99.8 ms with a 5 ms wait, 37.4 without; 2026-11-26). By default the measured costs decide (the server's,
    the command's and the batcher's default agree), and where a call's fixed cost is no larger than its texts' (here
    none is measured) the requests queued behind a busy call go together the moment it ends, though the call is far
    from full. (The latency objective is set far off: how large a call may grow is the next tests'.)"""
    import inspect

    from matryoshka2d.cli import build_parser
    from matryoshka2d.serve import ServerConfig

    limits = ServerConfig()
    serve_args = build_parser().parse_args(["serve", "--model", "m"])
    default = inspect.signature(micro_batching.MicroBatcher).parameters["max_wait"].default
    assert serve_args.max_wait_ms is limits.max_wait is default is None

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
        batcher = micro_batching.MicroBatcher(backend, limits.max_batch, limits.max_wait, target_ms=60_000.0)
        async with started(batcher):
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_model_runs_below_the_event_loop():
    """Under overload the event loop must get the core to read requests and refuse what is over the bound (429),
    not leave them unread in the socket backlog while the model holds the core: the model thread's nice value is
    the process's plus MODEL_THREAD_NICENESS, the event loop's is untouched."""

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
    assert backend.nice == min(19, loop_nice + MODEL_THREAD_NICENESS)


def test_the_drain_rate_counts_the_event_loops_time_between_calls():
    """ms_per_text (Retry-After, --max-queue-ms) is the wall time per text at which the queue drains: with the model
    taking 10 ms a call and the event loop busy 30 ms between calls, about 40 ms a text, not the model's 10."""

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


# -- the latency objective -----------------------------------------------------------------------------------------
class Synthetic(ReleasingBackend):
    """A backend whose call costs `fixed` + `per_text` x texts seconds (a sleep, which can only overrun), and which
    records every call's texts."""

    def __init__(self, fixed: float, per_text: float):
        super().__init__()
        self.fixed, self.per_text, self.calls = fixed, per_text, []

    def pooled(self, texts, layer, encoded=None):
        self.calls.append(len(texts))
        time.sleep(self.fixed + self.per_text * len(texts))
        return super().pooled(texts, layer, encoded)


def test_a_call_never_grows_past_the_latency_objective():
    """A call answers its texts together at its end: however many requests wait, a call takes no more than its
    measured cost fits in --target-ms (10 ms a text, 65 ms: at most 6 texts a call), and still takes several."""
    backend = Synthetic(fixed=0.0, per_text=0.010)

    async def flood():
        async with started(micro_batching.MicroBatcher(backend, max_batch=64, target_ms=65.0)) as batcher:
            replies = await asyncio.gather(*(batcher.encode([f"text {i}"], 2) for i in range(40)))
            return replies, batcher

    replies, batcher = asyncio.run(flood())
    assert len(replies) == 40 and all(r[0, 0] == 2 for r in replies)
    assert max(backend.calls) <= 6 and max(backend.calls) >= 2, backend.calls
    fixed, per_token = batcher.costs[2].line()  # what the batcher measured: about 10 ms a text of 4 tokens
    assert per_token * 4 >= 0.009 * 1000 and fixed < 10


def test_a_queue_that_waited_still_gets_calls_as_long_as_the_objective():
    """Requests that waited behind a long call are not served in smaller calls for it: the next call still takes
    what its measured cost fits in --target-ms (10 ms a text, 65 ms: 6 texts), not what is left of the target after
    the oldest's wait (35 ms waited: 3 texts), which cost throughput exactly when the queue grew."""
    backend = Synthetic(fixed=0.0, per_text=0.010)

    async def behind_a_long_call():
        async with started(micro_batching.MicroBatcher(backend, max_batch=64, target_ms=65.0)) as batcher:
            await batcher.encode(["warm"], 2)  # the cost of a call, measured
            long = asyncio.ensure_future(batcher.encode([f"long {i}" for i in range(4)], 2))  # 40 ms
            await asyncio.sleep(0.005)
            await asyncio.gather(long, *(batcher.encode([f"text {i}"], 2) for i in range(10)))

    asyncio.run(behind_a_long_call())
    # 6 texts fit the target at the nominal cost (5 where a loaded machine's sleeps overshoot it); the rule that
    # counted the oldest's wait takes at most 3
    assert backend.calls[:2] == [1, 4] and backend.calls[2] >= 5, backend.calls


def test_a_request_that_joins_a_queue_waits_for_its_whole_call_no_longer_than_the_target_or_max_batch():
    """What the deadline counts for a request's own call: alone, its texts; in a queue, the call it joins (texts
    after it join it too), at most the target, at most max_batch texts (--target-ms 100000 is not 100 s)."""
    batcher = micro_batching.MicroBatcher(ReleasingBackend(), max_batch=64, target_ms=50.0)
    batcher.ms_per_text = 2.0
    assert batcher.own_call_seconds(3, queued=False) == pytest.approx(0.006)
    assert batcher.own_call_seconds(3, queued=True) == pytest.approx(0.050)  # the target
    assert batcher.own_call_seconds(40, queued=True) == pytest.approx(0.080)  # its own texts
    batcher.target_ms = 100_000.0
    assert batcher.own_call_seconds(3, queued=True) == pytest.approx(0.128)  # 64 texts


def test_the_calls_cost_is_measured_as_a_line_in_its_tokens():
    """CallCost: calls of several sizes give the line through them; calls of one size only give the proportional
    line, which predicts a larger call no cheaper per token than the ones seen."""
    cost = micro_batching.CallCost()
    for tokens in (10, 40, 10, 80, 20):
        cost.observe(tokens, 2.0 + 0.25 * tokens)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(2.0) and per_token == pytest.approx(0.25)
    one_size = micro_batching.CallCost()
    for _ in range(3):
        one_size.observe(12, 6.0)
    assert one_size.line() == (0.0, 0.5) and one_size.predict(120) == pytest.approx(60.0)


def test_a_dense_stream_waits_to_fill_a_call_where_the_call_costs_more_than_its_texts():
    """Where a call's fixed cost is large (30 ms against 0.5 ms a text, as on a GPU) and requests arrive a
    millisecond apart, the first of a burst waits for company rather than run alone, once the batcher has measured
    the costs and the rate: calls are fuller. With --max-wait-ms 0 it runs alone. Calls of small fixed cost never
    wait (the tests above; a CPU)."""

    def bursts(max_wait):
        backend = Synthetic(fixed=0.030, per_text=0.0005)

        async def run():
            batcher = micro_batching.MicroBatcher(backend, max_batch=64, max_wait=max_wait, target_ms=500.0)
            async with started(batcher):
                for size in (1, 4, 1, 4):  # the costs, measured: calls of one text and of four
                    await asyncio.gather(*(batcher.encode([f"warm {i}"], 1) for i in range(size)))
                calls = []
                for _ in range(10):  # bursts of 8 requests a millisecond apart, then a pause
                    backend.calls.clear()
                    sent = []
                    for i in range(8):
                        sent.append(asyncio.ensure_future(batcher.encode([f"query {i}"], 1)))
                        await asyncio.sleep(0.001)
                    await asyncio.gather(*sent)
                    calls.append(list(backend.calls))
                    await asyncio.sleep(0.03)
            return calls

        return asyncio.run(run())

    never, measured = bursts(0.0), bursts(None)
    assert all(sum(burst) == 8 for burst in never + measured)
    assert all(burst[0] == 1 for burst in never)  # each burst's first request ran alone
    late = measured[5:]  # once the rate and the costs are measured
    assert all(min(burst) > 1 for burst in late), measured
