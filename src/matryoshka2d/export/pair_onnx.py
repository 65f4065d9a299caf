"""The ONNX graphs of a query/document pair folder (export.pair), one per route, where sentence-transformers' ONNX
backend reads them.

`SentenceTransformer(folder, backend="onnx")` hands the backend to the Router, which hands it to each route's
Transformer module; that module loads `{route}_0_Transformer/onnx/model.onnx` with optimum's
ORTModelForFeatureExtraction (token states out, `last_hidden_state`), and the route's Pooling, Dense and Normalize
run as the torch modules they are. So each route's graph is its transformer alone (onnx_graphs.TokenStatesGraph),
checked in onnxruntime against torch on other texts than it was exported with. `--quantize int8` adds
`onnx/model_qint8.onnx` beside it (onnx_graphs.quantize_int8, the int8 recipe `export` uses for a cell), which
sentence-transformers loads with `model_kwargs={"file_name": "onnx/model_qint8.onnx"}`.

That backend cannot run today (2026-11-26) with the only transformers sentence-transformers 6.2 accepts: its
`[onnx]` extra needs optimum-onnx, whose newest release (0.1.0) requires transformers<4.58 while sentence-transformers
6.2 requires transformers>=5, so `pip install "sentence-transformers[onnx]==6.2.0"` fails to resolve, and optimum
installed over its pin fails to import (`is_offline_mode`). The graphs are therefore written where the backend's
source says it reads them and checked here in onnxruntime against torch; the report says so.
"""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.export.onnx_graphs import TokenStatesGraph, export_onnx, graph_metadata, quantize_int8
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.st_folder import PAIR_ROUTES, route_transformer_dir

ROUTE_ONNX = "onnx/model.onnx"  # where sentence-transformers' ONNX backend looks inside a Transformer's folder
ROUTE_ONNX_INT8 = "onnx/model_qint8.onnx"  # load with model_kwargs={"file_name": "onnx/model_qint8.onnx"}


def write_route_graphs(folder: Path, quantize: str | None, report) -> None:
    """Each route's transformer as `onnx/model.onnx` in its Transformer's folder (and int8 beside it if asked);
    what was checked and written goes into `report` (a export.pair.PairReport)."""
    for route in PAIR_ROUTES:
        where = route_transformer_dir(folder, route)
        encoder = ElasticEncoder(str(folder), route=route, device="cpu")
        graph = export_onnx(encoder, where / ROUTE_ONNX, TokenStatesGraph(encoder), output="last_hidden_state")
        diff = float(graph_metadata(graph)["max_abs_difference_vs_torch"])
        report.checks[f"onnxruntime {route} route's token states vs torch"] = diff
        report.files[f"ONNX fp32 ({where.name}/{ROUTE_ONNX})"] = graph.stat().st_size
        if quantize == "int8":
            int8 = quantize_int8(graph, where / ROUTE_ONNX_INT8)
            report.files[f"ONNX int8 ({where.name}/{ROUTE_ONNX_INT8})"] = int8.stat().st_size
    report.notes.append(
        f"(ONNX: each route's transformer as {{route}}_0_Transformer/{ROUTE_ONNX}, where "
        'SentenceTransformer(folder, backend="onnx") reads it through optimum'
        + (f' (int8: model_kwargs={{"file_name": "{ROUTE_ONNX_INT8}"}})' if quantize == "int8" else "")
        + "; sentence-transformers 6.2's [onnx] extra does not install today (optimum-onnx 0.1.0 requires "
        "transformers<4.58, sentence-transformers 6.2 transformers>=5), so run the graphs with onnxruntime)"
    )
