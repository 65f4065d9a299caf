"""Micro-batching for the embeddings server (matryoshka2d.deploy.server): one worker thread runs the model; texts
that arrive while it is busy (and, when `max_wait` is set, within it of the first) go into the next batch (up to
`max_batch` texts; a larger request is one batch on its own), grouped by layer so that an exit at layer n still runs
n layers. A lone request never waits for company. Between batches and at rest the heap's free pages are given back
to the system.

A request may leave its layer open (adaptive depth, deploy/depth.py): the batcher asks the depth controller for the
layer of each batch of such requests, from what waits now, and tells each request the layer that answered it. The
queue's texts and tokens are counted as they come and go, for the controller, the bound on waiting work
(deploy/admission.py) and the metrics; every model call's time refreshes the controller's cost model.
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
from matryoshka2d.deploy.depth import Demand, Work

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


@dataclass
class _Job:
    texts: list[str]
    layer: int | None  # None: adaptive, the depth controller chooses
    future: asyncio.Future = field(repr=False)
    encoded: dict | None = field(default=None, repr=False)  # the texts' token ids, when the endpoint made them
    tokens: int = 0
    arrived: float = 0.0  # time.monotonic() when queued


def _tokens(texts: list[str], encoded: dict | None) -> int:
    """Tokens of the texts: counted by the endpoint's tokenizer when it ran, else about a token per word."""
    if encoded is not None:
        return sum(len(ids) for ids in encoded["input_ids"])
    return sum(len(t.split()) + 2 for t in texts)


class MicroBatcher:
    """Collects concurrent requests into batches for one model worker thread.

    `name` labels this batcher's model in the metrics; `controller` (a DepthController) answers requests whose layer
    is None; `metrics` (deploy/metrics.ServerMetrics) is told of every model call."""

    def __init__(self, backend, max_batch: int, max_wait: float, name: str = "model", controller=None, metrics=None):
        self.backend, self.max_batch, self.max_wait = backend, max_batch, max_wait
        self.name, self.controller, self.metrics = name, controller, metrics
        # what the arrivals ask of the model at full depth, for the controller (None without one)
        self.demand = Demand(controller.cost, controller.layers[-1]) if controller is not None else None
        self.queue: deque[_Job] = deque()
        self._arrival: asyncio.Event | None = None
        self.queued_texts = self.queued_tokens = 0
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="matryoshka2d-model", initializer=_below_the_event_loop
        )
        self.batches = 0
        self.trims = 0
        # Wall time per text at which the queue drains, from recent calls: the time from the end of the call before
        # (or from its own start, when nothing waited) to the end of this one, so that what the event loop does on
        # the same core between calls counts too (under overload, reading and refusing requests takes a share of
        # the core the model call alone does not see). For --max-queue-ms and Retry-After.
        self.ms_per_text = 0.0
        self._draining_since: float | None = None
        self._running: tuple[int, float] | None = None  # the call in flight: its texts, and when it started
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
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def encode(self, texts: list[str], layer: int, encoded: dict | None = None) -> np.ndarray:
        """Full-width vectors at `layer`, one row per text (`encoded`: the texts already tokenized)."""
        return (await self.answer(texts, layer, encoded))[0]

    async def answer(self, texts: list[str], layer: int | None, encoded: dict | None = None) -> tuple[np.ndarray, int]:
        """Full-width vectors, and the layer that made them: `layer`, or the depth controller's choice when None."""
        if layer is None and self.controller is None:
            raise ValueError("a request without a layer needs a depth controller (serve --adaptive-depth)")
        future = asyncio.get_running_loop().create_future()
        job = _Job(texts, layer, future, encoded, _tokens(texts, encoded), time.monotonic())
        self.queue.append(job)
        self.queued_texts += len(texts)
        self.queued_tokens += job.tokens
        if self.demand is not None:
            self.demand.add(job.arrived, len(texts), job.tokens, layer)
        self._arrival.set()
        return await future

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

    def _backlog(self, now: float) -> Work:
        if not self.queue:
            return Work()
        return Work(self.queued_texts, self.queued_tokens, 1000 * (now - self.queue[0].arrived))

    def _plan(self, jobs: list[_Job]) -> dict[int, list[_Job]]:
        """The batch's jobs grouped by the layer that runs them, adaptive ones at the controller's choice (joined to
        a fixed group of the same layer), groups in the order of their oldest job."""
        fixed: dict[int, list[_Job]] = {}
        adaptive = []
        for job in jobs:
            (adaptive if job.layer is None else fixed.setdefault(job.layer, [])).append(job)
        if adaptive:
            now = time.monotonic()
            cost = self.controller.cost
            fixed_ms = sum(cost.predict(n, sum(j.tokens for j in g)) for n, g in fixed.items() if n in cost.layers)
            batch = Work(
                sum(len(j.texts) for j in adaptive), sum(j.tokens for j in adaptive), 1000 * (now - adaptive[0].arrived)
            )
            demand = self.demand.share(now)
            layer = self.controller.choose(batch, self._backlog(now), fixed_ms, demand)
            if self.metrics is not None:
                self.metrics.depth_choices.labels(str(layer)).inc()
                self.metrics.demand.labels(self.name).set(demand)
            for job in adaptive:
                job.layer = layer
            fixed.setdefault(layer, []).extend(adaptive)
        return dict(sorted(fixed.items(), key=lambda item: min(j.arrived for j in item[1])))

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
                self._running = (len(texts), time.monotonic())
                try:
                    vectors = await loop.run_in_executor(self.executor, self._encode, texts, layer, encoded, tokens)
                except Exception as exc:  # the model failed: every waiting request hears why
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                finally:
                    self._running = None
                start = 0
                for job in group:
                    if not job.future.done():
                        job.future.set_result((vectors[start : start + len(job.texts)], layer))
                    start += len(job.texts)
                now = time.monotonic()
                per_text = 1000 * (now - since) / len(texts)
                self.ms_per_text = 0.8 * self.ms_per_text + 0.2 * per_text if self.batches else per_text
                self._draining_since = now if self.queue else None
                self.batches += 1

    def _encode(self, texts: list[str], layer: int, encoded: dict | None = None, tokens: int = 0) -> np.ndarray:
        start = time.perf_counter()
        self.in_call = True
        try:
            vectors = self.backend.pooled(texts, layer, encoded)
        finally:
            self.in_call = False
        seconds = time.perf_counter() - start
        if self.controller is not None:
            self.controller.cost.observe(layer, tokens, 1000 * seconds)
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
