"""The embeddings API's wire format, apart from the app that serves it (deploy/server.py): the checks a request
body goes through, the errors in OpenAI's shape, and the encoding of vectors into a response.

Everything here is pure: it sees a parsed JSON body or an array, never the model, the queue or the HTTP layer,
so the app's handlers read as the order of the checks and the model call.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import orjson

from matryoshka2d.views import unit_rows

ENCODING_FORMATS = ("float", "base64")
# float32 as JSON numbers or little-endian bytes; the rest as Cohere / sentence-transformers name them.
EMBEDDING_TYPES = {"float": "<f4", "int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}
KNOWN_FIELDS = {"model", "input", "dimensions", "encoding_format", "layer", "user", "embedding_type"}


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


def check_int(body: dict, name: str, low: int, high: int, what: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(value)[:40]}", name, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' is {value}, out of range: {what} allows {low}..{high}", name, "invalid_value")
    return value


def check_texts(body: dict, max_inputs: int) -> list[str]:
    """The request's `input` as a list of non-empty strings, at most `max_inputs` of them; else a 400 / 413."""
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
    if len(texts) > max_inputs:
        raise ApiError(
            413,
            f"'input' has {len(texts)} items; at most {max_inputs} per request",
            "input",
            "too_many_inputs",
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            hint = ""
            if isinstance(text, (int, list)):
                # LangChain's OpenAIEmbeddings sends tiktoken ids unless told not to; say how.
                hint = (
                    " (token ids are not supported: this server tokenizes text itself, and OpenAI's tiktoken ids "
                    "mean nothing to its model; send text. LangChain: "
                    "OpenAIEmbeddings(..., check_embedding_ctx_length=False))"
                )
            raise ApiError(
                400, f"input[{i}] must be a string, got {type(text).__name__}{hint}", "input", "invalid_type"
            )
        if text == "":
            raise ApiError(400, f"input[{i}] is empty; every input must contain text", "input", "empty_input")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (JSON "\ud800") is no text the tokenizer can read
            raise ApiError(
                400,
                f"input[{i}] holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), "
                "which is not text; send valid Unicode",
                "input",
                "invalid_value",
            ) from None
    return texts


def check_formats(body: dict) -> tuple[str, str]:
    """(encoding_format, embedding_type) the request asks for (float when absent or null); unknown fields are a 400."""
    embedding_type = body.get("embedding_type", "float")
    if embedding_type is None:
        embedding_type = "float"
    if not isinstance(embedding_type, str) or embedding_type not in EMBEDDING_TYPES:
        raise ApiError(
            400,
            f"'embedding_type' must be one of {', '.join(EMBEDDING_TYPES)}, got {json.dumps(embedding_type)[:40]}",
            "embedding_type",
            "invalid_value",
        )
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
    return encoding, embedding_type


def quantize(vectors: np.ndarray, embedding_type: str) -> np.ndarray:
    """Unit float vectors in the requested type: int8 / uint8 codes over [-1, 1], or packed sign bits."""
    if embedding_type == "float":
        return vectors.astype("<f4", copy=False)
    from sentence_transformers.util.quantization import quantize_embeddings

    bounds = np.stack([np.full(vectors.shape[1], -1.0), np.full(vectors.shape[1], 1.0)]).astype(np.float32)
    return quantize_embeddings(vectors, precision=embedding_type, ranges=bounds)


def encode_rows(vectors: np.ndarray, encoding: str, embedding_type: str) -> list[dict]:
    """The response's `data`: each row L2-normalised, quantised to `embedding_type`, as a numpy row (written as
    JSON numbers by `reply_bytes`) or as base64 bytes."""
    vectors = quantize(unit_rows(vectors).astype(np.float32), embedding_type).astype(EMBEDDING_TYPES[embedding_type])
    if not np.isfinite(vectors).all():  # JSON has no NaN: a model that made one is a server fault, not a null
        raise ValueError("the model returned a vector that is not finite")
    data = []
    for i, row in enumerate(vectors):
        value = base64.b64encode(row.tobytes()).decode("ascii") if encoding == "base64" else row
        data.append({"object": "embedding", "index": i, "embedding": value})
    return data


def reply_bytes(reply: dict) -> bytes:
    """The response body. orjson writes numpy rows itself, each float32 as the shortest decimal that reads back as
    that float32: 0.03 ms for 8 vectors of 128 where json.dumps of their lists took 0.50 ms, in the server's one
    event loop (docs/benchmarks.md, issue 19)."""
    return orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY)
