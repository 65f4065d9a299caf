"""`matryoshka2d serve`: parse the arguments into a ServerConfig and run the server (matryoshka2d.serve)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from matryoshka2d.cli.args import (
    command,
    count,
    layer_list,
    named_folder,
    non_negative_float,
    one_cell,
    port,
    positive_float,
    positive_int,
    reads_and_writes,
    token_length,
)


def cmd_serve(args) -> int:
    from matryoshka2d.serve.process import run

    return run(config_of(args))


def config_of(args):
    """The ServerConfig of a `serve` command line: every option is the field of its name (checked there once)."""
    from matryoshka2d.serve.config import ServerConfig

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if f.name != "query_models"}
    return ServerConfig(**values, query_models=query_models(args.query_model))


def query_models(items: list[str] | None) -> dict[str, str]:
    """--query-model [NAME=]FOLDER ...: name -> folder, a name by default the folder's name; a name given twice
    is refused."""
    out: dict[str, str] = {}
    for item in items or ():
        try:  # NAME=FOLDER splits at the first '=' after a plain name: q=/runs/a=b/q is q and /runs/a=b/q
            name, folder = named_folder(item)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--query-model {exc}") from None
        name = name or Path(folder).name
        if name in out:
            raise ValueError(f"--query-model {item}: the name '{name}' is taken; give another as NAME=FOLDER")
        out[name] = folder
    return out


def register(sub, model_args) -> None:
    p = command(
        sub,
        "serve",
        cmd_serve,
        help="OpenAI-compatible embeddings server; one model serves every (layer, dim) cell",
        description="POST /v1/embeddings (OpenAI's request plus optional 'layer' and 'embedding_type'), GET "
        "/v1/models, GET /health. A model name MODEL@LAYERxDIMS (e.g. minilm-l6@3x128) asks for that cell. "
        "Concurrent requests are micro-batched in one model worker.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows every default
    )
    model_args(p)
    _address_and_defaults(p)
    _batching_and_limits(p)
    _backend_and_encoders(p)
    _guards_and_process(p)
    _adaptive_depth(p)
    p.set_defaults(func=cmd_serve)
    # serve writes only its graph cache (--onnx-cache), kept by design in the model folder when not given
    reads_and_writes(p, ("--model", "--query-model", "--calibration-texts"), output=None, caches=("--onnx-cache",))


def _address_and_defaults(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--served-name", help="the model id clients send (default: the model folder's name)")
    p.add_argument("--default-layer", type=count, help="layer for requests that name none (default: the last)")
    p.add_argument(
        "--default-dimensions", type=positive_int, help="width for requests that name none (default: the full width)"
    )


def _batching_and_limits(p) -> None:
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=64,
        help="texts collected from requests for one model call, which answers them together at its end (the "
        "default: one forward pass)",
    )
    p.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward pass within a model call")
    p.add_argument(
        "--target-ms",
        type=positive_float,
        default=50.0,  # serve/batching.py DEFAULT_TARGET_MS
        help="the latency objective: no model call grows past what keeps the queue within it, and with "
        "--adaptive-depth a backlog past it sends open requests to the cheapest rung until it drains",
    )
    p.add_argument(
        "--max-wait-ms",
        type=non_negative_float,
        help="the most a call waits for more requests (default: as long as the measured costs say it pays: never "
        "where a call's fixed cost is small next to a text's, as on a CPU, nor while no other requests arrive; 0: "
        "never)",
    )
    p.add_argument("--max-inputs", type=positive_int, default=2048, help="texts per request")
    p.add_argument(
        "--max-body-bytes", type=positive_int, default=8 * 1024 * 1024, help="request body limit (413 above)"
    )
    p.add_argument("--truncate", action="store_true", help="cut texts over the model's length instead of a 400")
    p.add_argument(
        "--max-input-chars",
        type=positive_int,
        help="characters of one text the server reads: a longer text gets a 400 before it is tokenized, or is cut "
        "there with --truncate (default: 32 per token of the model's maximum length)",
    )
    p.add_argument(
        "--max-length",
        type=token_length,
        help="tokens per text (default: the model's own); longer texts get a 400, or are cut with --truncate",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _backend_and_encoders(p) -> None:
    p.add_argument(
        "--backend",
        choices=["torch", "onnx"],
        default="torch",
        help="what runs the model: torch, or onnxruntime with one ONNX graph per exit layer, built once and cached "
        "beside the model (extra [onnx])",
    )
    p.add_argument("--quantize", choices=["int8"], help="onnx backend: dynamic int8 graphs")
    p.add_argument(
        "--query-model",
        action="append",
        metavar="[NAME=]FOLDER",
        help="also serve a query encoder distilled from --model (`distill --mode query`) under its own name "
        "(default: the folder's name), at its own layers; repeat for several",
    )
    p.add_argument(
        "--layers",
        type=layer_list,
        help="serve only these layers, e.g. 1,3,6 or 2-4 (0: the model's static cell), and answer no other; with "
        "--backend onnx their sessions load up front (default: every layer; onnx loads each at its first request)",
    )
    p.add_argument(
        "--onnx-cache", help="onnx backend: folder for the graphs (default: onnx-serve/ in the model folder)"
    )
    p.add_argument(
        "--query-cell",
        type=one_cell,
        metavar="LAYERxDIM",
        help='answer requests with input_type "query" at this cell of the model (e.g. 3x384), documents at the full '
        "depth and the same width (default: the one --query-model, if one is given)",
    )


def _guards_and_process(p) -> None:
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every route but /health (default: the MATRYOSHKA2D_API_KEY "
        "environment variable, which keeps the key off the command line; none: open to all)",
    )
    p.add_argument(
        "--max-queued-texts",
        type=positive_int,
        default=1024,
        help="texts waiting for the model past which a request is answered 429 with Retry-After (size it to what "
        "your clients wait: about the texts per second the model answers, times their timeout)",
    )
    p.add_argument(
        "--max-queue-ms",
        type=positive_float,
        default=2000.0,  # serve/admission.py DEFAULT_DEADLINE_MS
        help="the deadline: answer 429 at once, before any work, to a request the model could not answer within "
        "this (texts waiting x recent time per text, the rest of the call running, its own texts); a client's "
        "shorter x-stainless-read-timeout (OpenAI's SDKs send their timeout) applies to its own requests",
    )
    p.add_argument(
        "--drain-seconds",
        type=positive_float,
        default=30.0,
        help="on SIGTERM: 503 to new requests (the port stays open), and this long at most to answer the accepted "
        "ones before exiting",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="server processes on the one port, each with its own model and bounds, started and drained together "
        "(at most the CPUs this process may use; Linux)",
    )


def _adaptive_depth(p) -> None:
    p.add_argument(
        "--adaptive-depth",
        action="store_true",
        help='requests that name no layer (or layer "auto") are answered by a ladder of rungs that all answer in the '
        "model's space: its full depth, its exits with heads (down to --min-layer), its static cell, and every "
        "--query-model; the mix of rungs with the most quality that the present arrival rate leaves time for",
    )
    p.add_argument(
        "--min-layer", type=count, help="adaptive depth: the model's shallowest exit on the ladder (default: the first "
        "aligned)",
    )  # fmt: skip
    p.add_argument(
        "--calibration-texts",
        nargs="+",
        metavar="FILE",
        help="adaptive depth: texts like the queries served (one a line, or any training file), on which each rung's "
        "quality is measured at start (default: the query-like files the rungs' distill records name)",
    )
