"""The one thread that runs every model call of a server, below the event loop's priority, and the hand-off to it.

Every model the server runs (the model, its query encoders: serve/engine.py) hands its calls to one `ModelThread`, so
the calls of a ladder's rungs (serve/ladder.py) take the core in turns, as the ladder's cost model adds them up.

The hand-off is one queue put and, for the answer, one `call_soon_threadsafe` that settles an asyncio future on the
event loop. `loop.run_in_executor` (a ThreadPoolExecutor, a concurrent future, and wrap_future chaining it to an
asyncio one) took 37-60 us a call against 24 us for this on an idle core (uvloop, a call that returns at once,
median of 5 rounds of 2,000, 2026-11-29): the hand-off is on every request's path.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

# The event loop first: on the core they share, the model thread runs at this much lower priority (a higher nice
# value) than the event loop, which reads requests, refuses what is over the bound and sends answers. At the same
# priority the kernel shares the core between them by turns, so under overload requests waited in the socket
# backlog, unread and unrefused, until their clients timed out: benchmarks/serve_overload.py at 3x full depth's
# capacity, one core, 2,760 429s and 26,927 timeouts in 60 s at the same priority, 7,660 429s and 2,567 timeouts
# in 20 s with the model 5 below; adaptive depth at 3x, 8,578 timeouts in 60 s before, none after (2026-11-26).
# The loop's work is short and comes in bursts, so it takes the core when it has some and the model keeps the rest.
MODEL_THREAD_NICENESS = 5


def below_the_event_loop() -> None:
    """Lower the calling thread's own priority (Linux: a thread's nice value is its own)."""
    thread = threading.get_native_id()
    with suppress(AttributeError, OSError):  # no setpriority (not POSIX), or not allowed: the priority stays
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + MODEL_THREAD_NICENESS)


def _settle(future: asyncio.Future, value: Any, failed: bool) -> None:
    """On the event loop: the call's answer into its future, unless nobody waits for it any more."""
    if future.done():  # cancelled: the request was cut, or the batcher stopped
        return
    if failed:
        future.set_exception(value)
    else:
        future.set_result(value)


class ModelThread:
    """One thread, started at its first call, that runs the calls handed to it one after another, below the event
    loop's priority (MODEL_THREAD_NICENESS)."""

    def __init__(self, name: str = "matryoshka2d-model"):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self, loop: asyncio.AbstractEventLoop, call: Callable, *args) -> asyncio.Future:
        """`call(*args)` on the model thread, after the calls handed over before it: a future of `loop` that gets
        its result (or its exception)."""
        if self._thread is None:
            self.start()
        future = loop.create_future()
        if self._closed:
            future.set_exception(RuntimeError("the model thread is shut down"))
            return future
        self._calls.put((loop, future, call, args))
        return future

    def start(self) -> None:
        """Start the thread, if it has not started yet (a call starts it too)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        below_the_event_loop()
        while True:
            item = self._calls.get()
            if item is None:
                return
            loop, future, call, args = item
            if future.done():  # cancelled before it started (a stopped batcher): nobody takes its answer
                continue
            try:
                value, failed = call(*args), False
            except Exception as exc:  # the caller hears why, on the loop
                value, failed = exc, True
            with suppress(RuntimeError):  # the loop is closed (the server stopped): nobody takes the answer
                loop.call_soon_threadsafe(_settle, future, value, failed)

    def shutdown(self) -> None:
        """Take no more calls; the one running (it cannot be interrupted) ends on its own, its answer dropped."""
        self._closed = True
        with suppress(Exception):
            while True:  # calls not started yet are dropped
                self._calls.get_nowait()
        self._calls.put(None)
