"""Micro-batching for the embeddings server (serve/engine.py): one worker thread runs the model; texts
that arrive while it is busy (and, when `max_wait` is set, within it of the first) go into the next batch (up to
`max_batch` texts; a larger request is one batch on its own), grouped by layer so that an exit at layer n still runs
n layers. A lone request never waits for company. Between batches and at rest the heap's free pages are given back
to the system.

Every model the server runs has a batcher of its own, and all of them hand their calls to one model thread
(`model_thread`), so the model calls of a ladder's rungs (serve/ladder.py) take the core in turns, as the ladder's
cost model adds them up. The queue's texts and tokens are counted as they come and go, for the bound on waiting work
(serve/admission.py), the ladder and the metrics; every model call is reported to the `observe` callback (its
texts, tokens and the model thread's CPU time), which refreshes the ladder's costs.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np

from matryoshka2d.allocator import trim_heap

# malloc_trim after every model call kept RSS flat under load but cost 6% of a (3,128) server's model time (CPU
# time per text, minilm-l6, batches of 256: 1.79 ms without, 1.91 ms with; docs/benchmarks.md, issue 19): the
# pages it gives back are faulted in again by the next batch. Trimmed at most this often under load, and
# whenever the queue runs dry, so a server at rest holds no more than after its warm-up.
TRIM_INTERVAL = 5.0  # seconds


# A batch takes what queued while the model was busy and does not wait for more by default, as Triton's dynamic
# batcher ("will not delay when forming batches" unless max_queue_delay is set). On a CPU a call's cost grows with
# its texts (minilm-l6 int8 at layer 6, one thread: 4.36 ms for one query, 4.31 ms a query in a call of 8), so
# grouping saves almost nothing, while every millisecond of waiting leaves the model idle with work in hand. The
# 5 ms wait used until 2026-11-26 more than doubled the tail at 82 SciFact queries a second (open loop, one core,
# benchmarks/serve_overload.py --capacity 164 --rates 0.5 --max-wait-ms 5, then 0: full depth p50 21.9 / p99 99.8
# ms with it, 9.5 / 37.4 ms without), and with adaptive depth (target 50 ms) it made the controller answer 8% of
# those requests at shallower layers; without it, none. `serve --max-wait-ms` sets one where a call's fixed cost is
# large (a GPU).
DEFAULT_MAX_WAIT = 0.0  # seconds


# The queue is empty between every two batches of a closed loop of clients (all of them wait for their replies,
# then send again), so an empty queue alone is not rest: trimming there released onnxruntime's arenas after
# every batch, to be grown again by the next. The server is at rest after this long without a request.
REST_AFTER = 0.5  # seconds


# The event loop first: on the core they share, the model thread runs at this much lower priority (a higher nice
# value) than the event loop, which reads requests, refuses what is over the bound and sends answers. At the same
# priority the kernel shares the core between them by turns, so under overload requests waited in the socket
# backlog, unread and unrefused, until their clients timed out: benchmarks/serve_overload.py at 3x full depth's
# capacity, one core, 2,760 429s and 26,927 timeouts in 60 s at the same priority, 7,660 429s and 2,567 timeouts
# in 20 s with the model 5 below; adaptive depth at 3x, 8,578 timeouts in 60 s before, none after (2026-11-26).
# The loop's work is short and comes in bursts, so it takes the core when it has some and the model keeps the rest.
MODEL_THREAD_NICENESS = 5


def _below_the_event_loop() -> None:
    """The model thread's initializer: lower its own priority (Linux: a thread's nice value is its own)."""
    thread = threading.get_native_id()
    with suppress(AttributeError, OSError):  # no setpriority (not POSIX), or not allowed: the priority stays
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + MODEL_THREAD_NICENESS)


def model_thread() -> ThreadPoolExecutor:
    """The one thread that runs every model call of a server, below the event loop's priority."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="matryoshka2d-model", initializer=_below_the_event_loop)


@dataclass
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


class MicroBatcher:
    """Collects concurrent requests into batches for the model thread.

    `name` labels this batcher's model in the metrics; `metrics` (serve/metrics.ServerMetrics) is told of every model
    call, and so is `observe(name, layer, texts, tokens, cpu_seconds)` (serve/ladder.Ladder.observe); `executor`:
    the model thread, shared by every batcher of a server (one of its own when not given)."""

    def __init__(self, backend, max_batch: int, max_wait: float, name: str = "model", metrics=None, observe=None,
                 executor: ThreadPoolExecutor | None = None):  # fmt: skip
        self.backend, self.max_batch, self.max_wait = backend, max_batch, max_wait
        self.name, self.metrics, self.observe = name, metrics, observe
        self.queue: deque[_Job] = deque()
        self._arrival: asyncio.Event | None = None
        self.queued_texts = self.queued_tokens = 0
        self._owns_executor = executor is None
        self.executor = executor if executor is not None else model_thread()
        self.batches = 0
        self.trims = 0
        # Wall time per text at which the queue drains, from recent calls: the time from the end of the call before
        # (or from its own start, when nothing waited) to the end of this one, so that what the event loop does on
        # the same core between calls counts too (under overload, reading and refusing requests takes a share of
        # the core the model call alone does not see). For --max-queue-ms and Retry-After.
        self.ms_per_text = 0.0
        self.model_ms_per_text = 0.0  # the model call's own time per text, recent calls (the ladder's backlog)
        self._draining_since: float | None = None
        self._running: tuple[int, float] | None = None  # the call in flight: its texts, and when it started
        self._running_since = 0.0  # when the last call was handed to the model thread
        self._call_ms = 0.0  # the last call's own time on the model thread
        self._trimmed_at, self._untrimmed = time.monotonic(), False
        self._task: asyncio.Task | None = None
        self.in_call = False  # the model thread is inside a model call (set and cleared on that thread)

    def start(self) -> None:
        self._arrival = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop taking batches. A model call in flight is not waited for (it cannot be interrupted, and a drain
        that waited for a call longer than --drain-seconds ended late): `in_call` says whether one still runs."""
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        if self._owns_executor:  # a shared model thread is shut down by the server that made it
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def encode(self, texts: list[str], layer: int, encoded: dict | None = None) -> np.ndarray:
        """Full-width vectors at `layer`, one row per text (`encoded`: the texts already tokenized)."""
        return (await self.answer(texts, layer, encoded))[0]

    async def answer(
        self, texts: list[str], layer: int, encoded: dict | None = None, timing: dict | None = None
    ) -> tuple[np.ndarray, int]:
        """Full-width vectors at `layer`, and the layer that made them. `timing`, when given, gets the request's
        phases in ms: `queue` (waiting for its call), `handoff` (to the model thread and back), `model`."""
        future = asyncio.get_running_loop().create_future()
        job = _Job(texts, layer, future, encoded, _tokens(texts, encoded), time.monotonic(), timing)
        self.queue.append(job)
        self.queued_texts += len(texts)
        self.queued_tokens += job.tokens
        self._arrival.set()
        return await future

    @property
    def in_flight(self) -> bool:
        """A model call of this batcher is handed to the model thread and not answered yet."""
        return self._running is not None

    def drain_seconds(self) -> float:
        """About how long the model needs for what waits now and for the rest of the call it is running: what a
        request that joins now waits before its own call starts (--max-queue-ms, and Retry-After of a refused
        request). A call answers its texts together at its end, and under load it takes everything that queued
        (up to max_batch texts), so leaving out the call in flight let in requests that waited up to twice the
        bound: at 3x the full depth's capacity with --max-queue-ms 1000, 1,947 of 2,043 accepted requests took 1 to
        2.5 s in the server (2026-11-27)."""
        running = 0.0
        if self._running is not None:
            texts, since = self._running
            running = max(0.0, texts * self.ms_per_text - 1000 * (time.monotonic() - since))
        return (self.queued_texts * self.ms_per_text + running) / 1000

    def _take(self) -> _Job:
        job = self.queue.popleft()
        self.queued_texts -= len(job.texts)
        self.queued_tokens -= job.tokens
        return job

    async def _next(self, timeout: float | None = None) -> _Job | None:
        """The oldest waiting job, waiting up to `timeout` seconds for one (forever when None)."""
        while not self.queue:
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), timeout)
            except TimeoutError:
                return None
        return self._take()

    async def _collect(self, first: _Job | None = None) -> list[_Job]:
        jobs = [first if first is not None else await self._next()]
        count = len(jobs[0].texts)
        if not self.queue:  # a lone request: waiting for company would only add max_wait to its latency
            return jobs
        deadline = asyncio.get_running_loop().time() + self.max_wait
        while count < self.max_batch:
            job = self._take() if self.queue else None  # whatever queued up while the model was busy
            if job is None:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                job = await self._next(remaining)
                if job is None:
                    break
            jobs.append(job)
            count += len(job.texts)
        return jobs

    @staticmethod
    def _plan(jobs: list[_Job]) -> dict[int, list[_Job]]:
        """The batch's jobs grouped by layer, groups in the order of their oldest job."""
        groups: dict[int, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.layer, []).append(job)
        return dict(sorted(groups.items(), key=lambda item: min(j.arrived for j in item[1])))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = None
            if self._untrimmed and not self.queue:
                first = await self._next(REST_AFTER)
                if first is None:  # at rest: give the heap's free pages back
                    await loop.run_in_executor(self.executor, self._trim, True)
            jobs = await self._collect(first)
            jobs = [j for j in jobs if not j.future.done()]  # a client that went away
            for layer, group in self._plan(jobs).items():
                texts = [t for job in group for t in job.texts]
                encoded = None
                if all(job.encoded is not None for job in group):
                    encoded = {k: [row for job in group for row in job.encoded[k]] for k in group[0].encoded}
                tokens = sum(job.tokens for job in group)
                since = self._draining_since if self._draining_since is not None else time.monotonic()
                self._running_since = time.monotonic()
                self._running = (len(texts), self._running_since)
                try:
                    vectors = await loop.run_in_executor(self.executor, self._encode, texts, layer, encoded, tokens)
                except Exception as exc:  # the model failed: every waiting request hears why
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                finally:
                    self._running = None
                now = time.monotonic()
                started, model_ms = self._running_since, self._call_ms
                start = 0
                for job in group:
                    if not job.future.done():
                        if job.timing is not None:
                            job.timing["queue"] = 1000 * (started - job.arrived)
                            job.timing["handoff"] = max(0.0, 1000 * (now - started) - model_ms)
                            job.timing["model"] = model_ms
                        job.future.set_result((vectors[start : start + len(job.texts)], layer))
                    start += len(job.texts)
                per_text = 1000 * (now - since) / len(texts)
                self.ms_per_text = 0.8 * self.ms_per_text + 0.2 * per_text if self.batches else per_text
                self._draining_since = now if self.queue else None
                self.batches += 1

    def _encode(self, texts: list[str], layer: int, encoded: dict | None = None, tokens: int = 0) -> np.ndarray:
        start, cpu = time.perf_counter(), time.thread_time()
        self.in_call = True
        try:
            vectors = self.backend.pooled(texts, layer, encoded)
        finally:
            self.in_call = False
        seconds = time.perf_counter() - start
        self._call_ms = 1000 * seconds
        per_text = 1000 * seconds / max(1, len(texts))
        self.model_ms_per_text += (1.0 if self.model_ms_per_text == 0 else 0.2) * (per_text - self.model_ms_per_text)
        if self.observe is not None:
            self.observe(self.name, layer, len(texts), tokens, time.thread_time() - cpu, 1000 * seconds)
        if self.metrics is not None:
            self.metrics.model_call(self.name, layer, len(texts), seconds)
        self._untrimmed = True
        if time.monotonic() - self._trimmed_at >= TRIM_INTERVAL:
            self._trim()
        return vectors

    def _trim(self, at_rest: bool = False) -> None:
        """Free pages back to the system (matryoshka2d.allocator); at rest, also what the backend keeps for itself
        under load (onnxruntime's arenas). Runs on the model thread."""
        release = getattr(self.backend, "release_memory", None)
        if at_rest and release is not None:
            release()
        trim_heap()
        self.trims += 1
        self._trimmed_at, self._untrimmed = time.monotonic(), False
