"""The embeddings API's wire format, apart from the routes (serve/http.py) and the engine (serve/engine.py): the
checks a request body goes through, the errors in OpenAI's shape, and the encoding of vectors into a response.

Everything here is pure: it sees a parsed JSON body or an array, never the model, the queue or the HTTP layer,
so the app's handlers read as the order of the checks and the model call.
"""

from __future__ import annotations

import base64
import json
import re
from urllib.parse import quote

import numpy as np
import orjson

from matryoshka2d.cells import unit_rows

ENCODING_FORMATS = ("float", "base64")
# float32 as JSON numbers or little-endian bytes; the rest as Cohere / sentence-transformers name them.
EMBEDDING_TYPES = {"float": "<f4", "int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}
KNOWN_FIELDS = {"model", "input", "dimensions", "encoding_format", "layer", "user", "embedding_type", "input_type"}
# What a text is, as Cohere, Voyage and NVIDIA NIM name it: a server with a query encoder or a query cell answers
# queries with it and documents with the full cell (serve/catalog.py).
INPUT_TYPES = ("query", "document")
# The largest number a request field can hold, in digits: every number the API takes (a layer, a width) is far
# smaller, and Python refuses to turn a string of more than 4,300 digits into an int (a 500 before this bound).
MAX_DIGITS = 18


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Printable ASCII but '%' and the space: what a header value may carry as it is. Everything else of a name (non-ASCII
# letters, control characters) is percent-encoded from its UTF-8 bytes, as a URL would carry it.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def header_value(text: str) -> str:
    """`text` as a response header value that any client reads: HTTP headers are bytes the server encodes as
    latin-1, so a served name such as 'modèle-日本' made every answer a 500; percent-encoded it is plain ASCII that
    urllib.parse.unquote turns back into the name (an ASCII name is unchanged)."""
    return quote(text, safe=_HEADER_SAFE)


class OutOfRange:
    """A JSON number of more than MAX_DIGITS digits, kept as its digits: no field takes one, and the check of the
    field that holds it says so (json.loads would have made a 500 of it, or a huge int). Not a str and not an int,
    so every type check refuses it."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))


def _bounded_int(text: str):
    return int(text) if len(text.lstrip("-")) <= MAX_DIGITS else OutOfRange(text)


# A run of more digits than any field holds: such a body is parsed by the standard library, which keeps the number
# as OutOfRange (orjson would make a float of it, and the field's check would name a float, not a huge number).
_LONG_NUMBER = re.compile(rb"\d{%d}" % (MAX_DIGITS + 1))


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object; a 400 for anything else, however it is malformed (invalid JSON or UTF-8,
    nesting deeper than the parser goes, a number of thousands of digits). orjson reads it when it can (a tenth of
    the standard library's time for a one-query request); anything orjson refuses (NaN, a lone surrogate, nesting
    past 1,024) or might read otherwise (a long run of digits) goes through the standard library as before, so every
    body is read, or refused with the same message, as the standard library alone did."""
    if not _LONG_NUMBER.search(raw):
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None  # the standard library reads it, or says why not
        else:
            if not isinstance(body, dict):
                raise ApiError(400, "The request body must be a JSON object", None, "invalid_type")
            return body
    try:
        body = json.loads(raw, parse_int=_bounded_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The request body is not valid JSON ({exc})", None, "invalid_json") from None
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply to be a request", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object", None, "invalid_type")
    return body


def shown(value) -> str:
    if isinstance(value, OutOfRange):
        return f"a number of {value.digits} digits"
    return json.dumps(value)[:40]


def kind_of(value) -> str:
    return shown(value) if isinstance(value, OutOfRange) else type(value).__name__


def check_int(body: dict, name: str, low: int, high: int, what: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, OutOfRange):
        raise ApiError(
            400, f"'{name}' is {shown(value)}, out of range: {what} allows {low}..{high}", name, "invalid_value"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {shown(value)}", name, "invalid_type")
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
            f"'input' must be a string or a list of strings, got {kind_of(texts)}",
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
            raise ApiError(400, f"input[{i}] must be a string, got {kind_of(text)}{hint}", "input", "invalid_type")
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


def check_input_type(body: dict) -> str | None:
    """The request's `input_type` ("query" or "document"), or None when it has none."""
    value = body.get("input_type")
    if value is None or (isinstance(value, str) and value in INPUT_TYPES):
        return value
    raise ApiError(
        400, f"'input_type' must be one of {', '.join(INPUT_TYPES)}, got {shown(value)}", "input_type", "invalid_value"
    )


def check_layer(body: dict, low: int, high: int, what: str) -> int | str | None:
    """The request's `layer`: a number in low..high, "auto" (adaptive depth), or None when it has none."""
    if body.get("layer") == "auto":
        return "auto"
    if isinstance(body.get("layer"), str):
        raise ApiError(
            400, f"'layer' must be an integer or \"auto\", got {shown(body['layer'])}", "layer", "invalid_type"
        )
    return check_int(body, "layer", low, high, what)


def check_formats(body: dict) -> tuple[str, str]:
    """(encoding_format, embedding_type) the request asks for (float when absent or null); unknown fields are a 400."""
    embedding_type = body.get("embedding_type", "float")
    if embedding_type is None:
        embedding_type = "float"
    if not isinstance(embedding_type, str) or embedding_type not in EMBEDDING_TYPES:
        raise ApiError(
            400,
            f"'embedding_type' must be one of {', '.join(EMBEDDING_TYPES)}, got {shown(embedding_type)}",
            "embedding_type",
            "invalid_value",
        )
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise ApiError(
            400,
            f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got {shown(encoding)}",
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
    # unit_rows makes a new float32 array; nothing after it copies again where the type is already the one sent
    vectors = quantize(unit_rows(vectors), embedding_type).astype(EMBEDDING_TYPES[embedding_type], copy=False)
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
