"""An OpenAI-compatible embeddings server in which one loaded model serves every (layer, dim) cell.

    POST /v1/embeddings   {"model", "input": str | [str], "dimensions"?, "encoding_format"?: "float"|"base64",
                           "layer"?: int | "auto", "input_type"?: "query"|"document",
                           "embedding_type"?: "float"|"int8"|"uint8"|"binary"|"ubinary"}
                           (layer, input_type and embedding_type are ours; OpenAI clients send them in extra_body)
    GET  /v1/models       the model, its layers and widths, its query side, and per-cell names (MODEL@LAYERxDIMS)
    GET  /health          liveness and queue length (503 while draining); the one route open without the API key
    GET  /metrics         Prometheus text format (deploy/metrics.py)

    (every GET route answers HEAD too: its headers, no body)

A model name `MODEL@3x128` is the same request as `model: MODEL, layer: 3, dimensions: 128` (any layer and
width in range, not only the listed ones), for clients that cannot send extra fields; so are the server's
`default_layer` / `default_dimensions`, used when a request names neither.

Vectors are the first `dimensions` numbers at `layer`, L2-normalised after slicing (as OpenAI's are), so they
equal `ElasticEncoder.encode(texts, layer=layer, dim=dimensions, normalize=True)`. `embedding_type` quantises
those unit vectors afterwards (sentence-transformers' quantize_embeddings): int8 / uint8 over the fixed range
[-1, 1] that every component of a unit vector lies in (so a vector's codes never depend on the other texts of
its batch), binary / ubinary as sign bits packed eight to a byte (ceil(dimensions / 8) numbers).

What runs the model is a backend (deploy/backends.py): the torch encoder, or onnxruntime with one graph per
exit layer (`serve --backend onnx [--quantize int8] [--layers 1,3,6]`); the API, validation (deploy/api.py),
micro-batching and errors here are the same for both. A server started with `--layers` serves those layers
only (a request without `layer` gets the deepest of them).

The app only declares its routes; each concern is a module of its own: admission (API key, drain on SIGTERM, the
bound on waiting work: deploy/admission.py), which encoder and cell answer a request (input_type and the query
side: deploy/routing.py), depth on demand (deploy/depth.py), metrics (deploy/metrics.py).

Requests are micro-batched (deploy/micro_batching.py): one worker thread runs the model; texts that arrive while it
is busy (and, when `max_wait` is set, within it of the first) go into the next batch (up to `max_batch` texts; a
larger request is one batch on its own), grouped by layer so that an exit at layer n still runs n layers; the model
call sorts its texts by length and runs them `batch_size` at a time, as offline `encode` does. Errors have OpenAI's
shape: {"error": {"message", "type", "param", "code"}}.

A request is bounded before any work is spent on it: its body while it streams (chunked bodies too: reading stops
at the bound, 413), its number of texts and each text's characters before the tokenizer sees them (a text longer
than `max_input_chars` is refused, or cut there with --truncate), and its texts are tokenized off the event loop
when they are many characters, so that no request holds `/health` or the others' answers. Response headers carry
names percent-encoded (any served name is a valid header). SIGTERM and SIGINT drain alike, within --drain-seconds:
what the drain cannot finish by then is answered 503 in OpenAI's shape, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import Request, Response

from matryoshka2d.deploy.admission import REQUEST_START, Admission, Guard
from matryoshka2d.deploy.api import ApiError, encode_rows, header_value, parse_body, reply_bytes
from matryoshka2d.deploy.backends import TorchBackend
from matryoshka2d.deploy.metrics import ServerMetrics
from matryoshka2d.deploy.micro_batching import DEFAULT_MAX_WAIT, MicroBatcher, model_thread
from matryoshka2d.deploy.routing import ADAPTIVE, Catalog
from matryoshka2d.models.encoder import ElasticEncoder

__all__ = ["ServerLimits", "create_app", "serve"]

# The characters per token of a text's maximum length past which a text is refused (or cut, with --truncate) before
# it is tokenized: English prose is 4-5 characters a WordPiece token, code and URLs up to about 8; 32 leaves room
# for any text a model reads, and keeps one text's tokenizing to milliseconds (an 8 MB text took 8 s of the event
# loop before it was refused, with /health waiting behind it).
CHARS_PER_TOKEN = 32
# A request of more characters than this is tokenized on a thread of its own, not on the event loop: about 2 ms of
# tokenizing (minilm-l6's tokenizer reads 1-2 MB a second on this machine), the most one request may hold the loop
# for; a query of a few words stays on the loop, where it costs no hand-over between threads.
OFF_LOOP_CHARS = 4096


@dataclass
class ServerLimits:
    max_inputs: int = 2048  # texts per request (OpenAI's limit)
    max_body_bytes: int = 8 * 1024 * 1024  # request body
    truncate: bool = False  # texts over the model's max_length: False -> 400, True -> cut to max_length
    # Texts collected for one model call (sorted by length there, then run `batch_size` at a time): one forward
    # pass. A call answers all its texts at its end, so under load, when it takes everything queued, the first
    # text of a call of 256 waited for the other 255 (1.5 s at minilm-l6's int8 full depth on one core);
    # benchmarks/serve_overload.py, 3x the full depth's capacity with --max-queue-ms 1000 (2026-11-27, 30 s):
    # 366 of 4,600 accepted requests left by their clients before the answer with calls of 256, none of 4,027
    # with calls of 64. A call of many texts saves little on a CPU over calls of 64 (its cost grows with its texts).
    max_batch: int = 64
    batch_size: int = 64  # texts per forward pass within a model call
    max_wait: float = DEFAULT_MAX_WAIT  # seconds a batch that found others queued waits for more company
    # Texts waiting for the model, all encoders together, past which a request is answered 429 (Retry-After). What
    # waits is what the next requests queue behind: at minilm-l6's int8 full depth on one core, one-text queries
    # are answered at about 200-300 a second, so 1,024 of them are 3-5 s of waiting, about as long as a client of an
    # interactive search waits; bulk clients send fewer, larger requests (a request larger than the bound is taken
    # when nothing waits).
    max_queued_texts: int = 1024
    max_queue_ms: float | None = None  # and past this much of the model's time for what waits (deploy/admission.py)
    # Characters of one text: longer ones are refused before the tokenizer sees them (cut there with --truncate).
    # None: CHARS_PER_TOKEN times the encoder's maximum length in tokens.
    max_input_chars: int | None = None


def _error_response(error: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@dataclass
class _Served:
    """One model the server runs: its backend, its own micro-batcher and a tokenizer that counts its tokens."""

    name: str
    backend: object
    batcher: MicroBatcher
    counter: object  # a copy of the backend's tokenizer, used in the event loop apart from the model thread
    layer: int  # a query encoder's own layer: its last, or 0 for a static cell (the model itself: its last)
    max_chars: int  # characters of one text past which it is refused (or cut, with --truncate) untokenized
    header_name: str  # the name as a response header carries it (percent-encoded, deploy/api.py header_value)
    # Another copy, for the tokenizer thread: a fast tokenizer's backend may not be used by two threads at once
    # (a call that cuts sets its state; "Already borrowed")
    thread_counter: object = None

    @classmethod
    def of(cls, name: str, model, limits: ServerLimits, metrics: ServerMetrics, thread, observe=None, layer=None):
        backend = TorchBackend(model, limits.batch_size) if isinstance(model, ElasticEncoder) else model
        batcher = MicroBatcher(backend, limits.max_batch, limits.max_wait, name, metrics, observe, thread)
        own = backend.num_layers if layer is None else layer
        max_chars = limits.max_input_chars or CHARS_PER_TOKEN * backend.max_length
        counter = copy.deepcopy(backend.tokenizer)
        return cls(name, backend, batcher, counter, own, max_chars, header_value(name), copy.deepcopy(counter))


def create_app(
    model,
    model_id: str,
    limits: ServerLimits | None = None,
    default_layer: int | None = None,
    default_dimensions: int | None = None,
    query_models: dict | None = None,
    query_cell: tuple[int, int] | None = None,
    ladder=None,
    admission: Admission | None = None,
    query_layers: dict | None = None,
):
    """The FastAPI app: one model (an ElasticEncoder, run by torch, or a backend from deploy/backends.py), every
    cell; a request naming no cell gets the defaults (else the deepest layer served, at full width).
    `query_models`: name -> query encoder distilled from the model (`distill --mode query` or `--mode static`), each
    served under its own name at its own layer (`query_layers`: name -> layer, 0 for a static cell; default its
    last); the one of them, or `query_cell` (a (layer, dim) of the model), answers requests with input_type
    "query" (deploy/routing.py). `ladder`: the rungs (deploy/ladder.Ladder) that answer requests leaving their layer
    open (each rung's `encoder` names the model or a query model). `admission`: the API key and the bound on
    waiting work (deploy/admission.py)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    limits = limits or ServerLimits()
    admission = admission or Admission(max_queued_texts=limits.max_queued_texts, max_queue_ms=limits.max_queue_ms)
    metrics = ServerMetrics()
    thread = model_thread()  # every model's calls, in turns on one thread (deploy/micro_batching.py)
    observe = ladder.observe if ladder is not None else None
    main = _Served.of(model_id, model, limits, metrics, thread, observe)
    own = query_layers or {}
    queries = {
        name: _Served.of(name, q, limits, metrics, thread, observe, layer=own.get(name))
        for name, q in (query_models or {}).items()
    }
    catalog = Catalog(main, model_id, queries, default_layer, default_dimensions, query_cell, ladder, limits)
    everyone = (main, *queries.values())
    if ladder is not None:
        by_name = {s.name: s for s in everyone}
        for rung in ladder.rungs:
            if rung.encoder not in by_name:
                raise ValueError(f"adaptive depth: the rung {rung.name} names no model this server runs")
            rung.served = by_name[rung.encoder]
        ladder.backlog = lambda: sum(s.batcher.queued_texts * s.batcher.model_ms_per_text for s in everyone)
    tokenizing = [0]  # texts being tokenized off the loop: admitted, not queued yet
    tokenizer_working = [0]  # calls running on the tokenizer's thread (one may outlive a request the drain cut)
    metrics.queued_texts.set_function(lambda: sum(s.batcher.queued_texts for s in everyone) + tokenizing[0])
    tokenizer_thread: list[ThreadPoolExecutor] = []

    @asynccontextmanager
    async def lifespan(_app):
        tokenizer_thread.append(ThreadPoolExecutor(1, thread_name_prefix="matryoshka2d-tokenizer"))
        for served in everyone:
            served.batcher.start()
        yield
        for served in everyone:
            await served.batcher.stop()
        thread.shutdown(wait=False, cancel_futures=True)
        tokenizer_thread.pop().shutdown(wait=False, cancel_futures=True)

    # FastAPI's OpenTelemetry hooks off: they asked the tracer, meter and logger providers on every request (a
    # tenth of a one-query request's own time in a profile), and the server's own /metrics already times each phase.
    no_telemetry = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="matryoshka2d embeddings", lifespan=lifespan, telemetry=no_telemetry)
    app.state.batcher, app.state.admission, app.state.metrics = main.batcher, admission, metrics
    # Whether a thread of this app is still working (a model call or a tokenizing outlived the drain): serve() then
    # ends the process without waiting for it.
    app.state.busy = lambda: tokenizer_working[0] > 0 or any(s.batcher.in_call for s in everyone)

    def tokenized_on_thread(*args):
        tokenizer_working[0] += 1
        try:
            return _tokenized(*args)
        finally:
            tokenizer_working[0] -= 1

    def waiting() -> tuple[int, float]:
        return sum(s.batcher.queued_texts for s in everyone) + tokenizing[0], main.batcher.drain_seconds()

    app.add_middleware(_EmbeddingsFirst, handler=lambda request: embeddings(request))  # inside the Guard
    app.add_middleware(Guard, admission=admission, metrics=metrics, respond=_error_response, waiting=waiting)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(ApiError(exc.status_code, str(exc.detail), None, code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return _error_response(ApiError(400, str(exc), None, "invalid_request"))

    @app.exception_handler(Exception)
    async def server_fault(_request, exc: Exception):  # a fault of the server's own, still in OpenAI's shape
        return _fault_response(exc)

    # Every GET route answers HEAD too (admission.Guard routes HEAD as GET and leaves the body out).
    @app.get("/health")  # open without the key; 503 while draining (admission.Guard), so a balancer moves on
    async def health(response: Response):
        response.headers["x-matryoshka2d-worker"] = str(os.getpid())  # which process of `serve --workers` answered
        return {"status": "ok", "model": model_id, "queued_requests": len(main.batcher.queue)}

    @app.get("/metrics")
    async def prometheus():
        if ladder is not None:
            metrics.ladder_state(ladder.describe())
        content, kind = metrics.render()
        return Response(content, media_type=kind)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": catalog.describe_all()}

    @app.get("/v1/models/{name:path}")
    async def model_by_name(name: str):
        return catalog.describe(name)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        arrived = request.scope.get(REQUEST_START) or time.perf_counter()
        body = await _body(request, limits.max_body_bytes)
        read = time.perf_counter()
        plan = catalog.plan(parse_body(body))
        served, layer = plan.served, plan.layer
        if ladder is not None:
            ladder.request()
            if layer is ADAPTIVE:  # the ladder's rung for this request (deploy/ladder.py)
                idle = not any(s.batcher.queued_texts or s.batcher.in_flight for s in everyone)
                rung = ladder.choose(time.monotonic(), len(plan.texts), idle)
                served, layer = rung.served, rung.layer
        texts, cut = _within_characters(plan.texts, served, limits.truncate)  # before any tokenizing
        admission.admit(len(texts), *waiting())  # before tokenizing too: a refused request costs no tokenizer time
        parsed = time.perf_counter()
        if sum(map(len, texts)) <= OFF_LOOP_CHARS:
            encoded, used, truncated = _tokenized(served, texts, limits.truncate, cut)
        else:  # many characters: tokenized on the tokenizer's thread, while the loop answers the others
            tokenizing[0] += len(texts)
            try:
                encoded, used, truncated = await asyncio.get_running_loop().run_in_executor(
                    tokenizer_thread[0], tokenized_on_thread, served, texts, limits.truncate, cut, served.thread_counter
                )
            finally:
                tokenizing[0] -= len(texts)
        tokenized = time.perf_counter()
        if ladder is not None and plan.layer is not ADAPTIVE:  # documents, named layers: off the ladder's budget
            ladder.fixed(time.monotonic(), ladder.costs.get(served.name), layer, len(texts), sum(used))
        timing: dict = {}
        vectors, layer = await _unless_gone(request, served.batcher.answer(texts, layer, encoded, timing))
        handed = time.perf_counter()
        data = encode_rows(vectors[:, : plan.dim], plan.encoding, plan.embedding_type)
        metrics.answered(served.name, layer, len(texts), sum(used))
        reply = {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": sum(used), "total_tokens": sum(used)},
            "layer": layer,
            "dimensions": plan.dim,
            "embedding_type": plan.embedding_type,
            "truncated_inputs": truncated,
        }
        if plan.annotate:  # routed or adaptive: each item says what made it
            reply["encoder"] = served.name
            for item in data:
                item["layer"], item["encoder"] = layer, served.name
        # Serialised here: a returned dict goes through FastAPI's jsonable_encoder, which visits every number of
        # every vector in Python (most of a small cell's request time).
        content = reply_bytes(reply)
        done = time.perf_counter()
        phases = {
            "http": 1000 * (read - arrived),
            "parse": 1000 * (parsed - read),
            "tokenize": 1000 * (tokenized - parsed),
            **timing,  # queue, handoff, model (deploy/micro_batching.py)
            "answer": 1000 * (done - handed),
        }
        metrics.phases(phases)
        headers = {
            "x-matryoshka2d-layer": str(layer),
            "x-matryoshka2d-encoder": served.header_name,
            # text-embeddings-inference's names where they mean the same (ms)
            "x-total-time": f"{1000 * (done - arrived):.3f}",
            "x-tokenization-time": f"{phases['tokenize']:.3f}",
            "x-queue-time": f"{timing.get('queue', 0.0):.3f}",
            "x-inference-time": f"{timing.get('model', 0.0):.3f}",
            "x-matryoshka2d-phases": ",".join(f"{k}={v:.3f}" for k, v in phases.items()),
        }
        return Response(content, media_type="application/json", headers=headers)

    return app


def _fault_response(exc: Exception):
    message = f"The server failed on this request ({type(exc).__name__}: {str(exc)[:200]})"
    return _error_response(ApiError(500, message, None, "internal_error", kind="server_error"))


class _EmbeddingsFirst:
    """POST /v1/embeddings straight to its handler, past FastAPI's router: matching the routes, solving the
    endpoint's dependencies and its exception middleware took about a quarter of the stack's own time for a
    one-query request (cProfile of the server with a model that answers at once, 2026-11-28), time every request
    takes from the core the model needs. The route stays declared (the API's schema, 405 for other methods); its
    errors are answered here in the same OpenAI shape as the app's handlers answer them."""

    def __init__(self, app, handler):
        self.app, self.handler = app, handler

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/embeddings" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            response = await self.handler(Request(scope, receive))
        except ApiError as exc:
            response = _error_response(exc)
        except Exception as exc:  # a fault of the server's own, as the app's handler answers it
            response = _fault_response(exc)
        await response(scope, receive, send)


async def _unless_gone(request: Request, work):
    """The result of `work`, or, when the client closes its connection first (its own timeout, under overload), a
    499 that nobody reads: the request's texts are then skipped by the batcher (their future is cancelled), so the
    model does not spend itself on answers nobody waits for."""

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, closed = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({answer, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closed.cancel()
        if not answer.done():  # the client left, or the drain's deadline cut the request: nobody takes the answer
            answer.cancel()
    if answer in done:
        return answer.result()
    raise ApiError(499, "The client closed the connection before the answer", None, "client_closed_request")


async def _body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is over `limit` bytes: by its Content-Length before any of it is
    read, else (a chunked body has none) while it streams in, reading stops at the first chunk past the bound."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:  # uvicorn discards the declared rest, unbuffered
        raise ApiError(413, f"Request body is {int(size)} bytes; the limit is {limit}", None, "request_too_large")
    chunks, read = [], 0
    async for chunk in request.stream():
        read += len(chunk)
        if read > limit:  # a chunked body may not end: the connection is closed, so nothing more of it is read
            raise ApiError(
                413,
                f"Request body is over {limit} bytes ({read} read, and more were coming); the limit is {limit}",
                None,
                "request_too_large",
                headers={"Connection": "close"},
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _within_characters(texts: list[str], served: _Served, truncate: bool) -> tuple[list[str], set[int]]:
    """The texts the tokenizer may see, and which of them were cut. A text longer than `served.max_chars` characters
    is a 400 without being tokenized (its length in tokens need not be known to refuse it), or, with --truncate, is
    cut there first, at the last whitespace before the bound when there is one, so the tokens it keeps are the
    whole text's first ones (`_tokenized` checks it still holds more than the model reads)."""
    limit = served.max_chars
    if max(map(len, texts)) <= limit:
        return texts, set()
    over = [i for i, text in enumerate(texts) if len(text) > limit]
    if not truncate:
        i, max_length = over[0], served.backend.max_length
        raise ApiError(
            400,
            f"input[{i}] has {len(texts[i])} characters, more than the {limit} this server reads per input "
            f"({len(over)} input(s) too long): far more than this model's maximum input length of {max_length} "
            "tokens. Shorten it (the server runs without --truncate; --max-input-chars sets this bound)",
            "input",
            "context_length_exceeded",
        )
    texts = list(texts)
    for i in over:
        head = texts[i][:limit]
        space = max(head.rfind(" "), head.rfind("\n"), head.rfind("\t"))
        texts[i] = head[:space] if space > limit // 2 else head
    return texts, set(over)


def token_ids(counter, texts: list[str]) -> dict:
    """What `counter(texts, add_special_tokens=True)` gives (each text's ids, neither cut nor padded), from a fast
    tokenizer's Rust backend without the Python wrapper around it where that is the same: one SciFact query took
    the wrapper 0.42 ms of the event loop's time inside a loaded server (its cache cold after each model call), more
    than the rest of the route's own work, and the backend alone takes under half of its time. A backend set to cut
    or pad (by its tokenizer.json, or by a call with truncation) goes through the wrapper, which sets it back."""
    backend = getattr(counter, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None or backend.truncation is not None or backend.padding is not None:
        return dict(counter(texts, add_special_tokens=True, verbose=False))
    # one text (a query): the single call, a fifth less than a batch of one (84 against 65 us here, 2026-11-28)
    encodings = (
        [backend.encode(texts[0], add_special_tokens=True)] if len(texts) == 1 else fast(texts, add_special_tokens=True)
    )
    encoded = {"input_ids": [e.ids for e in encodings]}
    if "token_type_ids" in counter.model_input_names:
        encoded["token_type_ids"] = [e.type_ids for e in encodings]
    if "attention_mask" in counter.model_input_names:
        encoded["attention_mask"] = [e.attention_mask for e in encodings]
    return encoded


def _tokenized(
    served: _Served, texts: list[str], truncate: bool, cut: set[int] = frozenset(), counter=None
) -> tuple[dict, list[int], int]:
    """One tokenizer call counts the tokens and gives the model its input (the backend does not tokenize again):
    the token ids, the tokens each text uses, and how many were cut. A text over the model's length is a 400,
    or is cut as the tokenizer cuts it with --truncate. `cut`: texts `_within_characters` cut to their first
    characters, each of which must still be over the model's length (else its cut would not be the whole text's).
    `counter`: the tokenizer to use (the loop's own by default; the tokenizer thread has its copy)."""
    counter, max_length = counter or served.counter, served.backend.max_length
    encoded = token_ids(counter, texts)
    lengths = [len(ids) for ids in encoded["input_ids"]]
    short = [i for i in cut if lengths[i] <= max_length]
    if short:
        i = min(short)
        raise ApiError(
            400,
            f"input[{i}] is over {served.max_chars} characters, the most this server reads of an input, and those "
            f"make only {lengths[i]} tokens, within this model's maximum input length of {max_length}: cutting it "
            "to its first tokens needs more of it than the server reads. Shorten it (--max-input-chars sets the "
            "bound)",
            "input",
            "context_length_exceeded",
        )
    too_long = [i for i, n in enumerate(lengths) if n > max_length]
    if too_long and not truncate:
        i = too_long[0]
        raise ApiError(
            400,
            f"input[{i}] has {lengths[i]} tokens; this model's maximum input length is {max_length} "
            f"tokens ({len(too_long)} input(s) too long). Shorten it (the server runs without --truncate)",
            "input",
            "context_length_exceeded",
        )
    if too_long:
        cut = counter([texts[i] for i in too_long], truncation=True, max_length=max_length, verbose=False)
        for row, i in enumerate(too_long):
            for k in encoded:
                encoded[k][i] = cut[k][row]
    return encoded, [min(n, max_length) for n in lengths], len(too_long)


def serve(
    model,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServerLimits | None = None,
    log_level: str = "info",
    drain_seconds: float = 30.0,
    **app_options,
) -> None:
    """Run the app in one uvicorn worker (the model, and any query encoders beside it, in memory). SIGTERM or
    SIGINT drains: new requests get 503, the accepted ones are answered for up to `drain_seconds`, those still in
    flight then get a 503 in OpenAI's shape, and the process exits 0 (a model call still running is not waited
    for: it cannot be interrupted, and the drain would end as late as it does). As one worker of `serve --workers
    N`, it listens on the port the workers share once all have loaded, and tells the parent (deploy/workers.py)."""
    from matryoshka2d.deploy.workers import WorkerChannel

    app = create_app(model, model_id, limits, **app_options)
    freeze_what_is_loaded()
    worker = WorkerChannel.from_environment()  # one of `serve --workers N` (deploy/workers.py), else None
    sockets = [worker.listener_when_told(host)] if worker is not None else None  # once every worker has loaded
    # uvicorn's own graceful timeout is a backstop only: the drain's deadline (admission.Admission.drain) answers
    # what is in flight first, in OpenAI's shape (uvicorn's cancel answers a plain-text 500).
    config = uvicorn.Config(
        app,
        host=host,
        port=worker.port if worker is not None else port,
        workers=1,
        log_level=log_level,
        timeout_graceful_shutdown=drain_seconds + 5,
    )
    started = worker.serving if worker is not None else None
    _DrainingServer(config, app.state.admission, drain_seconds, sockets, started).run()
    if app.state.busy():  # Python's exit would join the model's thread, and wait out its call
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def freeze_what_is_loaded() -> None:
    """Move every object alive now (the model, its tokenizer, torch / onnxruntime / FastAPI and their modules: about
    200,000 objects) out of the garbage collector's reach. Python's full collection walks every tracked object while
    it holds the GIL: about 200 ms on this machine's shared core, with the event loop and the model thread both
    stopped, whenever enough of the requests' objects have survived into the oldest generation. What is loaded
    before serving lives as long as the process and never needs collecting; the requests' own objects still are
    collected (gc.freeze is CPython's tool for exactly this, in long-running servers)."""
    gc.collect()
    gc.freeze()


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, except that SIGTERM or SIGINT (Ctrl-C) first turns new requests away (503), then shuts
    down as uvicorn does (listeners closed, in-flight requests answered) within `drain_seconds`, after which what is
    still in flight is answered 503 (admission.Guard); the signal is not raised again afterwards: the exit is 0, a
    drain that worked, not a death by signal (uvicorn raised SIGINT again: exit 130, with tracebacks). A second
    signal ends the drain at once; a third leaves without waiting, as uvicorn's second Ctrl-C does."""

    def __init__(self, config, admission: Admission, drain_seconds: float = 30.0, sockets=None, started=None):
        super().__init__(config)
        self.admission, self.drain_seconds = admission, drain_seconds
        self.loop: asyncio.AbstractEventLoop | None = None
        self.signals = 0
        # A worker of `serve --workers N` (deploy/workers.py): the socket it listens on, and whom to tell it does.
        self.listeners, self.started_callback = sockets, started

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets if sockets is not None else self.listeners)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.started_callback is not None:
            self.started_callback(self)

    def handle_exit(self, sig, frame):
        if sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self.signals += 1
        self.admission.draining = True
        self.should_exit = True
        if self.signals > 2:
            self.force_exit = True
        elif self.loop is not None:  # a signal handler runs between two steps of the loop: the drain runs on it
            end = self.admission.drain if self.signals == 1 else lambda _seconds: self.admission.cut_in_flight()
            self.loop.call_soon_threadsafe(end, self.drain_seconds)
