"""`matryoshka2d export` and `matryoshka2d serve`: parse arguments, call deploy/, print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from matryoshka2d.cli.args import command


def cmd_export(args) -> int:
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.deploy.export import export_cell

    encoder = load_encoder(args, device="cpu")
    report = export_cell(
        encoder,
        args.layer,
        args.dim,
        args.output,
        fmt=args.format,
        quantize=args.quantize,
        overwrite=args.overwrite,
        normalize=args.normalize,
        sts_file=args.sts_file,
    )
    print("\n".join(report.lines()))
    return 0


def check_listen(host: str, port: int) -> None:
    """The address can be listened on, checked before the model loads: a port out of range or taken, or a host
    that is not this machine's, is a message naming the flag (uvicorn would fail with a traceback, or only after
    the model loaded)."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be 0..65535 (0: any free port), got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            sock.bind(address)
        except OSError as exc:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None


def cmd_serve(args) -> int:
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.deploy.server import ServerLimits, serve

    for name in ("max_batch", "batch_size", "max_inputs", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_wait_ms < 0:
        raise ValueError(f"--max-wait-ms must be at least 0, got {args.max_wait_ms}")
    if args.backend == "torch" and (args.quantize or args.layers is not None or args.onnx_cache):
        used = [
            f
            for f, v in (
                ("--quantize", args.quantize),
                ("--layers", args.layers is not None),
                ("--onnx-cache", args.onnx_cache),
            )
            if v
        ]
        raise ValueError(f"{', '.join(used)} apply to --backend onnx; the torch backend serves every layer in fp32")
    layers = parse_layers(args.layers) if args.layers is not None else None
    if args.onnx_cache:  # before the model loads: makedirs would fail only after, with "[Errno 17] File exists"
        from matryoshka2d.deploy.backends import cache_folder_problem

        problem = cache_folder_problem(args.onnx_cache)
        if problem:
            raise ValueError(f"--onnx-cache {args.onnx_cache}: {problem}")
    if args.backend == "onnx" and args.device not in (None, "cpu"):
        raise ValueError(f"--backend onnx runs on the CPU (onnxruntime); drop --device {args.device}")
    check_listen(args.host, args.port)
    encoder = load_encoder(args, device="cpu" if args.backend == "onnx" else args.device)
    # Checked on the encoder, before any ONNX graph is built (a backend has no check_layer / check_dim).
    for flag, value, check in (
        ("--default-layer", args.default_layer, encoder.check_layer),
        ("--default-dimensions", args.default_dimensions, encoder.check_dim),
    ):
        if value is not None:
            try:
                check(value)
            except ValueError as exc:
                raise ValueError(f"{flag} {value}: {exc}") from None
    students = query_models(args, encoder)  # name -> query encoder, each checked against this model
    model = encoder
    if args.backend == "onnx":
        from matryoshka2d.deploy.backends import OnnxBackend
        from matryoshka2d.deploy.onnx_graphs import require_onnx

        require_onnx()
        for n in layers or []:
            if not 1 <= n <= encoder.num_layers:
                raise ValueError(
                    f"--layers: {n} is out of range for {encoder.name}, which has {encoder.num_layers} layers"
                )
        model = OnnxBackend(encoder, args.quantize, layers, args.onnx_cache, batch_size=args.batch_size)
        students = {
            name: OnnxBackend(q, args.quantize, [q.num_layers], args.onnx_cache, batch_size=args.batch_size)
            for name, q in students.items()
        }
        del encoder  # the graphs are built: onnxruntime serves from here on, the torch weights can go
        import gc

        from matryoshka2d.allocator import trim_heap

        gc.collect()
        trim_heap()
        model.load()
        for q in students.values():
            q.load()
    limits = ServerLimits(
        max_inputs=args.max_inputs,
        max_body_bytes=args.max_body_bytes,
        truncate=args.truncate,
        max_batch=args.max_batch,
        batch_size=args.batch_size,
        max_wait=args.max_wait_ms / 1000,
    )
    name = args.served_name or args.model
    kind = f"onnx {args.quantize or 'fp32'}" if args.backend == "onnx" else "torch"
    print(
        f"serving {name} ({kind}): {model.num_layers} layers x {model.hidden_size} dims on http://{args.host}:"
        f"{args.port} (POST /v1/embeddings, GET /v1/models, GET /health); cells by name: {name}@<layer>x<dimensions>",
        file=sys.stderr,
    )
    serve(
        model,
        name,
        host=args.host,
        port=args.port,
        limits=limits,
        log_level=args.log_level,
        default_layer=args.default_layer,
        default_dimensions=args.default_dimensions,
        query_models=students,
    )
    return 0


def query_models(args, encoder) -> dict:
    """--query-model [NAME=]FOLDER ...: query encoders distilled from the served model, by the name clients send
    (default: the folder's name); one distilled from another model is refused before the server starts."""
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.models.identity import check_query_encoder, query_encoder_record_at, weights_sha256

    out = {}
    documents = {"model": encoder.name, "weights_sha256": weights_sha256(encoder), "pooling": encoder.pooling}
    for item in args.query_model or ():
        name, _, folder = item.rpartition("=") if "=" in item else ("", "", item)
        record = query_encoder_record_at(folder)
        if record is None:
            raise ValueError(f"--query-model {folder}: not a query encoder (make one with `distill --mode query`)")
        check_query_encoder(record, folder, documents, "--query-model")
        student = load_encoder(
            args, model=folder, pooling=None, device="cpu" if args.backend == "onnx" else args.device
        )
        name = name or Path(folder).name
        if name in out or name == (args.served_name or args.model):
            raise ValueError(f"--query-model {item}: the name '{name}' is taken; give another as NAME=FOLDER")
        out[name] = student
    return out


def parse_layers(text: str) -> list[int]:
    """--layers 1,3,6: distinct positive integers (an empty list is refused, not read as every layer)."""
    if not text.strip():
        raise ValueError("--layers is empty: give the layers to serve, such as 1,3,6, or leave --layers out for all")
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be comma-separated layer numbers such as 1,3,6, got {text!r}") from None
    if any(n < 1 for n in layers):
        raise ValueError(f"--layers must be layer numbers of at least 1, got {text!r}")
    return sorted(set(layers))


def register(sub, model_args) -> None:
    p = command(
        sub,
        "export",
        cmd_export,
        help="write one (layer, dim) cell as a standalone model (sentence-transformers folder, ONNX, int8)",
        description="A folder holding only LAYER layers (config and weights cut), the model's pooling, the first "
        "DIM numbers and Normalize as the cell does: plain SentenceTransformer(OUTPUT) gives the cell's "
        "embeddings and AutoModel.from_pretrained(OUTPUT) loads the cut transformer. Prints size on disk and "
        "parameters kept.",
    )
    model_args(p)
    p.add_argument(
        "--layer",
        type=int,
        required=True,
        help="keep this many transformer layers; 0: the model's static cell, as StaticEmbedding and Dense modules",
    )
    p.add_argument("--dim", type=int, required=True, help="keep the first DIM numbers of each embedding")
    p.add_argument("--output", required=True, help="folder to write (must be empty or absent, see --overwrite)")
    p.add_argument("--format", choices=["st", "onnx"], default="st", help="onnx adds onnx/cell.onnx (extra [onnx])")
    p.add_argument("--quantize", choices=["int8"], help="add onnx/cell_int8.onnx (dynamic int8; needs --format onnx)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise after slicing (default: as the model does; it has a Normalize module or not)",
    )
    p.add_argument("--sts-file", help="STS-B test TSV for the int8 score (default: the shared data's stsb_test.tsv)")

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
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-name", help="the model id clients send (default: --model as given)")
    p.add_argument("--default-layer", type=int, help="layer for requests that name none (default: the last)")
    p.add_argument("--default-dimensions", type=int, help="width for requests that name none (default: the full width)")
    p.add_argument("--max-batch", type=int, default=256, help="texts collected from requests for one model call")
    p.add_argument("--batch-size", type=int, default=64, help="texts per forward pass within a model call")
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="how long a batch waits for more requests when others are already queued (a lone request never waits)",
    )
    p.add_argument("--max-inputs", type=int, default=2048, help="texts per request")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="request body limit (413 above)")
    p.add_argument("--truncate", action="store_true", help="cut texts over the model's length instead of a 400")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
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
        help="onnx backend: serve only these layers, their sessions loaded up front, e.g. 1,3,6 (default: every "
        "layer, each session loaded at its first request)",
    )
    p.add_argument(
        "--onnx-cache", help="onnx backend: folder for the graphs (default: onnx-serve/ in the model folder)"
    )
    p.set_defaults(func=cmd_serve)
