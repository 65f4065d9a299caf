"""The commands `pick` recommends to deploy an option, each built through the checks the command itself runs on
those options (export.cell.check_format for `export`, serve.config.ServerConfig for `serve`), so that pick never
recommends a command that then refuses: where the option's backend has no export of its cell (layer 0, the static
cell, exports as a sentence-transformers folder only), the export line is the one that command takes, and says why.
"""

from __future__ import annotations

from matryoshka2d.export.cell import ExportError, check_format
from matryoshka2d.serve.config import ServerConfig

# What `serve` and `eval` take to run on each backend (`export` takes --format onnx instead of --backend onnx).
SERVE_FLAGS = {"torch": "", "onnx": " --backend onnx", "onnx-int8": " --backend onnx --quantize int8"}
# backend -> (serve's --backend, --quantize), (export's --format, --quantize)
SERVED_AS = {"torch": ("torch", None), "onnx": ("onnx", None), "onnx-int8": ("onnx", "int8")}
EXPORTED_AS = {"torch": ("st", None), "onnx": ("onnx", None), "onnx-int8": ("onnx", "int8")}


def deployment(p, model: str, full: tuple[int, int], retrieval: bool) -> list[str]:
    """How to deploy an option (a picker.Point): the exact commands, and what it does to an index of the full
    model's documents."""
    onnx = SERVE_FLAGS[p.backend]
    full_cell = f"({full[0]},{full[1]})"
    if p.kind == "query-encoder":
        return [
            f"documents stay the teacher's at {full_cell}: an index {model} built stays valid",
            f"search: `matryoshka2d search --index INDEX --query-model {p.query_model}`",
            f"serve: `matryoshka2d serve --model {model}{onnx} --query-model {p.query_model}`",
        ]
    if p.kind == "query-layer":
        return [
            f"documents stay at {full_cell}: an index {model} built there stays valid; queries run {p.layer} layers",
            f"search: `matryoshka2d search --index INDEX --query-layer {p.layer}`",
            f"serve: `matryoshka2d serve --model {model}{onnx}` and request `layer: {p.layer}`",
        ]
    if p.kind == "storage":
        return [
            f"documents at {p.cell} as {p.storage}: the same vectors, held by a new index "
            f"(`matryoshka2d index build --model {model} --corpus CORPUS --cells {p.layer}:{p.dim} --storage "
            f"{p.storage} --output INDEX`)",
            "search: `matryoshka2d search --index INDEX`",
        ]
    if p.kind == "cascade":
        s = p.shortlist_cell
        return [
            f"re-encodes the corpus at ({s[0]},{s[1]}) and {p.cell}: `matryoshka2d index build --model {model} "
            f"--corpus CORPUS --cells {s[0]}:{s[1]},{p.layer}:{p.dim} --output INDEX`",
            f"search: `matryoshka2d search --index INDEX --cascade {s[0]}:{s[1]},{p.layer}:{p.dim}`",
        ]
    lines = [serve_line(p, model), export_line(p, model)]
    if retrieval:
        lines.insert(
            0,
            f"documents at {p.cell}: an index of {full_cell} stays valid"
            if (p.layer, p.dim) == full
            else f"re-encodes the corpus at {p.cell}: `matryoshka2d index build --model {model} --corpus CORPUS "
            f"--cells {p.layer}:{p.dim} --output INDEX`",
        )
    return lines


def serve_line(p, model: str) -> str:
    """`serve` of one cell on the option's backend, its options checked as `serve` checks them (ServerConfig)."""
    backend, quantize = SERVED_AS[p.backend]
    layers = [p.layer] if backend == "onnx" else None  # an ONNX server builds a graph for the layer it serves only
    # a key of its own, so that only the line's options are checked (not a key the environment may hold)
    ServerConfig(
        model=model,
        backend=backend,
        quantize=quantize,
        layers=layers,
        default_layer=p.layer,
        default_dimensions=p.dim,
        api_key="checked-by-pick",
    )
    flags = SERVE_FLAGS[p.backend] + (f" --layers {p.layer}" if layers else "")
    return f"serve: `matryoshka2d serve --model {model}{flags} --default-layer {p.layer} --default-dimensions {p.dim}`"


def export_line(p, model: str) -> str:
    """`export` of the cell in the option's backend's format where export takes that (check_format), else in the
    format it does take, saying why."""
    command = f"matryoshka2d export --model {model} --layer {p.layer} --dim {p.dim}"
    fmt, quantize = EXPORTED_AS[p.backend]
    try:
        check_format(p.layer, fmt, quantize)
    except ExportError as refused:
        check_format(p.layer, "st", None)  # the format every cell exports as
        return f"export: `{command} --output DIR` (a sentence-transformers folder: {refused})"
    flags = (f" --format {fmt}" if fmt != "st" else "") + (f" --quantize {quantize}" if quantize else "")
    return f"export: `{command}{flags} --output DIR`"
