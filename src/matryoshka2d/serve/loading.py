"""What a ServerConfig asks the server to run, loaded and checked: the model, the query encoders beside it (each
checked to be distilled from this very model), the backends that run them (torch, or one ONNX graph per exit layer)
and the ladder of adaptive depth, measured on those backends.

Every check that needs the model runs here, before a graph is built or a port is listened on: a default layer or
width the model does not have, a `--query-cell` outside it, a `--layers` past its depth, a query encoder of another
model, a ladder of one rung. Each message names the option, as the config's own checks do (serve/config.py).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve.backends import Backend, TorchBackend
from matryoshka2d.serve.config import ServerConfig
from matryoshka2d.serve.engine import Models
from matryoshka2d.serve.ladder import Ladder

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_encoder(config: ServerConfig, model: str, log: Log = _stderr, **options) -> ElasticEncoder:
    """The ElasticEncoder of `model` with the config's pooling, device and heads (`options` override them). With
    --no-heads it says whether the folder had heads to leave off."""
    from matryoshka2d.models.backbones import check_device

    device = options.pop("device", config.device)
    pooling = options.pop("pooling", config.pooling)
    check_device(device)
    encoder = ElasticEncoder(model, pooling=pooling, device=device, heads=not config.no_heads, **options)
    if config.no_heads:
        said = "exit heads left off (--no-heads)" if encoder.folder_has_heads else "--no-heads: it has no exit heads"
        log(f"{encoder.name}: {said}")
    return encoder


def load_models(config: ServerConfig, log: Log = _stderr) -> Models:
    """The model, its query encoders and their backends, and the ladder, as `config` asks (see the module's
    docstring); ValueError naming the option for what the model cannot serve."""
    if config.onnx_cache:  # before the model loads: makedirs would fail only after, with "[Errno 17] File exists"
        from matryoshka2d.serve.graph_cache import cache_folder_problem

        problem = cache_folder_problem(config.onnx_cache)
        if problem:
            raise ValueError(f"--onnx-cache {config.onnx_cache}: {problem}")
    device = "cpu" if config.backend == "onnx" else config.device
    lengths = {"max_length": config.max_length} if config.max_length else {}
    encoder = load_encoder(config, config.model, log, device=device, **lengths)
    check_against_the_model(config, encoder)
    queries = query_encoders(config, encoder, device, log)
    pair = getattr(encoder, "query_encoder", None)  # a query/document pair folder (export --query-model/-cell)
    if pair is not None:
        if config.query_models or config.query_cell:
            raise ValueError(
                f'--model {config.model} is a query/document pair: its query route answers input_type "query"; '
                "drop --query-model / --query-cell"
            )
        queries = {f"{config.name}-query": pair}  # checked against the teacher at export
    own_layers, records = query_layers(queries)
    layers, adaptive_layers = config.layers, None
    if config.adaptive_depth:  # checked on the encoder (its heads), before any graph is built
        from matryoshka2d.serve.depth import check_aligned

        served = [*([0] if 0 in encoder.layers else []), *(layers or range(1, encoder.num_layers + 1))]
        adaptive_layers = check_aligned(encoder, config.min_layer, served, len(queries))
        if 0 in adaptive_layers and layers is not None:
            layers = sorted({0, *layers})  # the static cell is a rung: served beside the exits
    if config.backend == "onnx":
        main, backends = onnx_backends(config, encoder, queries, own_layers, layers)
        del encoder, queries, pair  # the graphs are built: onnxruntime serves from here on, the torch weights can go
        from matryoshka2d.allocator import trim_heap

        gc.collect()
        trim_heap()
        for backend in (main, *backends.values()):
            backend.load()
    else:
        main = TorchBackend(encoder, config.batch_size, layers)
        backends = {name: TorchBackend(q, config.batch_size) for name, q in queries.items()}
    ladder = None
    if adaptive_layers is not None:
        ladder = adaptive_ladder(config, main, adaptive_layers, backends, own_layers, records, log)
    return Models(config.name, main, backends, own_layers, ladder)


def check_against_the_model(config: ServerConfig, encoder: ElasticEncoder) -> None:
    """The config's layers and widths exist in the model (checked on the encoder, before any graph is built)."""
    for flag, value, check in (
        ("--default-layer", config.default_layer, encoder.check_layer),
        ("--default-dimensions", config.default_dimensions, encoder.check_dim),
    ):
        if value is not None:
            try:
                check(value)
            except ValueError as exc:
                raise ValueError(f"{flag} {value}: {exc}") from None
    if config.query_cell is not None:
        try:
            encoder.check_layer(config.query_cell.layer), encoder.check_dim(config.query_cell.dim)
        except ValueError as exc:
            raise ValueError(f"--query-cell {config.query_cell.label}: {exc}") from None
    for n in config.layers or ():
        if n == 0:  # the static cell, where the model holds one
            try:
                encoder.check_layer(0)
            except ValueError as exc:
                raise ValueError(f"--layers 0: {exc}") from None
        elif n > encoder.num_layers:
            raise ValueError(f"--layers: {n} is out of range for {encoder.name}, which has {encoder.num_layers} layers")


def query_encoders(config: ServerConfig, encoder: ElasticEncoder, device: str | None, log: Log) -> dict:
    """--query-model NAME=FOLDER ...: query encoders distilled from the served model, by the name clients send;
    one distilled from another model is refused before the server starts."""
    from matryoshka2d.models.query_record import check_query_encoder, documents_identity, query_encoder_record_at

    out = {}
    documents = documents_identity(encoder)  # the student's width is checked against the served model's too
    for name, folder in config.query_models.items():
        record = query_encoder_record_at(folder)
        if record is None:
            raise ValueError(
                f"--query-model {folder}: not a query encoder (make one with `distill --mode query` or `--mode static`)"
            )
        check_query_encoder(record, folder, documents, "--query-model")
        if name == config.name:
            raise ValueError(
                f"--query-model {name}={folder}: the name '{name}' is taken by the served model; give another as "
                "NAME=FOLDER"
            )
        out[name] = load_encoder(config, folder, log, pooling=None, device=device)
    return out


def query_layers(queries: dict) -> tuple[dict[str, int], list[dict]]:
    """Each query encoder's own layer (0 for a static cell, `distill --mode static`; else its last), and the
    distill records that say so (they also name the texts the ladder calibrates on)."""
    from matryoshka2d.models.query_record import query_encoder_layer, query_encoder_record

    own, records = {}, []
    for name, student in queries.items():
        record = query_encoder_record(student)
        records += [record] if record else []
        own[name] = query_encoder_layer(record, student) if record else student.num_layers
    return own, records


def onnx_backends(
    config: ServerConfig, encoder: ElasticEncoder, queries: dict, own_layers: dict[str, int], layers: list[int] | None
) -> tuple[Backend, dict[str, Backend]]:
    """The model's ONNX graphs (only `layers`' when given) and each query encoder's graph of its own layer, built
    into the cache or taken from it (serve/graph_cache.py)."""
    from matryoshka2d.export.onnx_graphs import require_onnx
    from matryoshka2d.serve.backends import OnnxBackend

    require_onnx()
    main = OnnxBackend(encoder, config.quantize, layers, config.onnx_cache, batch_size=config.batch_size)
    backends = {
        name: OnnxBackend(q, config.quantize, [own_layers[name]], config.onnx_cache, batch_size=config.batch_size)
        for name, q in queries.items()
    }
    return main, backends


def adaptive_ladder(
    config: ServerConfig,
    model: Backend,
    layers: list[int],
    queries: dict[str, Backend],
    own_layers: dict[str, int],
    records: list[dict],
    log: Log,
) -> Ladder:
    """The ladder of --adaptive-depth (serve/ladder.py): the model's aligned `layers` and every query encoder
    (`records`: their distill records, which name the texts they learned from), each rung's cost and quality
    measured on the backend that serves it."""
    from matryoshka2d.serve.ladder import build_ladder, calibration_texts

    texts, source = calibration_texts(config.calibration_texts, records, model.tokenizer)
    rungs = [f"{config.name}@{n}" for n in layers] + [f"{q}@{own_layers[q]}" for q in queries]
    log(
        f"adaptive depth: measuring the cost of {', '.join(rungs)}, and their quality on {len(texts)} texts of "
        f"{source}..."
    )
    with_layers = {name: (backend, own_layers[name]) for name, backend in queries.items()}
    return build_ladder(config.name, model, layers, with_layers, config.target_ms, texts)
