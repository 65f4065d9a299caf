"""Micro-batching for the embeddings server (matryoshka2d.deploy.server): one worker thread runs the model; texts
that arrive while it is busy, or within `max_wait` of the first, go into the next batch (up to `max_batch` texts; a
larger request is one batch on its own), grouped by layer so that an exit at layer n still runs n layers. A lone
request never waits for company. Between batches and at rest the heap's free pages are given back to the system.
"""

from __future__ import annotations

import asyncio
import time
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


# The queue is empty between every two batches of a closed loop of clients (all of them wait for their replies,
# then send again), so an empty queue alone is not rest: trimming there released onnxruntime's arenas after
# every batch, to be grown again by the next. The server is at rest after this long without a request.
REST_AFTER = 0.5  # seconds


@dataclass
class _Job:
    texts: list[str]
    layer: int
    future: asyncio.Future = field(repr=False)
    encoded: dict | None = field(default=None, repr=False)  # the texts' token ids, when the endpoint made them


class MicroBatcher:
    """Collects concurrent requests into batches for one model worker thread."""

    def __init__(self, backend, max_batch: int, max_wait: float):
        self.backend, self.max_batch, self.max_wait = backend, max_batch, max_wait
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="matryoshka2d-model")
        self.batches = 0
        self.trims = 0
        self._trimmed_at, self._untrimmed = time.monotonic(), False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=True)

    async def encode(self, texts: list[str], layer: int, encoded: dict | None = None) -> np.ndarray:
        """Full-width vectors at `layer`, one row per text (`encoded`: the texts already tokenized)."""
        future = asyncio.get_running_loop().create_future()
        await self.queue.put(_Job(texts, layer, future, encoded))
        return await future

    async def _collect(self, first: _Job | None = None) -> list[_Job]:
        jobs = [first if first is not None else await self.queue.get()]
        count = len(jobs[0].texts)
        if self.queue.empty():  # a lone request: waiting for company would only add max_wait to its latency
            return jobs
        deadline = asyncio.get_running_loop().time() + self.max_wait
        while count < self.max_batch:
            try:
                job = self.queue.get_nowait()  # whatever queued up while the model was busy
            except asyncio.QueueEmpty:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), remaining)
                except TimeoutError:
                    break
            jobs.append(job)
            count += len(job.texts)
        return jobs

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = None
            if self._untrimmed and self.queue.empty():
                try:
                    first = await asyncio.wait_for(self.queue.get(), REST_AFTER)
                except TimeoutError:  # at rest: give the heap's free pages back
                    await loop.run_in_executor(self.executor, self._trim, True)
            jobs = await self._collect(first)
            jobs = [j for j in jobs if not j.future.done()]  # a client that went away
            by_layer: dict[int, list[_Job]] = {}
            for job in jobs:
                by_layer.setdefault(job.layer, []).append(job)
            for layer, group in by_layer.items():
                texts = [t for job in group for t in job.texts]
                encoded = None
                if all(job.encoded is not None for job in group):
                    encoded = {k: [row for job in group for row in job.encoded[k]] for k in group[0].encoded}
                try:
                    vectors = await loop.run_in_executor(self.executor, self._encode, texts, layer, encoded)
                except Exception as exc:  # the model failed: every waiting request hears why
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                start = 0
                for job in group:
                    if not job.future.done():
                        job.future.set_result(vectors[start : start + len(job.texts)])
                    start += len(job.texts)
                self.batches += 1

    def _encode(self, texts: list[str], layer: int, encoded: dict | None = None) -> np.ndarray:
        vectors = self.backend.pooled(texts, layer, encoded)
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
