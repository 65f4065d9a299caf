"""An OpenAI-compatible embeddings server in which one loaded model serves every (layer, dim) cell.

    POST /v1/embeddings   {"model", "input": str | [str], "dimensions"?, "encoding_format"?: "float"|"base64",
                           "layer"?, "embedding_type"?: "float"|"int8"|"uint8"|"binary"|"ubinary"}
                           (layer and embedding_type are ours; OpenAI clients send them in extra_body)
    GET  /v1/models       the model, its layers and widths, and a ladder of per-cell names (MODEL@LAYERxDIMS)
    GET  /health          liveness and queue length

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

Requests are micro-batched (deploy/micro_batching.py): one worker thread runs the model; texts that arrive while it
is busy, or within `max_wait` of the first, go into the next batch (up to `max_batch` texts; a larger request is
one batch on its own), grouped by layer so that an exit at layer n still runs n layers; the model call sorts its
texts by length and runs them `batch_size` at a time, as offline `encode` does. Errors have OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import copy
import json
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Request, Response

from matryoshka2d.deploy.api import (
    EMBEDDING_TYPES,
    ApiError,
    check_formats,
    check_int,
    check_texts,
    encode_rows,
    reply_bytes,
)
from matryoshka2d.deploy.backends import TorchBackend
from matryoshka2d.deploy.micro_batching import MicroBatcher
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.views import nested_dims


@dataclass
class ServerLimits:
    max_inputs: int = 2048  # texts per request (OpenAI's limit)
    max_body_bytes: int = 8 * 1024 * 1024  # request body
    truncate: bool = False  # texts over the model's max_length: False -> 400, True -> cut to max_length
    max_batch: int = 256  # texts collected for one model call (sorted by length there, then run in batches)
    batch_size: int = 64  # texts per forward pass within a model call
    max_wait: float = 0.005  # seconds the first request of a batch waits for company


def _error_response(error: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status)


def cell_names(model_id: str, num_layers: int, hidden_size: int) -> list[tuple[str, int, int]]:
    """The per-cell names /v1/models lists: every layer at the nested widths 8, 16, 32, ..., D."""
    return [
        (f"{model_id}@{layer}x{dim}", layer, dim)
        for layer in range(1, num_layers + 1)
        for dim in nested_dims(hidden_size)
    ]


@dataclass
class _Served:
    """One model the server runs: its backend, its own micro-batcher and a tokenizer that counts its tokens."""

    name: str
    backend: object
    batcher: MicroBatcher
    counter: object  # a copy of the backend's tokenizer, used in the event loop apart from the model thread

    @classmethod
    def of(cls, name: str, model, limits: ServerLimits) -> _Served:
        backend = TorchBackend(model, limits.batch_size) if isinstance(model, ElasticEncoder) else model
        batcher = MicroBatcher(backend, limits.max_batch, limits.max_wait)
        return cls(name, backend, batcher, copy.deepcopy(backend.tokenizer))


def create_app(
    model,
    model_id: str,
    limits: ServerLimits | None = None,
    default_layer: int | None = None,
    default_dimensions: int | None = None,
    query_models: dict | None = None,
):
    """The FastAPI app: one model (an ElasticEncoder, run by torch, or a backend from deploy/backends.py), every
    cell; a request naming no cell gets the defaults (else the deepest layer served, at full width).
    `query_models`: name -> query encoder distilled from the model (`distill --mode query`), each served under its
    own name at its own last layer, next to the model (documents by the model, queries by the student)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    limits = limits or ServerLimits()
    main = _Served.of(model_id, model, limits)
    backend = main.backend
    queries = {name: _Served.of(name, q, limits) for name, q in (query_models or {}).items()}
    if model_id in queries:
        raise ValueError(f"a query encoder is named '{model_id}', the name of the model it serves beside")
    num_layers, hidden_size, max_length = backend.num_layers, backend.hidden_size, backend.max_length
    served = list(backend.layers)
    if default_layer is not None and default_layer not in served:
        raise ValueError(f"--default-layer {default_layer}: this server runs layers {', '.join(map(str, served))}")
    if default_dimensions is not None and not 1 <= default_dimensions <= hidden_size:
        raise ValueError(f"--default-dimensions {default_dimensions}: the vectors have 1..{hidden_size} numbers")
    default_layer = default_layer if default_layer is not None else served[-1]
    default_dimensions = default_dimensions if default_dimensions is not None else hidden_size
    alias = re.compile(re.escape(model_id) + r"@(\d+)x(\d+)")
    created = int(time.time())
    batcher = main.batcher

    @asynccontextmanager
    async def lifespan(_app):
        for served in (main, *queries.values()):
            served.batcher.start()
        yield
        for served in (main, *queries.values()):
            await served.batcher.stop()

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
            "layers": served,
            "dimensions": hidden_size,
            "cells": f"any (layer, dimensions) with layer in {served} and 1 <= dimensions <= {hidden_size}"
            if len(served) < num_layers
            else f"any (layer, dimensions) with 1 <= layer <= {num_layers} and 1 <= dimensions <= {hidden_size}",
            "max_input_tokens": max_length,
            "truncates_long_inputs": limits.truncate,
            "max_inputs_per_request": limits.max_inputs,
            "pooling": backend.pooling,
            "normalized": True,
            **backend.describe(),
            "default_layer": default_layer,
            "default_dimensions": default_dimensions,
            "embedding_types": list(EMBEDDING_TYPES),
        }

    def describe_cell(name: str, layer: int, dim: int) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "matryoshka2d",
            "parent": model_id,
            "layer": layer,
            "dimensions": dim,
        }

    def resolve(name: str) -> tuple[int | None, int | None]:
        """(layer, dimensions) a model name fixes: (None, None) for the model itself; a 404 for any other name."""
        if name == model_id:
            return None, None
        where = (
            f"this server serves '{model_id}' and its cells '{model_id}@<layer>x<dimensions>' "
            f"(layer 1..{num_layers}, dimensions 1..{hidden_size}), e.g. '{model_id}@{num_layers}x{hidden_size}'"
        )
        match = alias.fullmatch(name)
        if match is None:
            raise ApiError(404, f"The model '{name}' does not exist; {where}", "model", "model_not_found")
        # a number of more than 9 digits is out of range anyway: not given to int() (Python refuses 4,300+ digits)
        layer, dim = (int(g) if len(g) <= 9 else -1 for g in (match[1], match[2]))
        if not (1 <= layer <= num_layers and 1 <= dim <= hidden_size):
            raise ApiError(404, f"The model '{name}' does not exist: no such cell; {where}", "model", "model_not_found")
        return layer, dim

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "queued_requests": batcher.queue.qsize()}

    def describe_query_model(served: _Served) -> dict:
        q = served.backend
        return {
            "id": served.name,
            "object": "model",
            "created": created,
            "owned_by": "matryoshka2d",
            "query_encoder_of": model_id,
            "layers": [q.num_layers],
            "dimensions": q.hidden_size,
            "max_input_tokens": q.max_length,
            "pooling": q.pooling,
            "normalized": True,
            **q.describe(),
        }

    @app.get("/v1/models")
    async def models():
        cells = [describe_cell(*cell) for cell in cell_names(model_id, num_layers, hidden_size)]
        return {"object": "list", "data": [describe_model(), *cells, *map(describe_query_model, queries.values())]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name in queries:
            return describe_query_model(queries[name])
        layer, dim = resolve(name)
        return describe_model() if layer is None else describe_cell(name, layer, dim)

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
        served, texts, layer, dim, encoding, embedding_type = validate(body)
        counter, max_length = served.counter, served.backend.max_length
        # One tokenizer call counts the tokens and gives the model its input (the backend does not tokenize again).
        encoded = dict(counter(texts, add_special_tokens=True, verbose=False))
        lengths = [len(ids) for ids in encoded["input_ids"]]
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
        if too_long:  # --truncate: those texts cut as the tokenizer cuts them
            cut = counter([texts[i] for i in too_long], truncation=True, max_length=max_length, verbose=False)
            for row, i in enumerate(too_long):
                for k in encoded:
                    encoded[k][i] = cut[k][row]
        used = [min(n, max_length) for n in lengths]
        vectors = (await served.batcher.encode(texts, layer, encoded))[:, :dim]
        data = encode_rows(vectors, encoding, embedding_type)
        reply = {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": sum(used), "total_tokens": sum(used)},
            "layer": layer,
            "dimensions": dim,
            "embedding_type": embedding_type,
            "truncated_inputs": len(too_long),
        }
        # Serialised here: a returned dict goes through FastAPI's jsonable_encoder, which visits every number of
        # every vector in Python (most of a small cell's request time).
        return Response(reply_bytes(reply), media_type="application/json")

    def validate_query_model(served: _Served, body: dict) -> tuple[_Served, list[str], int, int, str, str]:
        """A request to a query encoder: its own last layer, any width."""
        q = served.backend
        texts = check_texts(body, limits.max_inputs)
        what = f"{served.name} is a query encoder of {q.num_layers} layers (it runs all of them); layer"
        layer = check_int(body, "layer", q.num_layers, q.num_layers, what)
        dim = check_int(
            body, "dimensions", 1, q.hidden_size, f"{served.name} has {q.hidden_size} dimensions; dimensions"
        )
        encoding, embedding_type = check_formats(body)
        return served, texts, layer or q.num_layers, dim or q.hidden_size, encoding, embedding_type

    def validate(body: dict) -> tuple[_Served, list[str], int, int, str, str]:
        if "model" not in body:
            raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
        if not isinstance(body["model"], str):
            raise ApiError(400, "'model' must be a string", "model", "invalid_type")
        if body["model"] in queries:
            return validate_query_model(queries[body["model"]], body)
        named_layer, named_dim = resolve(body["model"])
        texts = check_texts(body, limits.max_inputs)
        layer = check_int(body, "layer", 1, num_layers, f"{model_id} has {num_layers} layers; layer")
        dim = check_int(body, "dimensions", 1, hidden_size, f"{model_id} has {hidden_size} dimensions; dimensions")
        for field_name, named, given in (("layer", named_layer, layer), ("dimensions", named_dim, dim)):
            if named is not None and given is not None and named != given:
                raise ApiError(
                    400,
                    f"'model' {body['model']} names {field_name} {named}, but '{field_name}' is {given}; "
                    f"send one of them",
                    field_name,
                    "invalid_value",
                )
        # A model name that contradicts a field is named first: it is the request's own mistake on any server.
        if layer is not None and layer not in served:
            raise ApiError(
                400,
                f"'layer' is {layer}, not served here: this server runs layers {', '.join(map(str, served))} "
                "only (started with --layers)",
                "layer",
                "invalid_value",
            )
        layer = layer or named_layer or default_layer
        dim = dim or named_dim or default_dimensions
        encoding, embedding_type = check_formats(body)
        if layer not in served:
            raise ApiError(
                400,
                f"layer {layer} is not served here: this server runs layers {', '.join(map(str, served))}",
                "model",
                "invalid_value",
            )
        return main, texts, layer, dim, encoding, embedding_type

    return app


def serve(
    model,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServerLimits | None = None,
    log_level: str = "info",
    default_layer: int | None = None,
    default_dimensions: int | None = None,
    query_models: dict | None = None,
) -> None:
    """Run the app in one uvicorn worker (the model, and any query encoders beside it, in memory)."""
    import uvicorn

    app = create_app(
        model,
        model_id,
        limits,
        default_layer=default_layer,
        default_dimensions=default_dimensions,
        query_models=query_models,
    )
    uvicorn.run(app, host=host, port=port, workers=1, log_level=log_level)
