"""An OpenAI-compatible embeddings server in which one loaded model serves every (layer, dim) cell.

    POST /v1/embeddings   {"model", "input": str | [str], "dimensions"?, "encoding_format"?: "float"|"base64",
                           "layer"?}  (layer is ours: exit after that many layers; OpenAI clients send it in
                           extra_body)
    GET  /v1/models       the model, its layers and widths
    GET  /health          liveness and queue length

Vectors are the first `dimensions` numbers at `layer`, L2-normalised after slicing (as OpenAI's are), so they
equal `ElasticEncoder.encode(texts, layer=layer, dim=dimensions, normalize=True)`.

Requests are micro-batched: one worker thread runs the model; texts that arrive while it is busy, or within
`max_wait` of the first, go into the next batch (up to `max_batch` texts; a larger request is one batch on its
own), grouped by layer so that an exit at layer n still runs n layers; the model call sorts its texts by length
and runs them `batch_size` at a time, as offline `encode` does. Errors have OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import numpy as np
from fastapi import Request

from matryoshka2d.allocator import trim_heap
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.views import unit_rows

ENCODING_FORMATS = ("float", "base64")
KNOWN_FIELDS = {"model", "input", "dimensions", "encoding_format", "layer", "user"}


@dataclass
class ServerLimits:
    max_inputs: int = 2048  # texts per request (OpenAI's limit)
    max_body_bytes: int = 8 * 1024 * 1024  # request body
    truncate: bool = False  # texts over the model's max_length: False -> 400, True -> cut to max_length
    max_batch: int = 256  # texts collected for one model call (sorted by length there, then run in batches)
    batch_size: int = 64  # texts per forward pass within a model call
    max_wait: float = 0.005  # seconds the first request of a batch waits for company


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class _Job:
    texts: list[str]
    layer: int
    future: asyncio.Future = field(repr=False)


class MicroBatcher:
    """Collects concurrent requests into batches for one model worker thread."""

    def __init__(self, encoder: ElasticEncoder, max_batch: int, max_wait: float, batch_size: int = 64):
        self.encoder, self.max_batch, self.max_wait, self.batch_size = encoder, max_batch, max_wait, batch_size
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="matryoshka2d-model")
        self.batches = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=True)

    async def encode(self, texts: list[str], layer: int) -> np.ndarray:
        """Full-width vectors at `layer`, one row per text."""
        future = asyncio.get_running_loop().create_future()
        await self.queue.put(_Job(texts, layer, future))
        return await future

    async def _collect(self) -> list[_Job]:
        jobs = [await self.queue.get()]
        count = len(jobs[0].texts)
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
            jobs = await self._collect()
            jobs = [j for j in jobs if not j.future.done()]  # a client that went away
            by_layer: dict[int, list[_Job]] = {}
            for job in jobs:
                by_layer.setdefault(job.layer, []).append(job)
            for layer, group in by_layer.items():
                texts = [t for job in group for t in job.texts]
                try:
                    vectors = await loop.run_in_executor(self.executor, self._encode, texts, layer)
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

    def _encode(self, texts: list[str], layer: int) -> np.ndarray:
        vectors = self.encoder.pooled_states(texts, [layer], batch_size=self.batch_size)[layer]
        trim_heap()  # free pages back after each call: RSS stays flat under load (matryoshka2d.allocator)
        return vectors


def _error_response(error: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status)


def _check_int(body: dict, name: str, low: int, high: int, what: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(value)[:40]}", name, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' is {value}, out of range: {what} allows {low}..{high}", name, "invalid_value")
    return value


def create_app(encoder: ElasticEncoder, model_id: str, limits: ServerLimits | None = None):
    """The FastAPI app: one encoder, every cell."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    limits = limits or ServerLimits()
    num_layers, hidden_size, max_length = encoder.num_layers, encoder.hidden_size, encoder.max_length
    counter = copy.deepcopy(encoder.tokenizer)  # token counting in the event loop, apart from the model thread
    created = int(time.time())
    batcher = MicroBatcher(encoder, limits.max_batch, limits.max_wait, limits.batch_size)

    @asynccontextmanager
    async def lifespan(_app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="matryoshka2d embeddings", lifespan=lifespan)
    app.state.batcher = batcher

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

    def describe_model() -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "matryoshka2d",
            "layers": list(range(1, num_layers + 1)),
            "dimensions": hidden_size,
            "cells": f"any (layer, dimensions) with 1 <= layer <= {num_layers} and 1 <= dimensions <= {hidden_size}",
            "max_input_tokens": max_length,
            "truncates_long_inputs": limits.truncate,
            "max_inputs_per_request": limits.max_inputs,
            "pooling": encoder.pooling,
            "normalized": True,
        }

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "queued_requests": batcher.queue.qsize()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [describe_model()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise ApiError(
                404, f"The model '{name}' does not exist; this server serves '{model_id}'", "model", "model_not_found"
            )
        return describe_model()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            raise ApiError(
                413,
                f"Request body is {int(size)} bytes; the limit is {limits.max_body_bytes}",
                None,
                "request_too_large",
            )
        raw = await request.body()
        if len(raw) > limits.max_body_bytes:
            raise ApiError(
                413,
                f"Request body is {len(raw)} bytes; the limit is {limits.max_body_bytes}",
                None,
                "request_too_large",
            )
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"The request body is not valid JSON ({exc})", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object", None, "invalid_type")
        texts, layer, dim, encoding = validate(body)
        lengths = [len(ids) for ids in counter(texts, add_special_tokens=True, verbose=False)["input_ids"]]
        too_long = [i for i, n in enumerate(lengths) if n > max_length]
        if too_long and not limits.truncate:
            i = too_long[0]
            raise ApiError(
                400,
                f"input[{i}] has {lengths[i]} tokens; this model's maximum input length is {max_length} "
                f"tokens ({len(too_long)} input(s) too long). Shorten it (the server runs without --truncate)",
                "input",
                "context_length_exceeded",
            )
        used = [min(n, max_length) for n in lengths]
        vectors = (await batcher.encode(texts, layer))[:, :dim]
        vectors = unit_rows(vectors).astype("<f4", copy=False)
        data = []
        for i, row in enumerate(vectors):
            value = base64.b64encode(row.tobytes()).decode("ascii") if encoding == "base64" else row.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {
            "object": "list",
            "data": data,
            "model": model_id,
            "usage": {"prompt_tokens": sum(used), "total_tokens": sum(used)},
            "layer": layer,
            "dimensions": dim,
            "truncated_inputs": len(too_long),
        }

    def validate(body: dict) -> tuple[list[str], int, int, str]:
        if "model" not in body:
            raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
        if not isinstance(body["model"], str):
            raise ApiError(400, "'model' must be a string", "model", "invalid_type")
        if body["model"] != model_id:
            raise ApiError(
                404,
                f"The model '{body['model']}' does not exist; this server serves '{model_id}'",
                "model",
                "model_not_found",
            )
        if "input" not in body:
            raise ApiError(400, "'input' is required", "input", "missing_required_parameter")
        texts = body["input"]
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list):
            raise ApiError(
                400,
                f"'input' must be a string or a list of strings, got {type(texts).__name__}",
                "input",
                "invalid_type",
            )
        if not texts:
            raise ApiError(400, "'input' is an empty list; send at least one string", "input", "empty_input")
        if len(texts) > limits.max_inputs:
            raise ApiError(
                413,
                f"'input' has {len(texts)} items; at most {limits.max_inputs} per request",
                "input",
                "too_many_inputs",
            )
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                hint = " (token arrays are not supported; send text)" if isinstance(text, (int, list)) else ""
                raise ApiError(
                    400, f"input[{i}] must be a string, got {type(text).__name__}{hint}", "input", "invalid_type"
                )
            if text == "":
                raise ApiError(400, f"input[{i}] is empty; every input must contain text", "input", "empty_input")
        layer = _check_int(body, "layer", 1, num_layers, f"{model_id} has {num_layers} layers; layer")
        dim = _check_int(body, "dimensions", 1, hidden_size, f"{model_id} has {hidden_size} dimensions; dimensions")
        encoding = body.get("encoding_format", "float")
        if encoding is None:
            encoding = "float"
        if encoding not in ENCODING_FORMATS:
            raise ApiError(
                400,
                f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got {json.dumps(encoding)[:40]}",
                "encoding_format",
                "invalid_value",
            )
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if unknown:
            raise ApiError(
                400,
                f"Unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_FIELDS))}",
                unknown[0],
                "unknown_parameter",
            )
        return texts, layer or num_layers, dim or hidden_size, encoding

    return app


def serve(
    encoder: ElasticEncoder,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServerLimits | None = None,
    log_level: str = "info",
) -> None:
    """Run the app in one uvicorn worker (one model in memory)."""
    import uvicorn

    uvicorn.run(create_app(encoder, model_id, limits), host=host, port=port, workers=1, log_level=log_level)
