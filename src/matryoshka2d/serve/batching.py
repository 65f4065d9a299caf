"""Micro-batching for the embeddings server (serve/engine.py), to a latency objective: one model thread
(serve/model_thread.py) runs the calls; texts that arrive while it is busy go into the next call (up to `max_batch`
texts; a larger request is one call on its own), grouped by layer so that an exit at layer n still runs n layers.
Between calls and at rest the heap's free pages are given back to the system.

How large a call grows: never past `target_ms` (`serve --target-ms`, the server's latency objective) of predicted
time. A call answers its texts together at its end, and a request that arrives while one runs waits for it and then
for its own: calls of at most the target keep that within twice the target. A call takes queued requests, oldest
first, while its predicted time stays within the target. (Shrinking a call so that its oldest request is answered
within the target, the rule first tried, cost throughput exactly when the queue grew: capacity at p99 <= 100 ms
288.7 and 300.8 requests/s against 307.1 and 309.8 with this rule, in turns on one core, minilm-l6 int8, SciFact
queries, 2026-11-29.) The prediction is the batcher's own running measure of each layer's calls (`CallCost`: ms =
fixed + per token x tokens, fitted on recent calls); until a layer has one, its call takes one request.

Whether a call waits for company: a lone request never waits, nor does any while arrivals are sparse. A call that
waits `w` for the `rate x w` texts that arrive meanwhile spends `w` of the model's time to save the fixed cost of the
call those texts would otherwise make; per text it pays while the texts in hand are fewer than the texts that arrive
during one fixed cost (`rate x fixed`), so a call waits while that holds, for at most one fixed cost and within the
target (`worth_waiting`). On this machine's CPU a call's fixed cost is small next to a text's (minilm-l6 int8 at
full depth: about 2 ms a call, 5 ms a text), so a call never waits here, as measured: a fixed 5 ms wait more than
doubled the tail at 82 SciFact queries a second (full depth p99 99.8 ms with it, 37.4 without; benchmarks/
serve_overload.py, 2026-11-26). Where a call's fixed cost is large (a GPU) it does. `serve --max-wait-ms` caps the
wait (0: never).

The queue's texts and tokens are counted as they come and go, for the bound on waiting work (serve/admission.py),
the ladder and the metrics; every model call is reported to the `observe` callback (its texts, tokens and the model
thread's CPU time), which refreshes the ladder's costs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np

from matryoshka2d.allocator import trim_heap
from matryoshka2d.serve.depth import REFRESH
from matryoshka2d.serve.model_thread import ModelThread

# malloc_trim after every model call kept RSS flat under load but cost 6% of a (3,128) server's model time (CPU
# time per text, minilm-l6, batches of 256: 1.79 ms without, 1.91 ms with; docs/benchmarks.md, issue 19): the
# pages it gives back are faulted in again by the next batch. Trimmed at most this often under load, and
# whenever the queue runs dry, so a server at rest holds no more than after its warm-up.
TRIM_INTERVAL = 5.0  # seconds

# The queue is empty between every two batches of a closed loop of clients (all of them wait for their replies,
# then send again), so an empty queue alone is not rest: trimming there released onnxruntime's arenas after
# every batch, to be grown again by the next. The server is at rest after this long without a request.
REST_AFTER = 0.5  # seconds

# The arrival rate is an exponentially decaying count of texts over this many seconds, as the ladder measures its
# own (serve/ladder.py RATE_WINDOW: a tenth of a second of Poisson arrivals varies by a third).
RATE_WINDOW = 1.0  # seconds

# The latency objective a server keeps unless told otherwise (`serve --target-ms`). A request waits at most for the
# call in flight and then for its own, so calls of at most 50 ms keep a request within 100 ms, the p99 objective
# the project's load benchmarks hold servers to (benchmarks/serve_capacity.py --slo-ms); the ladder of adaptive
# depth was measured at 50 too (docs/serving.md).
DEFAULT_TARGET_MS = 50.0


class CallCost:
    """ms of one model call at one layer, as a line in its tokens (fixed + per_token x tokens), by least squares
    over recent calls, each weighted REFRESH more than the one before it. Calls of one size only (or a line that
    does not rise) give the proportional line through their mean. Past the largest call measured, a call is
    predicted no cheaper per token than that one: a line fitted on small calls says little of larger ones (a noisy
    call of one text, fitted with calls of three, let a call of 8 texts at 10 ms a text under a target of 65 ms), so
    calls grow only as far as measured calls show they may."""

    def __init__(self):
        self.weight = self.tokens = self.ms = self.tokens2 = self.products = 0.0
        self.largest = 0.0  # the most tokens of a call measured

    def observe(self, tokens: float, ms: float) -> None:
        if not (math.isfinite(ms) and ms >= 0 and tokens > 0):
            return
        self.largest = max(self.largest, tokens)
        keep = 1.0 - REFRESH
        self.weight = keep * self.weight + 1.0
        self.tokens = keep * self.tokens + tokens
        self.ms = keep * self.ms + ms
        self.tokens2 = keep * self.tokens2 + tokens * tokens
        self.products = keep * self.products + tokens * ms

    @property
    def known(self) -> bool:
        return self.weight > 0

    def line(self) -> tuple[float, float]:
        """(fixed ms, ms per token)."""
        mean_tokens, mean_ms = self.tokens / self.weight, self.ms / self.weight
        spread = self.tokens2 / self.weight - mean_tokens * mean_tokens
        if spread > 1e-9 * mean_tokens * mean_tokens:
            per_token = (self.products / self.weight - mean_tokens * mean_ms) / spread
            fixed = mean_ms - per_token * mean_tokens
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, mean_ms / mean_tokens

    def predict(self, tokens: float) -> float:
        fixed, per_token = self.line()
        if tokens > self.largest:
            return (fixed + per_token * self.largest) * tokens / self.largest
        return fixed + per_token * tokens


class ArrivalRate:
    """Texts a millisecond: an exponentially decaying count over RATE_WINDOW, divided by what that count holds of a
    steady rate (RATE_WINDOW x (1 - e^(-t / RATE_WINDOW)), t since the first arrival), so that the first second of
    a server is measured at its own rate, not as a tenth of it."""

    def __init__(self):
        self._count, self._at, self._first = 0.0, 0.0, None

    def arrived(self, now: float, texts: int) -> None:
        if self._first is None:
            self._first = now
        self._count = self._count * math.exp((self._at - now) / RATE_WINDOW) + texts
        self._at = now

    def per_ms(self, now: float) -> float:
        if self._first is None:
            return 0.0
        held = RATE_WINDOW * -math.expm1(-max(now - self._first, 1e-3) / RATE_WINDOW)
        return self._count * math.exp((self._at - now) / RATE_WINDOW) / (1000 * held)


@dataclass(slots=True)
class _Job:
    texts: list[str]
    layer: int
    future: asyncio.Future = field(repr=False)
    encoded: dict | None = field(default=None, repr=False)  # the texts' token ids, when the endpoint made them
    tokens: int = 0
    arrived: float = 0.0  # time.monotonic() when queued
    timing: dict | None = field(default=None, repr=False)  # filled with its phases' ms when given (engine.py)


def _tokens(texts: list[str], encoded: dict | None) -> int:
    """Tokens of the texts: counted by the endpoint's tokenizer when it ran, else about a token per word."""
    if encoded is not None:
        return sum(len(ids) for ids in encoded["input_ids"])
    return sum(len(t.split()) + 2 for t in texts)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def worth_waiting(texts: int, rate: float, fixed_ms: float) -> bool:
    """Whether a call holding `texts` texts gains by waiting for more, `rate` texts arriving a millisecond and a
    call costing `fixed_ms` whatever its size (see the module's docstring)."""
    return rate * fixed_ms > texts


class MicroBatcher:
    """Collects concurrent requests into calls of the model thread, within the latency objective.

    `target_ms`: the objective (see the module's docstring); `max_wait`: the most seconds a call waits for company
    (None: as long as the measured costs say it pays); `name` labels this batcher's model in the metrics; `metrics`
    (serve/metrics.ServerMetrics) is told of every model call, and so is `observe(name, layer, texts, tokens,
    cpu_seconds, ms)` (serve/ladder.Ladder.observe); `thread`: the model thread, shared by every batcher of a server
    (one of its own when not given)."""

    def __init__(self, backend, max_batch: int, max_wait: float | None = None, name: str = "model", metrics=None,
                 observe=None, thread: ModelThread | None = None, target_ms: float = DEFAULT_TARGET_MS):  # fmt: skip
        self.backend, self.max_batch, self.max_wait, self.target_ms = backend, max_batch, max_wait, target_ms
        self.name, self.metrics, self.observe = name, metrics, observe
        self.queue: deque[_Job] = deque()
        self.queued_texts = self.queued_tokens = 0
        self._owns_thread = thread is None
        self.thread = thread if thread is not None else ModelThread()
        self.costs: dict[int, CallCost] = {}  # by layer: the running measure of its calls
        self.arrivals = ArrivalRate()
        self.batches = self.trims = 0
        # Wall time per text at which the queue drains, from recent calls: the time from the end of the call before
        # (or from its own start, when nothing waited) to the end of this one, so that what the event loop does on
        # the same core between calls counts too (under overload, reading and refusing requests takes a share of
        # the core the model call alone does not see). For --max-queue-ms and Retry-After.
        self.ms_per_text = 0.0
        self.model_ms_per_text = 0.0  # the model call's own time per text, recent calls (the ladder's backlog)
        self._draining_since: float | None = None
        self._running: tuple[int, float, float] | None = None  # the call in flight: texts, start, predicted ms
        self._trimmed_at, self._untrimmed = time.monotonic(), False
        self._task: asyncio.Task | None = None
        self._waiter: asyncio.Future | None = None  # set while the batcher waits for a request
        self.in_call = False  # the model thread is inside a model call (set and cleared on that thread)

    def start(self) -> None:
        self.thread.start()  # now, not at the first call: that call's time is the cost the batcher measures
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop taking batches. A model call in flight is not waited for (it cannot be interrupted, and a drain
        that waited for a call longer than --drain-seconds ended late): `in_call` says whether one still runs."""
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        if self._owns_thread:  # a shared model thread is shut down by the server that made it
            self.thread.shutdown()

    def submit(self, texts: list[str], layer: int, encoded: dict | None = None, timing: dict | None = None):
        """Queue `texts` for a call at `layer` (`encoded`: the texts already tokenized): a future of (full-width
        vectors, the layer that made them). `timing`, when given, gets the request's phases in ms: `queue` (waiting
        for its call), `handoff` (to the model thread and back), `model`. Cancelling the future skips the texts."""
        now = time.monotonic()
        future = asyncio.get_running_loop().create_future()
        job = _Job(texts, layer, future, encoded, _tokens(texts, encoded), now, timing)
        self.queue.append(job)
        self.queued_texts += len(texts)
        self.queued_tokens += job.tokens
        self.arrivals.arrived(now, len(texts))
        if self._waiter is not None:
            _wake(self._waiter)
        return future

    async def answer(self, texts, layer: int, encoded=None, timing=None) -> tuple[np.ndarray, int]:
        """`submit`'s answer, awaited."""
        return await self.submit(texts, layer, encoded, timing)

    async def encode(self, texts: list[str], layer: int, encoded: dict | None = None) -> np.ndarray:
        """Full-width vectors at `layer`, one row per text (`encoded`: the texts already tokenized)."""
        return (await self.answer(texts, layer, encoded))[0]

    @property
    def in_flight(self) -> bool:
        """A model call of this batcher is handed to the model thread and not answered yet."""
        return self._running is not None

    def predict_ms(self, layer: int, tokens: float) -> float | None:
        """The model's ms for a call of `tokens` tokens at `layer`, by its recent calls (None before any)."""
        cost = self.costs.get(layer)
        return cost.predict(tokens) if cost is not None and cost.known else None

    def drain_seconds(self) -> float:
        """About how long the model needs for what waits now and for the rest of the call it is running: what a
        request that joins now waits before its own call starts (--max-queue-ms, and Retry-After of a refused
        request). A call answers its texts together at its end, so leaving out the call in flight let in requests
        that waited up to twice the bound: at 3x the full depth's capacity with --max-queue-ms 1000, 1,947 of
        2,043 accepted requests took 1 to 2.5 s in the server (2026-11-27)."""
        running = 0.0
        if self._running is not None:
            texts, since, predicted = self._running
            expected = predicted if predicted else texts * self.ms_per_text
            running = max(0.0, expected - 1000 * (time.monotonic() - since))
        return (self.queued_texts * self.ms_per_text + running) / 1000

    def own_call_seconds(self, texts: int, queued: bool) -> float:
        """About how long a request of `texts` texts waits for its own call once that call starts: its texts at the
        recent time per text, or, when it joins a queue (`queued`), the whole call it will be part of, which also
        takes what queues after it, up to the target and to max_batch texts (a call answers its texts at its end)."""
        own = texts * self.ms_per_text
        if queued:
            own = max(own, min(self.target_ms, self.max_batch * self.ms_per_text))
        return own / 1000

    def _take(self) -> _Job:
        job = self.queue.popleft()
        self.queued_texts -= len(job.texts)
        self.queued_tokens -= job.tokens
        return job

    async def _arrival(self, timeout: float | None) -> bool:
        """Wait until a request is queued, at most `timeout` seconds (forever when None): whether one is."""
        if self.queue:
            return True
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake, waiter) if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return bool(self.queue)

    async def _collect(self) -> list[_Job]:
        """The next call's requests: the oldest, then what fits the latency objective (see the module's docstring),
        waiting for company only where it pays."""
        first = self._take()
        jobs, texts = [first], len(first.texts)
        tokens = {first.layer: first.tokens}
        ms = self.predict_ms(first.layer, first.tokens)
        if ms is None:  # no call of this layer measured yet: one request, to measure it
            return jobs
        waited_since = time.monotonic()
        while texts < self.max_batch:
            if self.queue:
                job = self.queue[0]
                layer_tokens = tokens.get(job.layer, 0) + job.tokens
                before = self.predict_ms(job.layer, tokens[job.layer]) if job.layer in tokens else 0.0
                after = self.predict_ms(job.layer, layer_tokens)
                if after is None or ms - before + after > self.target_ms:
                    break
                jobs.append(self._take())
                tokens[job.layer], ms, texts = layer_tokens, ms - before + after, texts + len(job.texts)
                continue
            wait = self._wait_seconds(first, texts, ms, waited_since)
            if wait <= 0 or not await self._arrival(wait):
                break
        return jobs

    def _wait_seconds(self, first: _Job, texts: int, ms: float, since: float) -> float:
        """How much longer the call of `first` (`texts` texts, `ms` predicted, collecting since `since`) waits for
        company: 0 unless it pays (`worth_waiting`), and never past one fixed cost, the target or --max-wait-ms."""
        if self.max_wait == 0:
            return 0.0
        now = time.monotonic()
        fixed, _ = self.costs[first.layer].line()
        if not worth_waiting(texts, self.arrivals.per_ms(now), fixed):
            return 0.0
        waited = 1000 * (now - since)
        room = min(fixed - waited, self.target_ms - 1000 * (now - first.arrived) - ms)
        if self.max_wait is not None:
            room = min(room, 1000 * self.max_wait - waited)
        return max(0.0, room) / 1000

    @staticmethod
    def _groups(jobs: list[_Job]) -> list[tuple[int, list[_Job]]]:
        """The call's jobs grouped by layer, groups in the order of their oldest job (already the jobs' order)."""
        layer = jobs[0].layer
        if all(job.layer == layer for job in jobs):
            return [(layer, jobs)]
        groups: dict[int, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.layer, []).append(job)
        return list(groups.items())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.queue:
                if self._untrimmed and not await self._arrival(REST_AFTER):  # at rest: give the heap's pages back
                    await self.thread.run(loop, self._trim, True)
                    continue
                await self._arrival(None)
            jobs = [job for job in await self._collect() if not job.future.done()]  # done: a client that left
            for layer, group in self._groups(jobs) if jobs else ():
                await self._call(loop, layer, group)

    async def _call(self, loop: asyncio.AbstractEventLoop, layer: int, group: list[_Job]) -> None:
        """One model call for `group`: its answers handed to each job first, then (off their path, once they have
        run) the running measures, the metrics and the ladder told, and the heap trimmed when it is due."""
        if len(group) == 1:
            texts, encoded = group[0].texts, group[0].encoded
        else:
            texts = [t for job in group for t in job.texts]
            encoded = None
            if all(job.encoded is not None for job in group):
                encoded = {k: [row for job in group for row in job.encoded[k]] for k in group[0].encoded}
        tokens = sum(job.tokens for job in group)
        started = time.monotonic()
        since = self._draining_since if self._draining_since is not None else started
        self._running = (len(texts), started, self.predict_ms(layer, tokens) or 0.0)
        try:
            vectors, seconds, cpu_seconds = await self.thread.run(loop, self._encode, texts, layer, encoded)
        except Exception as exc:  # the model failed: every waiting request hears why
            for job in group:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        finally:
            self._running = None
        now = time.monotonic()
        call_ms, model_ms = 1000 * (now - started), 1000 * seconds
        start = 0
        for job in group:
            if not job.future.done():
                if job.timing is not None:
                    job.timing["queue"] = 1000 * (started - job.arrived)
                    job.timing["handoff"] = max(0.0, call_ms - model_ms)
                    job.timing["model"] = model_ms
                job.future.set_result((vectors[start : start + len(job.texts)], layer))
            start += len(job.texts)
        self._draining_since = now if self.queue else None
        await asyncio.sleep(0)  # the requests answered go first: what follows is not on their path
        self.costs.setdefault(layer, CallCost()).observe(tokens, call_ms)
        per_text = 1000 * (now - since) / len(texts)
        self.ms_per_text = 0.8 * self.ms_per_text + 0.2 * per_text if self.batches else per_text
        per_text = model_ms / len(texts)
        self.model_ms_per_text += (1.0 if self.model_ms_per_text == 0 else 0.2) * (per_text - self.model_ms_per_text)
        self.batches += 1
        if self.observe is not None:
            self.observe(self.name, layer, len(texts), tokens, cpu_seconds, model_ms)
        if self.metrics is not None:
            self.metrics.model_call(self.name, layer, len(texts), seconds)
        self._untrimmed = True
        if time.monotonic() - self._trimmed_at >= TRIM_INTERVAL:
            await self.thread.run(loop, self._trim)

    def _encode(self, texts: list[str], layer: int, encoded: dict | None) -> tuple[np.ndarray, float, float]:
        """The model call, on the model thread, and nothing else: (vectors, seconds, the thread's CPU seconds)."""
        start, cpu = time.perf_counter(), time.thread_time()
        self.in_call = True
        try:
            vectors = self.backend.pooled(texts, layer, encoded)
        finally:
            self.in_call = False
        return vectors, time.perf_counter() - start, time.thread_time() - cpu

    def _trim(self, at_rest: bool = False) -> None:
        """Free pages back to the system (matryoshka2d.allocator); at rest, also what the backend keeps for itself
        under load (onnxruntime's arenas). Runs on the model thread."""
        release = getattr(self.backend, "release_memory", None)
        if at_rest and release is not None:
            release()
        trim_heap()
        self.trims += 1
        self._trimmed_at, self._untrimmed = time.monotonic(), False
