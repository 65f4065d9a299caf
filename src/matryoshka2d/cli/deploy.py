"""`matryoshka2d export` and `matryoshka2d serve`: parse arguments, call deploy/, print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from matryoshka2d.cli.args import (
    command,
    count,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    reads_and_writes,
    refuse_pooling_at_static_cell,
    token_length,
)


def cmd_export(args) -> int:
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.deploy.export import export_cell

    if args.query_model or args.query_cell:
        return export_pair_command(args)
    if args.layer is None or args.dim is None:
        raise ValueError("export needs --layer and --dim (a cell), or --query-model / --query-cell (a pair)")
    if args.layer == 0:
        refuse_pooling_at_static_cell(args, "--layer")
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


def export_pair_command(args) -> int:
    """export --query-model FOLDER | --query-cell LAYERxDIM: the model and its query side as one folder."""
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.deploy.pair import export_pair, parse_query_cell

    if args.query_model and args.query_cell:
        raise ValueError("give --query-model or --query-cell, not both: a pair has one query side")
    if args.layer is not None or args.dim is not None or args.normalize is not None:
        raise ValueError("--layer, --dim and --normalize export one cell; a pair's cells are its query side's")
    cell = parse_query_cell(args.query_cell) if args.query_cell else None
    output = Path(args.output)
    encoder = load_encoder(args, device="cpu")
    report = export_pair(
        encoder,
        output,
        query_model=args.query_model,
        query_cell=cell,
        fmt=args.format,
        quantize=args.quantize,
        overwrite=args.overwrite,
    )
    print("\n".join(report.lines()))
    return 0


def check_listen(host: str, port: int) -> None:
    """The address can be listened on, checked before the model loads: a port out of range or taken, or a host
    that is not this machine's, is a message naming the flag (uvicorn would fail with a traceback, or only after
    the model loaded)."""
    import socket

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
    if args.workers > 1:  # N processes on one port, each this same command as one worker (deploy/workers.py)
        from matryoshka2d.deploy.workers import check_workers, serve_in_workers

        check_workers(args.workers)
        check_listen(args.host, args.port)  # once here, before any worker loads a model
        return serve_in_workers(args.argv, args.workers, args.host, args.port, args.drain_seconds)
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.deploy.server import ServerLimits, serve

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
    depth_flags = [
        f
        for f, v in (
            ("--target-ms", args.target_ms),
            ("--min-layer", args.min_layer),
            ("--calibration-texts", args.calibration_texts),
        )
        if v is not None
    ]
    if depth_flags and not args.adaptive_depth:
        raise ValueError(f"{', '.join(depth_flags)} set how --adaptive-depth sheds depth; add --adaptive-depth")
    from matryoshka2d.deploy.admission import Admission
    from matryoshka2d.deploy.routing import parse_cell

    admission = Admission.from_options(args.api_key, args.max_queued_texts, args.max_queue_ms)  # refuses an empty key
    query_cell = parse_cell(args.query_cell) if args.query_cell is not None else None
    if query_cell is not None and args.default_dimensions is not None and args.default_dimensions > query_cell[1]:
        # before the model loads (deploy/routing.py Catalog refuses it too, for library callers)
        raise ValueError(
            f"--default-dimensions {args.default_dimensions}: queries and documents of this pair have {query_cell[1]} "
            f"numbers (--query-cell {args.query_cell}), so requests with input_type could not get "
            f"{args.default_dimensions}; give at most {query_cell[1]}"
        )
    if args.onnx_cache:  # before the model loads: makedirs would fail only after, with "[Errno 17] File exists"
        from matryoshka2d.deploy.backends import cache_folder_problem

        problem = cache_folder_problem(args.onnx_cache)
        if problem:
            raise ValueError(f"--onnx-cache {args.onnx_cache}: {problem}")
    if args.backend == "onnx" and args.device not in (None, "cpu"):
        raise ValueError(f"--backend onnx runs on the CPU (onnxruntime); drop --device {args.device}")
    check_listen(args.host, args.port)
    lengths = {"max_length": args.max_length} if args.max_length else {}
    encoder = load_encoder(args, device="cpu" if args.backend == "onnx" else args.device, **lengths)
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
    if query_cell is not None:
        try:
            encoder.check_layer(query_cell[0]), encoder.check_dim(query_cell[1])
        except ValueError as exc:
            raise ValueError(f"--query-cell {args.query_cell}: {exc}") from None
    students = query_models(args, encoder)  # name -> query encoder, each checked against this model
    pair = getattr(encoder, "query_encoder", None)  # a query/document pair folder (export --query-model/-cell)
    if pair is not None:
        if args.query_model or args.query_cell:
            raise ValueError(
                f'--model {args.model} is a query/document pair: its query route answers input_type "query"; '
                "drop --query-model / --query-cell"
            )
        students = {f"{args.served_name or args.model}-query": pair}  # checked against the teacher at export
    from matryoshka2d.models.identity import query_encoder_layer, query_encoder_record

    own_layers, query_records = {}, []
    for student_name, student in students.items():  # 0 for a static cell (distill --mode static), else its last
        record = query_encoder_record(student)
        query_records += [record] if record else []
        own_layers[student_name] = query_encoder_layer(record, student) if record else student.num_layers
    adaptive_layers = None
    if args.adaptive_depth:  # checked on the encoder (its heads), before any graph is built
        from matryoshka2d.deploy.depth import check_aligned

        served_layers = [*([0] if 0 in encoder.layers else []), *(layers or range(1, encoder.num_layers + 1))]
        adaptive_layers = check_aligned(encoder, args.min_layer, served_layers, len(students))
        if args.backend == "onnx" and 0 in adaptive_layers and layers is not None:
            layers = sorted({0, *layers})  # the static cell is a rung: served beside the graphs
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
            name: OnnxBackend(q, args.quantize, [own_layers[name]], args.onnx_cache, batch_size=args.batch_size)
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
    elif args.adaptive_depth:
        from matryoshka2d.deploy.backends import TorchBackend

        model = TorchBackend(encoder, args.batch_size)  # the controller measures the backend that serves
    name = args.served_name or args.model
    ladder = None
    if args.adaptive_depth:
        ladder = adaptive_ladder(args, name, model, adaptive_layers, students, own_layers, query_records)
    limits = ServerLimits(
        max_inputs=args.max_inputs,
        max_body_bytes=args.max_body_bytes,
        truncate=args.truncate,
        max_batch=args.max_batch,
        batch_size=args.batch_size,
        max_wait=args.max_wait_ms / 1000,
        max_queued_texts=args.max_queued_texts,
        max_queue_ms=args.max_queue_ms,
        max_input_chars=args.max_input_chars,
    )
    kind = f"onnx {args.quantize or 'fp32'}" if args.backend == "onnx" else "torch"
    print(
        f"serving {name} ({kind}): {model.num_layers} layers x {model.hidden_size} dims on http://{args.host}:"
        f"{args.port} (POST /v1/embeddings, GET /v1/models, GET /health); cells by name: {name}@<layer>x<dimensions>",
        file=sys.stderr,
    )
    guards = [f"at most {args.max_queued_texts} texts waiting (429 past it)"]
    if args.max_queue_ms is not None:
        guards.append(f"nor more than {args.max_queue_ms:g} ms of the model's time")
    guards.append("API key required (Authorization: Bearer)" if admission.needs_key else "no API key (open to all)")
    if ladder is not None:
        rungs = ", ".join(f"{r.name} ({r.quality:.3f})" for r in ladder.rungs)
        guards.append(f"adaptive depth: rungs {rungs}; target {ladder.target_ms:g} ms")
    if query_cell is not None:
        guards.append(f"input_type query -> {name}@{query_cell[0]}x{query_cell[1]}")
    print("; ".join(guards), file=sys.stderr)  # the key itself is never printed
    serve(
        model,
        name,
        host=args.host,
        port=args.port,
        limits=limits,
        log_level=args.log_level,
        drain_seconds=args.drain_seconds,
        default_layer=args.default_layer,
        default_dimensions=args.default_dimensions,
        query_models=students,
        query_layers=own_layers,
        query_cell=query_cell,
        ladder=ladder,
        admission=admission,
    )
    return 0


def adaptive_ladder(args, name: str, model, layers: list[int], students: dict, own_layers: dict, records: list):
    """The ladder of --adaptive-depth (deploy/ladder.py): the model's aligned `layers` and every query encoder
    (`records`: their distill records, which name the texts they learned from), each rung's cost and quality
    measured on the backend that serves it."""
    from matryoshka2d.deploy.backends import TorchBackend
    from matryoshka2d.deploy.ladder import build_ladder, calibration_texts
    from matryoshka2d.models.encoder import ElasticEncoder

    queries = {
        student: (TorchBackend(q, args.batch_size) if isinstance(q, ElasticEncoder) else q, own_layers[student])
        for student, q in students.items()
    }
    texts, source = calibration_texts(args.calibration_texts, records, model.tokenizer)
    rungs = [f"{name}@{n}" for n in layers] + [f"{q}@{layer}" for q, (_, layer) in queries.items()]
    print(
        f"adaptive depth: measuring the cost of {', '.join(rungs)}, and their quality on {len(texts)} texts of "
        f"{source}...",
        file=sys.stderr,
    )
    return build_ladder(name, model, layers, queries, args.target_ms or 50.0, texts)


def query_models(args, encoder) -> dict:
    """--query-model [NAME=]FOLDER ...: query encoders distilled from the served model, by the name clients send
    (default: the folder's name); one distilled from another model is refused before the server starts."""
    import argparse

    from matryoshka2d.cli.args import load_encoder, named_folder
    from matryoshka2d.models.identity import check_query_encoder, documents_identity, query_encoder_record_at

    out = {}
    documents = documents_identity(encoder)  # the student's width is checked against the served model's too
    for item in args.query_model or ():
        try:  # NAME=FOLDER splits at the first '=' after a plain name: q=/runs/a=b/q is q and /runs/a=b/q
            name, folder = named_folder(item)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--query-model {exc}") from None
        record = query_encoder_record_at(folder)
        if record is None:
            raise ValueError(
                f"--query-model {folder}: not a query encoder (make one with `distill --mode query` or `--mode static`)"
            )
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
        type=count,
        help="keep this many transformer layers (one cell); 0: the model's static cell, as StaticEmbedding and "
        "Dense modules",
    )
    p.add_argument("--dim", type=positive_int, help="keep the first DIM numbers of each embedding (one cell)")
    p.add_argument(
        "--query-model",
        help="a pair: this query encoder (`distill --mode query` from --model) for encode_query, --model for "
        "encode_document, as one sentence-transformers folder (Router.for_query_document)",
    )
    p.add_argument(
        "--query-cell",
        metavar="LAYERxDIM",
        help="a pair: this shallow cell of --model for encode_query, its last layer at the same width for "
        "encode_document, as one sentence-transformers folder",
    )
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
    reads_and_writes(p, ("--model", "--query-model", "--sts-file"))

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
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--served-name", help="the model id clients send (default: --model as given)")
    p.add_argument("--default-layer", type=count, help="layer for requests that name none (default: the last)")
    p.add_argument(
        "--default-dimensions", type=positive_int, help="width for requests that name none (default: the full width)"
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=64,
        help="texts collected from requests for one model call, which answers them together at its end (the "
        "default: one forward pass)",
    )
    p.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward pass within a model call")
    p.add_argument(
        "--max-wait-ms",
        type=non_negative_float,
        default=0.0,  # deploy/micro_batching.py DEFAULT_MAX_WAIT: why a batch does not wait by default
        help="how long a batch that found others queued waits for more requests (a lone request never waits); worth "
        "it only where a call's fixed cost is large, as on a GPU",
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
    p.add_argument(
        "--query-cell",
        metavar="LAYERxDIM",
        help='answer requests with input_type "query" at this cell of the model (e.g. 3x384), documents at the full '
        "depth and the same width (default: the one --query-model, if one is given)",
    )
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
        help="also answer 429 when what waits would take the model longer than this (texts waiting x recent time "
        "per text): a bound in time that follows the machine's load (default: the bound in texts alone)",
    )
    p.add_argument(
        "--drain-seconds",
        type=positive_float,
        default=30.0,
        help="on SIGTERM: 503 to new requests, and this long at most to answer the accepted ones before exiting",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="server processes on the one port, each with its own model and bounds, started and drained together "
        "(at most the CPUs this process may use; Linux)",
    )
    p.add_argument(
        "--adaptive-depth",
        action="store_true",
        help='requests that name no layer (or layer "auto") are answered by a ladder of rungs that all answer in the '
        "model's space: its full depth, its exits with heads (down to --min-layer), its static cell, and every "
        "--query-model; the mix of rungs with the most quality that the present arrival rate leaves time for",
    )
    p.add_argument(
        "--target-ms",
        type=positive_float,
        help="adaptive depth: the latency target; a backlog past it sends open requests to the cheapest rung until "
        "it drains (default 50)",
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
    p.set_defaults(func=cmd_serve)
    # serve writes only its graph cache (--onnx-cache), kept by design in the model folder when not given
    reads_and_writes(p, ("--model", "--query-model", "--calibration-texts"), output=None, caches=("--onnx-cache",))
