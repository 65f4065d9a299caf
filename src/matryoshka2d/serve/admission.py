"""What lets a request into the embeddings server, in front of every route: the API key, the drain on SIGTERM,
and the bound on waiting work.

- API key (`serve --api-key KEY`, or the MATRYOSHKA2D_API_KEY environment variable): every route but `/health` needs
  `Authorization: Bearer KEY`, else 401 in OpenAI's error shape (as text-embeddings-inference and infinity answer).
  The key is compared in constant time and never written anywhere: not in a message, not in a log line.
  The key is checked when the server starts: one with surrounding whitespace (the newline a key file ends with),
  an empty one, or one holding a character outside printable ASCII is refused there, naming where it came from,
  since no client could send it in a header and the server would refuse every request.
- Drain: once SIGTERM or SIGINT (Ctrl-C) arrives the server answers every new request 503 with `Connection:
  close` (`/health` included, so a load balancer takes the replica out) while its port stays open, finishes what
  it accepted within `--drain-seconds`, answers what it could not finish by then with a 503 in OpenAI's shape, and
  exits 0 (serve/process.py).
- HEAD: every route that answers GET answers HEAD too (what GET answers, without the body), so a load balancer
  that checks `/health` with HEAD sees the replica up.
- Bound on waiting work (`--max-queued-texts`), and the deadline (`--max-queue-ms`, by default DEFAULT_DEADLINE_MS,
  or a client's own when it sends a shorter one: CLIENT_TIMEOUT_HEADER): a request whose texts would take the queue
  past the bound, or whose answer the model could not start within the deadline (the texts waiting times the
  model's recent time per text, and the rest of the call in flight, whose texts are answered at its end) or finish
  within it (and its own texts), is answered 429 with `Retry-After` (the seconds the model needs for what waits
  now) at once, before it is queued or tokenized; nothing already queued is ever dropped. A request larger than the
  bound in texts, or longer than the deadline, is still taken when nothing waits or runs, so every request the
  server accepts by its size limits can be answered. The bound in time follows the machine: under overload the
  event loop's own work (reading requests, refusing them) takes part of the core, the model answers fewer texts a
  second, and a count of texts sized at rest lets in requests whose clients time out before their answer (3x full
  depth's capacity on one core, a 2 s deadline and 256 texts: 4,320 requests accepted and then left by their
  clients in 30 s).

`Guard` is the ASGI middleware that applies the key, the drain and HEAD, and counts every answer
(serve/metrics.py). The bound is applied twice: by `Guard`, before a request to the embeddings route is read, when
what waits already refuses any request (the queue is full, or past the bound in time), and by the route, which knows
how many texts a request holds. Under overload most requests are refused, and each refusal takes the event loop's
time from the core the model needs: a refusal before the body is parsed, checked and tokenized costs a fraction of
one after it.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import os
import time

from matryoshka2d.serve.protocol import ApiError

API_KEY_ENV = "MATRYOSHKA2D_API_KEY"
OPEN_ROUTES = ("/health",)
BOUNDED_ROUTES = ("/v1/embeddings",)  # the routes that queue work for the model
# The deadline a request is admitted against unless `serve --max-queue-ms` says otherwise: about what the client of
# an interactive search waits before it gives up, and the deadline the project's load benchmarks give every request
# (benchmarks/serve_capacity.py and serve_overload.py --timeout 2). Past it a client has left: work queued for it
# is work nobody reads, taken from requests that could still be answered in time.
DEFAULT_DEADLINE_MS = 2000.0
# A client's own deadline, when it says it and it is shorter than the server's: the read timeout, in seconds, that
# the official OpenAI SDKs (Python, Node; made by Stainless) send on every request, so an OpenAI client made with
# `timeout=0.5` is refused at once by a server that could not answer it within half a second.
CLIENT_TIMEOUT_HEADER = b"x-stainless-read-timeout"


# The least an estimate is scaled by before it is held against the deadline: what is learnt (`EstimateMargin`) is
# learnt from answers a deadline late, and a burst moves the queue's drain rate faster than that. A queue held below
# the deadline costs no throughput under overload (a few calls keep the model busy); at twice the capacity on one
# core (minilm-l6 int8, SciFact queries, 2 s), holding it at the deadline by the learnt margin alone left 130-200 of
# about 4,000 accepted requests past their client's deadline (2026-11-29).
FLOOR_FACTOR = 1.25


class EstimateMargin:
    """How far the server's estimate of a request's time in it runs short, learnt from the requests it answered
    after queueing behind others: the mean ratio of the time taken to the time estimated, and the ratio's mean
    deviation, learnt as TCP learns a round trip (RFC 6298: gains 1/8 and 1/4, and a timeout of the mean plus 4
    deviations). An estimate is scaled by `factor` (at least FLOOR_FACTOR) before it is held against the deadline.
    Without it the queue was kept at the deadline and the estimate's own spread made the rest late: at twice the
    capacity on one core (minilm-l6 int8, SciFact queries, a 2 s deadline), the time taken was 0.89 to 1.15 of the
    estimate (10th to 99th percentile) and 6-8% of the requests taken timed out (2026-11-29)."""

    def __init__(self):
        self.mean, self.deviation = 1.0, 0.0

    def observe(self, estimated_ms: float, took_ms: float) -> None:
        if estimated_ms > 0 and math.isfinite(took_ms):
            ratio = took_ms / estimated_ms
            self.deviation += 0.25 * (abs(ratio - self.mean) - self.deviation)
            self.mean += 0.125 * (ratio - self.mean)

    @property
    def factor(self) -> float:
        return max(FLOOR_FACTOR, self.mean + 4 * self.deviation)


class LoopLag:
    """How late the event loop runs what is ready, measured by a tick every INTERVAL seconds: the largest lateness
    of recent ticks (`seconds`), halving every HALF_LIFE seconds. A request's time before the app first sees it
    (read from the socket, parsed, its task run) and after its answer is ready (its task resumed, the answer
    written) is the event loop's, not the model's, and no estimate of the queue holds it: under overload (twice the
    capacity on one core, minilm-l6 int8, SciFact queries), requests the server answered within 2.0 s by its own
    clock reached their client after 2.07 s, and timed out there (2026-11-29). The admission adds it twice."""

    INTERVAL = 0.05  # a tick every 10 ms took 3% of the event loop's own time at twice the capacity
    HALF_LIFE = 1.0

    def __init__(self):
        self.worst = 0.0
        self._due = self._last = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._last = loop, loop.time()
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    @property
    def seconds(self) -> float:
        return self.worst

    def _schedule(self) -> None:
        self._due = self._loop.time() + self.INTERVAL
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        decayed = self.worst * 0.5 ** ((now - self._last) / self.HALF_LIFE)
        self.worst, self._last = max(now - self._due, decayed), now
        self._schedule()


def key_problem(key: str) -> str | None:
    """What makes `key` a key no client can send as `Authorization: Bearer KEY`, or None. The key itself is never
    part of the answer (it would reach a log): only where the fault is."""
    if not key.strip():
        return "is empty; give a key or leave it out"
    if key != key.strip():
        return (
            "has whitespace around it (a key file's trailing newline?): a client's header carries none, so no "
            "request would match; strip it"
        )
    for i, char in enumerate(key):
        if not " " <= char <= "~":
            return (
                f"holds U+{ord(char):04X} at character {i}, which is not printable ASCII: HTTP clients cannot send "
                "it in a header; use printable ASCII only"
            )
    return None


class Admission:
    """The API key, the drain and the bound on queued texts of one server."""

    def __init__(
        self,
        api_key: str | None = None,
        max_queued_texts: int = 1024,
        max_queue_ms: float = DEFAULT_DEADLINE_MS,
        key_source: str = f"--api-key (or {API_KEY_ENV})",
    ):
        problem = key_problem(api_key) if api_key is not None else None
        if problem is not None:
            raise ValueError(f"{key_source}: the API key {problem}")
        if max_queued_texts < 1:
            raise ValueError(f"--max-queued-texts must be at least 1, got {max_queued_texts}")
        if not (math.isfinite(max_queue_ms) and max_queue_ms > 0):
            raise ValueError(f"--max-queue-ms must be a positive number of milliseconds, got {max_queue_ms}")
        self._key = api_key.encode() if api_key is not None else None
        self.max_queued_texts, self.max_queue_ms = max_queued_texts, max_queue_ms
        self.margin = EstimateMargin()  # the engine tells it what requests took against their estimate
        self.loop_lag = LoopLag()  # started by the engine on the app's event loop
        self.draining = False
        # The drain's deadline: the tasks of the requests in flight (registered by Guard), and those the deadline
        # cut, which Guard answers with a 503 instead of the answer they could not get in time.
        self.in_flight: set[asyncio.Task] = set()
        self.cut: set[asyncio.Task] = set()
        self.drain_seconds: float | None = None
        self._deadline: asyncio.TimerHandle | None = None

    @classmethod
    def from_options(
        cls, api_key: str | None, max_queued_texts: int, max_queue_ms: float = DEFAULT_DEADLINE_MS
    ) -> Admission:
        """`--api-key` if given, else the environment variable (so the key need not be on a command line)."""
        if api_key is not None:
            return cls(api_key, max_queued_texts, max_queue_ms, key_source="--api-key")
        return cls(os.environ.get(API_KEY_ENV), max_queued_texts, max_queue_ms, key_source=API_KEY_ENV)

    def drain(self, seconds: float) -> None:
        """Stop taking requests, and cut those still in flight after `seconds` (each is answered 503 by Guard).
        Runs on the event loop (the signal handler schedules it there)."""
        self.draining, self.drain_seconds = True, seconds
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(seconds, self.cut_in_flight)

    def cut_in_flight(self) -> None:
        """The drain's end: every request still in flight is cancelled, and answered 503 by Guard."""
        for task in list(self.in_flight):
            if not task.done():
                self.cut.add(task)
                task.cancel()

    def unfinished(self) -> ApiError:
        """The answer to a request the drain cut before it was answered."""
        within = f" within {self.drain_seconds:g} s (--drain-seconds)" if self.drain_seconds is not None else ""
        return ApiError(
            503,
            f"The server is shutting down and could not finish this request{within}; send it again, to another replica",
            None,
            "server_shutting_down",
            kind="server_error",
            headers={"Connection": "close"},
        )

    @property
    def needs_key(self) -> bool:
        return self._key is not None

    def refusal(self, path: str, authorization: bytes | None) -> ApiError | None:
        """Why a request to `path` is not let in (a 401 or a 503), or None."""
        if self._key is not None and path not in OPEN_ROUTES:
            scheme, _, given = (authorization or b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self._key):
                return ApiError(
                    401,
                    "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' with the key this "
                    "server was started with",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if self.draining:
            return ApiError(
                503,
                "The server is shutting down: it finishes the requests it accepted and takes no new ones; send this "
                "one to another replica",
                None,
                "server_shutting_down",
                kind="server_error",
                headers={"Connection": "close"},
            )
        return None

    @staticmethod
    def client_deadline_ms(value: bytes | None) -> float | None:
        """The deadline a client sent (CLIENT_TIMEOUT_HEADER: seconds), in ms; None when it sent none or no
        positive finite number (the server's own deadline then applies)."""
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            return None
        return 1000 * seconds if math.isfinite(seconds) and seconds > 0 else None

    def admit(
        self, texts: int, queued: int, drain_seconds: float, own_seconds: float = 0.0, deadline_ms: float | None = None
    ) -> None:
        """Let `texts` more texts join `queued` waiting ones, or raise a 429 saying when to come back."""
        refusal = self.overloaded(texts, queued, drain_seconds, own_seconds, deadline_ms)
        if refusal is not None:
            raise refusal

    def overloaded(
        self,
        texts: int | None,
        queued: int,
        drain_seconds: float,
        own_seconds: float = 0.0,
        deadline_ms: float | None = None,
    ) -> ApiError | None:
        """The 429 for `texts` more texts joining `queued` waiting ones (the model needs `drain_seconds` for them and
        for the rest of the call it runs, and `own_seconds` for the request's own texts), or None when they may.
        `texts` None (a request not read yet): whether what waits refuses any request. `deadline_ms`: the client's
        own deadline, which applies when it is shorter than --max-queue-ms. With nothing queued the bound in texts
        lets any request in (one larger than the bound is then taken); with nothing queued or running, so does the
        deadline."""
        deadline, source = self.max_queue_ms, "--max-queue-ms"
        if deadline_ms is not None and deadline_ms < deadline:
            deadline, source = deadline_ms, f"this request's {CLIENT_TIMEOUT_HEADER.decode()} header"
        if queued and queued + (texts or 1) > self.max_queued_texts:
            adds = f" and this request adds {texts}" if texts is not None else ""
            why = f"{queued} texts are waiting{adds} (the bound is {self.max_queued_texts}, --max-queued-texts)"
        elif (
            drain_seconds > 0
            and 1000 * ((drain_seconds + own_seconds) * self.margin.factor + 2 * self.loop_lag.seconds) > deadline
        ):
            own = f", and this request's {texts} texts about {1000 * own_seconds:.0f} ms more" if own_seconds else ""
            margin = f" (x {self.margin.factor:.2f}, how far estimates ran short)" if self.margin.factor > 1 else ""
            lag = self.loop_lag.seconds
            loop = f", and the event loop's lag twice ({1000 * lag:.0f} ms)" if lag >= 0.0005 else ""
            why = (
                f"the {queued} texts waiting and the call running need about {1000 * drain_seconds:.0f} ms of the "
                f"model{own}{margin}{loop}: past the deadline of {deadline:g} ms ({source})"
            )
        else:
            return None
        retry = max(1, math.ceil(drain_seconds))
        return ApiError(
            429,
            f"The model is overloaded: {why}; retry after {retry} s",
            None,
            "model_overloaded",
            kind="server_error",
            headers={"Retry-After": str(retry)},
        )


# The scope keys under which Guard leaves the time (perf_counter) it first saw the request, and the client's deadline.
REQUEST_START = "matryoshka2d.request_start"
CLIENT_DEADLINE = "matryoshka2d.client_deadline_ms"


class Guard:
    """ASGI middleware: the API key and the drain before any route, HEAD answered as GET without its body, a
    request the drain's deadline cuts answered 503, and every answer counted with its status and time. A pure ASGI
    callable (no BaseHTTPMiddleware), so it adds no task or copy per request."""

    def __init__(self, app, admission: Admission, metrics, respond, waiting=None):
        """`waiting()`: (texts queued, seconds the model needs for them), for the refusal before the body is read."""
        self.app, self.admission, self.metrics, self.respond = app, admission, metrics, respond
        self.waiting = waiting

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, path, status = time.perf_counter(), scope["path"], [None]
        head = scope["method"] == "HEAD"
        if head:  # routed as the GET it asks about; the answer's body is left out below (its headers describe it)
            scope = {**scope, "method": "GET"}
        scope[REQUEST_START] = start  # the route times its phases from here (engine.py)

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif head and message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": b""}
            await send(message)

        authorization = timeout = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == CLIENT_TIMEOUT_HEADER:
                timeout = value
        scope[CLIENT_DEADLINE] = deadline = self.admission.client_deadline_ms(timeout)
        refusal = self.admission.refusal(path, authorization)
        if refusal is None and self.waiting is not None and path in BOUNDED_ROUTES and scope["method"] == "POST":
            refusal = self.admission.overloaded(None, *self.waiting(), deadline_ms=deadline)
        try:
            if refusal is not None:
                await self.respond(refusal)(scope, receive, counted)
            else:
                await self._within_drain(scope, receive, counted, status)
        finally:
            self.metrics.request(path, status[0] or 500, time.perf_counter() - start)

    async def _within_drain(self, scope, receive, send, status) -> None:
        """The route, registered as in flight so that the drain's deadline can cut it: a request cut before its
        answer started is answered 503 (a cancelled route would otherwise be uvicorn's plain-text 500)."""
        task = asyncio.current_task()
        in_flight = self.admission.in_flight
        in_flight.add(task)
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if task not in self.admission.cut or status[0] is not None:
                raise
            task.uncancel()
            await self.respond(self.admission.unfinished())(scope, receive, send)
        finally:
            in_flight.discard(task)
            self.admission.cut.discard(task)
