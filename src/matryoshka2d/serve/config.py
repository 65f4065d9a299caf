"""What a server is asked to be: `ServerConfig`, every setting of `matryoshka2d serve` as a typed field with the
command's default, checked once, when it is made.

The command parses its arguments into one (cli/serve.py) and a library caller writes one, so both get the same
checks and the same messages; each names the setting as the command's option a user types, with the value given
(`--default-dimensions 500: ...`), since that is how most users meet it. What needs the model (a layer past its
depth, a width past its vectors) is checked when the model loads (serve/loading.py), before anything is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from matryoshka2d.cells import Cell
from matryoshka2d.serve.admission import API_KEY_ENV, DEFAULT_DEADLINE_MS, key_problem
from matryoshka2d.serve.batching import DEFAULT_TARGET_MS

BACKENDS = ("torch", "onnx")
QUANTIZATIONS = ("int8",)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class ServerConfig:
    """One embeddings server: the model and what serves it, the request limits, the guards, adaptive depth and
    the process. Fields are the options of `matryoshka2d serve` (a field `max_batch` is `--max-batch`), with the
    same defaults; a value out of range is a ValueError naming the option.

    `api_key` None reads the MATRYOSHKA2D_API_KEY environment variable, as the command does (the key is kept out of
    the repr). `query_models`: name -> folder of each query encoder served beside the model (`--query-model
    NAME=FOLDER`). `layers`: the only layers served (default every layer). `served_name`: the model id clients send
    (default the model folder's name, `runs/st-ese` -> `st-ese`; see `name`)."""

    model: str = "minilm-l6"
    served_name: str | None = None
    pooling: str | None = None
    device: str | None = None
    no_heads: bool = False
    backend: str = "torch"
    quantize: str | None = None
    layers: list[int] | None = None
    onnx_cache: str | None = None
    max_length: int | None = None
    default_layer: int | None = None
    default_dimensions: int | None = None
    query_models: dict[str, str] = field(default_factory=dict)
    query_cell: Cell | None = None
    api_key: str | None = field(default=None, repr=False)
    # request limits (serve/engine.py)
    max_inputs: int = 2048  # texts per request (OpenAI's limit)
    max_body_bytes: int = 8 * 1024 * 1024
    truncate: bool = False  # texts over the model's length: False -> 400, True -> cut to its length
    # Texts collected for one model call (sorted by length there, then run `batch_size` at a time): one forward
    # pass. A call answers all its texts at its end, so under load, when it takes everything queued, the first
    # text of a call of 256 waited for the other 255 (1.5 s at minilm-l6's int8 full depth on one core);
    # benchmarks/serve_overload.py, 3x the full depth's capacity with --max-queue-ms 1000 (2026-11-27, 30 s):
    # 366 of 4,600 accepted requests left by their clients before the answer with calls of 256, none of 4,027
    # with calls of 64. A call of many texts saves little on a CPU over calls of 64 (its cost grows with its texts).
    max_batch: int = 64
    batch_size: int = 64  # texts per forward pass within a model call
    # The latency objective: no model call grows past what keeps the queue within it (serve/batching.py), and the
    # ladder of adaptive depth sheds depth to keep it (serve/ladder.py).
    target_ms: float = DEFAULT_TARGET_MS
    # The most a call waits for company; None: as long as the batcher's measured costs say it pays (never, on a
    # CPU where a call's fixed cost is small next to a text's: serve/batching.py), 0: never.
    max_wait_ms: float | None = None
    # Texts waiting for the model, all encoders together, past which a request is answered 429 (Retry-After). What
    # waits is what the next requests queue behind: at minilm-l6's int8 full depth on one core, one-text queries
    # are answered at about 200-300 a second, so 1,024 of them are 3-5 s of waiting, about as long as a client of an
    # interactive search waits; bulk clients send fewer, larger requests (a request larger than the bound is taken
    # when nothing waits).
    max_queued_texts: int = 1024
    # The deadline: a request the model could not answer within this many ms (what waits before it, the rest of the
    # call in flight, its own texts) is refused at once with 429 (serve/admission.py DEFAULT_DEADLINE_MS).
    max_queue_ms: float = DEFAULT_DEADLINE_MS
    # Characters of one text: longer ones are refused before the tokenizer sees them (cut there with --truncate).
    # None: serve/texts.CHARS_PER_TOKEN times the encoder's maximum length in tokens.
    max_input_chars: int | None = None
    # adaptive depth (serve/ladder.py)
    adaptive_depth: bool = False
    min_layer: int | None = None
    calibration_texts: list[str] | None = None
    # the process (serve/process.py)
    drain_seconds: float = 30.0
    workers: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"

    def __post_init__(self):
        self._check_backend()
        self._check_numbers()
        self._check_cells()
        self._check_adaptive()
        source = "--api-key"
        if self.api_key is None:  # as the command's default: the environment keeps the key off the command line
            self.api_key, source = os.environ.get(API_KEY_ENV), API_KEY_ENV
        problem = key_problem(self.api_key) if self.api_key is not None else None
        if problem is not None:
            raise ValueError(f"{source}: the API key {problem}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level}: choose one of {', '.join(LOG_LEVELS)}")

    @property
    def name(self) -> str:
        """The model id clients send: `served_name`, else the model folder's name (a short name such as minilm-l6,
        or a hub id's last part, as it is). Never a path: it is in every answer and in /v1/models."""
        if self.served_name:
            return self.served_name
        path = Path(self.model).expanduser()
        return path.name or path.resolve().name or str(self.model)

    @property
    def max_wait(self) -> float | None:
        """--max-wait-ms in seconds, as the micro-batcher takes it (None: the batcher's measured costs decide)."""
        return None if self.max_wait_ms is None else self.max_wait_ms / 1000

    def _check_backend(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend}: choose one of {', '.join(BACKENDS)}")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ValueError(f"--quantize {self.quantize}: choose int8")
        if self.backend == "torch":
            used = [flag for flag, value in (("--quantize", self.quantize), ("--onnx-cache", self.onnx_cache)) if value]
            if used:
                raise ValueError(
                    f"{', '.join(used)} apply to --backend onnx; the torch backend serves its layers in fp32"
                )
        elif self.device not in (None, "cpu"):
            raise ValueError(f"--backend onnx runs on the CPU (onnxruntime); drop --device {self.device}")
        if self.layers is not None:
            if not self.layers:
                raise ValueError(
                    "--layers is empty: give the layers to serve, such as 1,3,6 or 2-4, or leave --layers out for all"
                )
            wrong = [n for n in self.layers if isinstance(n, bool) or not isinstance(n, int) or n < 0]
            if wrong:
                raise ValueError(f"--layers: {wrong[0]!r} is not a layer (0: a model's static cell, 1..N its exits)")
            self.layers = sorted(set(self.layers))

    def _check_numbers(self) -> None:
        at_least = {
            "--max-inputs": (self.max_inputs, 1),
            "--max-body-bytes": (self.max_body_bytes, 1),
            "--max-batch": (self.max_batch, 1),
            "--batch-size": (self.batch_size, 1),
            "--max-queued-texts": (self.max_queued_texts, 1),
            "--workers": (self.workers, 1),
            "--port": (self.port, 0),
            "--max-input-chars": (self.max_input_chars, 1),
            "--max-length": (self.max_length, 3),  # [CLS] and [SEP] take two: at least one token of text
            "--default-layer": (self.default_layer, 0),
            "--default-dimensions": (self.default_dimensions, 1),
            "--min-layer": (self.min_layer, 0),
        }
        for option, (value, least) in at_least.items():
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{option} {value!r}: not a whole number")
            if value < least:
                raise ValueError(f"{option} {value}: must be at least {least}")
        if self.port > 65535:
            raise ValueError(f"--port {self.port}: must be 0..65535 (0: any free port)")
        if self.max_wait_ms is not None and not (math.isfinite(self.max_wait_ms) and self.max_wait_ms >= 0):
            raise ValueError(f"--max-wait-ms {self.max_wait_ms}: must be a finite number of at least 0")
        for option, value in (
            ("--max-queue-ms", self.max_queue_ms),
            ("--drain-seconds", self.drain_seconds),
            ("--target-ms", self.target_ms),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{option} {value}: must be a positive finite number")

    def _check_cells(self) -> None:
        if self.query_cell is not None:
            self.query_cell = Cell(*self.query_cell)
            if self.default_dimensions is not None and self.default_dimensions > self.query_cell.dim:
                raise ValueError(
                    f"--default-dimensions {self.default_dimensions}: queries and documents of this pair have "
                    f"{self.query_cell.dim} numbers (--query-cell {self.query_cell.label}), so requests with "
                    f"input_type could not get {self.default_dimensions}; give at most {self.query_cell.dim}"
                )
        if self.layers is not None and self.default_layer not in (None, *self.layers):
            raise ValueError(
                f"--default-layer {self.default_layer}: this server runs layers {', '.join(map(str, self.layers))} "
                "(--layers)"
            )
        for name, folder in self.query_models.items():
            if not name or not folder:
                raise ValueError(f"--query-model {name}={folder}: give a name and a folder (NAME=FOLDER)")

    def _check_adaptive(self) -> None:
        given = [
            flag
            for flag, value in (
                ("--min-layer", self.min_layer),
                ("--calibration-texts", self.calibration_texts),
            )
            if value is not None
        ]
        if given and not self.adaptive_depth:
            raise ValueError(f"{', '.join(given)} set how --adaptive-depth sheds depth; add --adaptive-depth")

    def inputs(self) -> list[tuple[str, str]]:
        """(option, path) of what the server reads, for the one writer's scope (outputs.command_scope): its
        graph cache is the only thing it writes, and may never be or hold one of them."""
        from matryoshka2d.models.backbones import local_folder

        read = [("--model", local_folder(self.model))]
        read += [("--query-model", local_folder(folder)) for folder in self.query_models.values()]
        read += [("--calibration-texts", Path(text)) for text in self.calibration_texts or ()]
        return [(option, str(path)) for option, path in read if path is not None]

    def to_json(self) -> str:
        """The config as JSON, for a worker of `serve --workers N` (serve/workers.py); `from_json` reads it."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        values = json.loads(text)
        if values.get("query_cell") is not None:
            values["query_cell"] = Cell(*values["query_cell"])
        return cls(**values)
