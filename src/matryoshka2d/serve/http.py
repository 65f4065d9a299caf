"""The server's HTTP routes, and nothing else: each reads its request and hands it to the engine (serve/engine.py).

    POST /v1/embeddings   {"model", "input": str | [str], "dimensions"?, "encoding_format"?: "float"|"base64",
                           "layer"?: int | "auto", "input_type"?: "query"|"document",
                           "embedding_type"?: "float"|"int8"|"uint8"|"binary"|"ubinary"}
                           (layer, input_type and embedding_type are ours; OpenAI clients send them in extra_body)
    GET  /v1/models       the model, the cells it serves (MODEL@LAYERxDIMS) and its query encoders (serve/catalog.py)
    GET  /health          liveness and queue length (503 while draining); the one route open without the API key
    GET  /metrics         Prometheus text format (serve/metrics.py)

    (every GET route answers HEAD too: its headers, no body)

A model name `MODEL@3x128` is the same request as `model: MODEL, layer: 3, dimensions: 128`, for clients that
cannot send extra fields. Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}, the app's
own faults included. In front of every route, admission.Guard: the API key, the drain, HEAD, the bound on waiting
work, and the count of every answer.

A request is bounded before any work is spent on it: its body while it streams (chunked bodies too: reading stops
at the bound, 413). Response headers carry names percent-encoded (any served name is a valid header).

POST /v1/embeddings is answered by `EmbeddingsFirst` in plain ASGI, past FastAPI's router and Starlette's request and
response objects: every request takes that path, and each piece of Python it runs costs about twice its time on an
idle core, run after a model call has swept the caches.
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from matryoshka2d.serve.admission import CLIENT_DEADLINE, REQUEST_START, Guard
from matryoshka2d.serve.engine import Engine
from matryoshka2d.serve.protocol import ApiError


def app_for(engine: Engine) -> Front:
    """The app that serves `engine`: the Guard and the embeddings route's fast path (`EmbeddingsFirst`) in front of
    the FastAPI app of its routes and error handlers (`Front`)."""

    @asynccontextmanager
    async def lifespan(_app):
        await engine.start()
        yield
        await engine.stop()

    # FastAPI's OpenTelemetry hooks off: they asked the tracer, meter and logger providers on every request (a
    # tenth of a one-query request's own time in a profile), and the server's own /metrics already times each phase.
    no_telemetry = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="matryoshka2d embeddings", lifespan=lifespan, telemetry=no_telemetry)
    app.state.engine, app.state.admission = engine, engine.admission

    async def answer(scope, receive) -> tuple[bytes, dict[str, str]]:
        """The embeddings route's JSON and headers (an ApiError for anything refused)."""
        arrived = scope.get(REQUEST_START) or time.perf_counter()
        body = await read_body(scope, receive, engine.config.max_body_bytes)

        def watched(future, busy):
            return unless_gone(receive, future, busy)

        return await engine.embed(body, arrived, watched, scope.get(CLIENT_DEADLINE))

    async def embeddings(request: Request) -> Response:
        content, headers = await answer(request.scope, request.receive)
        return Response(content, media_type="application/json", headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), None, code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return error_response(ApiError(400, str(exc), None, "invalid_request"))

    @app.exception_handler(Exception)
    async def server_fault(_request, exc: Exception):  # a fault of the server's own, still in OpenAI's shape
        return fault_response(exc)

    # Every GET route answers HEAD too (admission.Guard routes HEAD as GET and leaves the body out).
    @app.get("/health")  # open without the key; 503 while draining (admission.Guard), so a balancer moves on
    async def health(response: Response):
        response.headers["x-matryoshka2d-worker"] = str(os.getpid())  # which process of `serve --workers` answered
        return engine.health()

    @app.get("/metrics")
    async def prometheus():
        content, kind = engine.prometheus()
        return Response(content, media_type=kind)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": engine.catalog.describe_all()}

    @app.get("/v1/models/{name:path}")
    async def model_by_name(name: str):
        return engine.catalog.describe(name)

    # Declared for the API's schema and its 405 for other methods; POST is answered by EmbeddingsFirst.
    app.post("/v1/embeddings")(embeddings)
    front = EmbeddingsFirst(app, answer)
    return Front(app, Guard(front, engine.admission, engine.metrics, error_asgi, engine.waiting))


class Front:
    """The ASGI app that uvicorn and TestClient call: the Guard, then the embeddings route's fast path, then the
    FastAPI app, whose attributes (`state`, `routes`, `router`) it answers for. In front of FastAPI rather than in
    its middleware stack: FastAPI and Starlette wrap their app in middleware of their own (server errors, exception
    telemetry, body limits) that took 6% of the event loop's time at twice the capacity on one core (py-spy of the
    event loop, GIL held, minilm-l6 int8, 620 requests/s, 2026-11-29), every request's, and that POST
    /v1/embeddings does not use: EmbeddingsFirst answers each of its errors in OpenAI's shape itself."""

    def __init__(self, app: FastAPI, asgi):
        self.app, self.asgi = app, asgi

    async def __call__(self, scope, receive, send):
        await self.asgi(scope, receive, send)

    def __getattr__(self, name: str):
        return getattr(self.app, name)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def error_asgi(error: ApiError):
    """`error_response` as plain ASGI, for the paths every request may take (the Guard's refusals, the embeddings
    route's errors): the same JSON and headers without Starlette's response object, so a 429 under overload costs
    the event loop little."""
    content = orjson.dumps(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]

    async def respond(_scope, _receive, send):
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    return respond


def fault_response(exc: Exception) -> JSONResponse:
    message = f"The server failed on this request ({type(exc).__name__}: {str(exc)[:200]})"
    return error_response(ApiError(500, message, None, "internal_error", kind="server_error"))


class EmbeddingsFirst:
    """POST /v1/embeddings straight to its handler in plain ASGI, past FastAPI's router: matching the routes, solving
    the endpoint's dependencies and its exception middleware took about a quarter of the stack's own time for a
    one-query request (cProfile of the server with a model that answers at once, 2026-11-28), and Starlette's
    request and response objects more of the rest, time every request takes from the core the model needs. The
    route stays declared (the API's schema, 405 for other methods); its errors are answered here in the same OpenAI
    shape as the app's handlers answer them."""

    def __init__(self, app, answer):
        self.app, self.answer = app, answer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/embeddings" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            content, headers = await self.answer(scope, receive)
        except ApiError as exc:
            return await error_asgi(exc)(scope, receive, send)
        except Exception as exc:  # a fault of the server's own, as the app's handler answers it
            return await fault_response(exc)(scope, receive, send)
        raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]
        raw += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": content})


async def unless_gone(receive, future: asyncio.Future, busy: bool = True):
    """The result of `future` (a batcher's), or, when the client closes its connection first (its own timeout, under
    overload), a 499 that nobody reads: the request's texts are then skipped by the batcher (their future is
    cancelled), so the model does not spend itself on answers nobody waits for. `busy`: the request may wait for
    the model; a request the model takes at once is not watched (a call cannot be interrupted, so its client's
    leaving saves nothing), which spares it a task of its own."""
    if not busy:
        return await future

    async def gone():
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    watcher.add_done_callback(lambda _: future.cancel())
    try:
        return await future
    except asyncio.CancelledError:
        left = watcher.done() and not watcher.cancelled()
        if not left or asyncio.current_task().cancelling():  # the request itself was cut (the drain's deadline)
            raise
        raise ApiError(
            499, "The client closed the connection before the answer", None, "client_closed_request"
        ) from None
    finally:
        watcher.cancel()


async def read_body(scope, receive, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is over `limit` bytes: by its Content-Length before any of it is
    read, else (a chunked body has none) while it streams in, reading stops at the first chunk past the bound."""
    size = next((value for name, value in scope["headers"] if name == b"content-length"), None)
    if size is not None and size.isdigit() and int(size) > limit:  # uvicorn discards the declared rest, unbuffered
        raise ApiError(413, f"Request body is {int(size)} bytes; the limit is {limit}", None, "request_too_large")
    chunks, read = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(
                499, "The client closed the connection before its body was read", None, "client_closed_request"
            )
        chunk = message.get("body", b"")
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
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
