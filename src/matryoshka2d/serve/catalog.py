"""Which encoder, layer and width answer a request: the names a server serves, and the pairing of queries and
documents.

A server serves one model under `model_id`, every cell of it by name (`MODEL@LAYERxDIMS`), and query encoders
distilled from it under their own names (`serve --query-model NAME=FOLDER`). A request to the model may say what
its texts are, as Cohere, Voyage and NVIDIA NIM clients do: `input_type: "query" | "document"`.

- The pair's query side is `--query-cell LAYERxDIM` (a shallow cell of the model itself) when given, else the one
  query encoder when exactly one is served. Queries go to it; documents to the full depth, at the pair's width
  (the query cell's DIM, or the model's full width), or at `--default-dimensions` when the server has one (a default
  wider than the pair's is refused at start). A request's `dimensions` may cut both to fewer numbers.
- Without a pair, "query" is answered as a request without input_type is (adaptive when the server adapts its
  depth), and "document" at the full depth: documents build an index, so their depth is never shed.
- A request without input_type gets exactly what it got before input_type existed, byte for byte, unless the
  server runs with --adaptive-depth: then a request that names no layer (or `layer: "auto"`) is adaptive.
- A `layer` or a cell name that contradicts input_type is a 400, never silently overridden.

What is served is what is listed: /v1/models names the model, its cells at the layers the server runs (`serve
--layers`: those only) and its query encoders, and no path of the machine; a cell or model it does not serve is a
404 `model_not_found`, as OpenAI answers an unknown model, whether the request names it by a cell name or by its
`layer`.

Answers that were routed (input_type given) or adaptive say, on every item, the layer and the encoder that made
them (`Plan.annotate`); the endpoint also sends both as response headers on every answer.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from matryoshka2d.cells import nested_dims
from matryoshka2d.serve.batching import MicroBatcher
from matryoshka2d.serve.protocol import (
    EMBEDDING_TYPES,
    ApiError,
    check_formats,
    check_input_type,
    check_int,
    check_layer,
    check_texts,
    header_value,
    shown,
)
from matryoshka2d.serve.texts import CHARS_PER_TOKEN

if TYPE_CHECKING:
    from matryoshka2d.serve.backends import Backend
    from matryoshka2d.serve.config import ServerConfig
    from matryoshka2d.serve.ladder import Ladder
    from matryoshka2d.serve.metrics import ServerMetrics
    from matryoshka2d.serve.model_thread import ModelThread

ADAPTIVE = None  # the layer of a request whose rung the ladder chooses (serve/ladder.py)


@dataclass
class ServedModel:
    """One encoder the server runs (the model, or a query encoder beside it): its backend, its own micro-batcher,
    and copies of its tokenizer that count a request's tokens apart from the model thread."""

    name: str
    backend: Backend
    batcher: MicroBatcher
    counter: Any  # a copy of the backend's tokenizer, used on the event loop
    # Another copy, for the tokenizer thread: a fast tokenizer's backend may not be used by two threads at once (a
    # call that cuts sets its state; "Already borrowed").
    thread_counter: Any
    layer: int  # a query encoder's own layer: its last, or 0 for a static cell (the model itself: its last)
    max_chars: int  # characters of one text past which it is refused (or cut, with --truncate) untokenized
    header_name: str  # the name as a response header carries it (percent-encoded: protocol.header_value)

    @classmethod
    def of(
        cls,
        name: str,
        backend: Backend,
        config: ServerConfig,
        metrics: ServerMetrics,
        thread: ModelThread,
        observe=None,
        layer: int | None = None,
    ) -> ServedModel:
        """`thread`: the model thread every batcher of the server hands its calls to; `observe`: the ladder's."""
        batcher = MicroBatcher(
            backend, config.max_batch, config.max_wait, name, metrics, observe, thread, config.target_ms
        )
        own = backend.num_layers if layer is None else layer
        max_chars = config.max_input_chars or CHARS_PER_TOKEN * backend.max_length
        counter = copy.deepcopy(backend.tokenizer)
        return cls(name, backend, batcher, counter, copy.deepcopy(counter), own, max_chars, header_value(name))


@dataclass
class Plan:
    """What answers one request."""

    served: ServedModel  # whose batcher runs it
    texts: list[str]
    layer: int | None  # None: adaptive
    dim: int
    encoding: str
    embedding_type: str
    annotate: bool  # each item says its layer and encoder


def cell_names(model_id: str, layers: list[int], hidden_size: int) -> list[tuple[str, int, int]]:
    """The per-cell names /v1/models lists: every layer served (0 for a static cell) at the nested widths 8, 16,
    32, ..., D."""
    return [(f"{model_id}@{layer}x{dim}", layer, dim) for layer in layers for dim in nested_dims(hidden_size)]


class Catalog:
    """The names one server answers to, and how each request resolves to a Plan."""

    def __init__(
        self, main: ServedModel, queries: dict[str, ServedModel], config: ServerConfig, ladder: Ladder | None = None
    ):
        """`main`: the model, served under its name; `queries`: the query encoders by name; `config`: the server's
        defaults and limits; `ladder`: its adaptive depth, or None."""
        backend, model_id = main.backend, main.name
        default_layer, default_dimensions, query_cell = (
            config.default_layer,
            config.default_dimensions,
            config.query_cell,
        )
        self.main, self.model_id, self.queries, self.ladder = main, model_id, queries, ladder
        self.adaptive, self.limits, self.created = ladder is not None, config, int(time.time())
        self.max_inputs = config.max_inputs
        self.num_layers, self.hidden_size = backend.num_layers, backend.hidden_size
        self.served = list(backend.layers)  # 0 first when the model holds a static cell (models.static)
        self.lowest = self.served[0] if self.served[0] == 0 else 1
        self.alias = re.compile(re.escape(model_id) + r"@(\d+)x(\d+)")
        for name in queries:
            if name == model_id or self.alias.fullmatch(name):
                raise ValueError(
                    f"--query-model {name}=...: '{name}' is a name of the served model "
                    f"('{model_id}' and its cells '{model_id}@<layer>x<dimensions>'); give the query encoder another"
                )
        if default_layer is not None and default_layer not in self.served:
            raise ValueError(
                f"--default-layer {default_layer}: this server runs layers {', '.join(map(str, self.served))}"
            )
        if default_dimensions is not None and not 1 <= default_dimensions <= self.hidden_size:
            raise ValueError(
                f"--default-dimensions {default_dimensions}: the vectors have 1..{self.hidden_size} numbers"
            )
        self.default_layer = default_layer if default_layer is not None else self.served[-1]
        self.default_dimensions = default_dimensions if default_dimensions is not None else self.hidden_size
        self.query_cell = query_cell
        if query_cell is not None:
            layer, dim = query_cell
            if layer not in self.served or not 1 <= dim <= self.hidden_size:
                raise ValueError(
                    f"--query-cell {layer}x{dim}: this server runs layers {', '.join(map(str, self.served))} "
                    f"with 1..{self.hidden_size} dimensions"
                )
        self.query_model = next(iter(queries.values())) if query_cell is None and len(queries) == 1 else None
        self.pair_width = query_cell[1] if query_cell is not None else self.hidden_size
        if default_dimensions is not None and default_dimensions > self.pair_width:
            raise ValueError(
                f"--default-dimensions {default_dimensions}: queries and documents of this pair have "
                f"{self.pair_width} numbers (--query-cell {query_cell[0]}x{query_cell[1]}), so requests with "
                f"input_type could not get {default_dimensions}; give at most {self.pair_width}"
            )
        # The width of a routed request that names none: --default-dimensions applies to it as to any request
        # (it was the pair's full width whatever the server was started with).
        self.routed_dimensions = default_dimensions if default_dimensions is not None else self.pair_width
        if self.query_model is not None and self.query_model.backend.hidden_size != self.hidden_size:
            raise ValueError(
                f"--query-model {self.query_model.name}: its vectors have {self.query_model.backend.hidden_size} "
                f"numbers, the model's {self.hidden_size}; they cannot be compared"
            )

    # -- what /v1/models shows ----------------------------------------------------------------------------------
    def describe_all(self) -> list[dict]:
        """The model, its cells at the layers served (each at the nested widths), and its query encoders."""
        cells = [self.describe_cell(*cell) for cell in cell_names(self.model_id, self.served, self.hidden_size)]
        return [self.describe_model(), *cells, *map(self.describe_query_model, self.queries.values())]

    def describe(self, name: str) -> dict:
        if name in self.queries:
            return self.describe_query_model(self.queries[name])
        layer, dim = self.resolve(name)
        return self.describe_model() if layer is None else self.describe_cell(name, layer, dim)

    def _entry(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "matryoshka2d"}

    def describe_model(self) -> dict:
        backend, served, width = self.main.backend, self.served, self.hidden_size
        cells = (
            f"any (layer, dimensions) with layer in {served} and 1 <= dimensions <= {width}"
            if served != list(range(1, self.num_layers + 1))
            else f"any (layer, dimensions) with 1 <= layer <= {self.num_layers} and 1 <= dimensions <= {width}"
        )
        return {
            **self._entry(self.model_id),
            "layers": served,
            "dimensions": width,
            "cells": cells,
            "max_input_tokens": backend.max_length,
            "truncates_long_inputs": self.limits.truncate,
            "max_inputs_per_request": self.limits.max_inputs,
            "pooling": backend.pooling,
            "normalized": True,
            **backend.describe(),
            "default_layer": self.default_layer,
            "default_dimensions": self.default_dimensions,
            "embedding_types": list(EMBEDDING_TYPES),
            "input_types": self.pairing(),
            "adaptive_depth": self.ladder.describe() if self.ladder is not None else None,
        }

    def describe_cell(self, name: str, layer: int, dim: int) -> dict:
        return {**self._entry(name), "parent": self.model_id, "layer": layer, "dimensions": dim}

    def describe_query_model(self, served) -> dict:
        q = served.backend
        return {
            **self._entry(served.name),
            "query_encoder_of": self.model_id,
            "answers_input_type_query": served is self.query_model,
            "layers": [served.layer],
            "dimensions": q.hidden_size,
            "max_input_tokens": q.max_length,
            "pooling": q.pooling,
            "normalized": True,
            **q.describe(),
        }

    def pairing(self) -> dict | None:
        if self.query_cell is not None:
            layer, dim = self.query_cell
            return {
                "queries": {"encoder": self.model_id, "layer": layer, "dimensions": dim},
                "documents": {"encoder": self.model_id, "layer": self.served[-1], "dimensions": dim},
            }
        if self.query_model is not None:
            q = self.query_model.backend
            return {
                "queries": {"encoder": self.query_model.name, "layer": q.num_layers, "dimensions": q.hidden_size},
                "documents": {"encoder": self.model_id, "layer": self.served[-1], "dimensions": self.hidden_size},
            }
        return None

    # -- a request -------------------------------------------------------------------------------------------------
    def resolve(self, name: str) -> tuple[int | None, int | None]:
        """(layer, dimensions) a model name fixes: (None, None) for the model itself; a 404 for any other name."""
        if name == self.model_id:
            return None, None
        shown = name if len(name) <= 200 else name[:200] + "..."
        match = self.alias.fullmatch(name)
        if match is None:
            raise ApiError(
                404, f"The model '{shown}' does not exist; {self.what_is_served()}", "model", "model_not_found"
            )
        # a number of more than 9 digits is out of range anyway: not given to int() (Python refuses 4,300+ digits)
        layer, dim = (int(g) if len(g) <= 9 else -1 for g in (match[1], match[2]))
        if not (self.lowest <= layer <= self.num_layers and 1 <= dim <= self.hidden_size):
            raise ApiError(
                404,
                f"The model '{shown}' does not exist: no such cell; {self.what_is_served()}",
                "model",
                "model_not_found",
            )
        if layer not in self.served:
            raise self.not_served(f"The model '{shown}'", "model")
        return layer, dim

    def what_is_served(self) -> str:
        """The names this server answers to, for a 404's message."""
        every = self.served[-self.num_layers :] == list(range(1, self.num_layers + 1))
        layers = f"layer {self.lowest}..{self.num_layers}"
        if not every:
            layers = f"layers {', '.join(map(str, self.served))} of the model's {layers}"
        return (
            f"this server serves '{self.model_id}' and its cells '{self.model_id}@<layer>x<dimensions>' "
            f"({layers}, dimensions 1..{self.hidden_size}), e.g. '{self.model_id}@{self.served[-1]}x{self.hidden_size}'"
        )

    def not_served(self, what: str, param: str) -> ApiError:
        """The 404 for a layer of the model that this server does not run (`serve --layers`)."""
        return ApiError(
            404,
            f"{what} is not served here (the server was started with --layers); {self.what_is_served()}",
            param,
            "model_not_found",
        )

    def plan(self, body: dict) -> Plan:
        if "model" not in body:
            raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
        if not isinstance(body["model"], str):
            raise ApiError(400, f"'model' must be a string, got {shown(body['model'])}", "model", "invalid_type")
        input_type = check_input_type(body)
        if body["model"] in self.queries:
            return self._plan_query_model(self.queries[body["model"]], body, input_type)
        named_layer, named_dim = self.resolve(body["model"])
        texts = check_texts(body, self.max_inputs)
        layer = check_layer(body, self.lowest, self.num_layers, f"{self.model_id} has {self.num_layers} layers; layer")
        dim = check_int(
            body, "dimensions", 1, self.hidden_size, f"{self.model_id} has {self.hidden_size} dimensions; dimensions"
        )
        encoding, embedding_type = check_formats(body)
        if layer == "auto" and not self.adaptive:
            raise ApiError(
                400,
                "'layer' is \"auto\", but this server does not adapt its depth (start it with --adaptive-depth)",
                "layer",
                "invalid_value",
            )
        for field_name, named, given in (("layer", named_layer, layer), ("dimensions", named_dim, dim)):
            if named is not None and given is not None and named != given:
                raise ApiError(
                    400,
                    f"'model' {body['model']} names {field_name} {named}, but '{field_name}' is {given}; "
                    f"send one of them",
                    field_name,
                    "invalid_value",
                )
        if input_type is not None:
            if named_layer is not None:
                raise ApiError(
                    400,
                    f"'model' {body['model']} names a cell, and 'input_type' chooses the cell; send the model "
                    f"'{self.model_id}' with input_type, or the cell without it",
                    "input_type",
                    "invalid_value",
                )
            routed = self._route(input_type, layer, dim)
            if routed is not None:
                served, layer, dim = routed
                return Plan(served, texts, layer, dim, encoding, embedding_type, True)
        # A model name that contradicts a field is named first: it is the request's own mistake on any server.
        if isinstance(layer, int) and layer not in self.served:  # a layer the model has, not served here
            raise self.not_served(
                f"'layer' {layer} (the cell {self.model_id}@{layer}x{dim or self.hidden_size})", "layer"
            )
        if layer == "auto" or (self.adaptive and layer is None and named_layer is None):
            return Plan(
                self.main, texts, ADAPTIVE, dim or named_dim or self.default_dimensions, encoding, embedding_type, True
            )
        layer = next(n for n in (layer, named_layer, self.default_layer) if n is not None)  # layer 0 is a layer
        dim = dim or named_dim or self.default_dimensions
        if layer not in self.served:  # a default layer outside the layers served is refused at start
            raise self.not_served(f"The layer {layer}", "model")
        return Plan(self.main, texts, layer, dim, encoding, embedding_type, self.adaptive or input_type is not None)

    def _route(self, input_type: str, layer, dim: int | None):
        """(served, layer, dim) for a request to the model with input_type, or None to answer it as one without."""
        last = self.served[-1]
        if dim is not None and dim > self.pair_width:
            raise ApiError(
                400,
                f"'dimensions' is {dim}: queries and documents of this pair have {self.pair_width} numbers",
                "dimensions",
                "invalid_value",
            )
        if input_type == "document":
            if layer not in (None, last):
                raise ApiError(
                    400,
                    f"'layer' is {layer}, but documents are encoded at the full depth ({last}): an index holds the "
                    "full model's vectors; drop 'layer' or 'input_type'",
                    "layer",
                    "invalid_value",
                )
            return self.main, last, dim or self.routed_dimensions
        # a query
        pair = self.query_cell or (self.query_model is not None)
        if pair and layer is not None:
            raise ApiError(
                400,
                f"'layer' is {layer}, but queries are answered by this server's query "
                f"{'cell' if self.query_cell else 'encoder'} ({self.describe_query_side()}); drop 'layer' or "
                "'input_type'",
                "layer",
                "invalid_value",
            )
        if self.query_cell is not None:
            return self.main, self.query_cell[0], dim or self.routed_dimensions
        if self.query_model is not None:
            return self.query_model, self.query_model.layer, dim or self.routed_dimensions
        return None

    def describe_query_side(self) -> str:
        if self.query_cell is not None:
            return f"{self.model_id}@{self.query_cell[0]}x{self.query_cell[1]}"
        return self.query_model.name

    def _plan_query_model(self, served, body: dict, input_type: str | None) -> Plan:
        """A request to a query encoder by its name: its own layer (its last, or 0 for a static cell), any width."""
        q, own = served.backend, served.layer
        if input_type == "document":
            raise ApiError(
                400,
                f"{served.name} encodes queries; send documents to '{self.model_id}' (with input_type \"document\")",
                "input_type",
                "invalid_value",
            )
        texts = check_texts(body, self.max_inputs)
        what = (
            f"{served.name} is a query encoder of {q.num_layers} layers (it runs all of them); layer"
            if own
            else f"{served.name} is a static cell (layer 0); layer"
        )
        layer = check_int(body, "layer", own, own, what)
        dim = check_int(
            body, "dimensions", 1, q.hidden_size, f"{served.name} has {q.hidden_size} dimensions; dimensions"
        )
        encoding, embedding_type = check_formats(body)
        width = dim or min(self.default_dimensions, q.hidden_size)  # --default-dimensions, as for the model
        # its own layer when none is named: 0 for a static cell (`layer or ...` took that 0 for "none", and ran
        # the static cell's folder at its transformer's last layer, which the server does not run: a 500)
        own_layer = own if layer is None else layer
        return Plan(served, texts, own_layer, width, encoding, embedding_type, input_type is not None)
