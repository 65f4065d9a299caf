"""Whether an ONNX exit graph from the serving cache (serve/graph_cache.py, GraphCache) may be served.

The manifest's checksums say a graph is the file that was written; they do not say it computes this model (a
manifest can be edited, a folder copied from another model). So a cached graph, the first time a process uses
it, must do what the build checked: reproduce `encoder.forward` at its layer on the fixed CHECK_SENTENCES, fp32
within ONNX_ATOL (as export_onnx checks it), int8 with a lowest cosine no worse than the build recorded and at
least INT8_MIN_COSINE; and give each of those sentences alone the vector it gives inside their call (a text's
vector must not move with what shares its call: BATCH_RTOL). A graph onnxruntime cannot load or run (an
unknown or custom op, a damaged file) fails the check the same way, and so does one whose external data is named
outside the cache folder (refused before onnxruntime opens anything), and one that is not the precision its name
says (an int8 graph must hold quantized operators, an fp32 one none). A graph that fails is rebuilt, never served
(`check_graph` says why).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from matryoshka2d.export.onnx_graphs import (
    CHECK_SENTENCES,
    ONNX_ATOL,
    ExportError,
    external_data_inside,
    graph_precision,
)
from matryoshka2d.models.encoder import ElasticEncoder

# The lowest cosine an int8 graph may have against torch on CHECK_SENTENCES: int8 weights with one scale per channel
# give 0.99 and more on minilm-l6 (docs/benchmarks.md, issues 19 and 61); a graph of another model, or
# quantization that broke the model, gives far less. A cached int8 graph must also be within INT8_COSINE_SLACK of
# the cosine its build recorded (the same graph gives the same numbers but for the order of float sums).
INT8_MIN_COSINE = 0.9
INT8_COSINE_SLACK = 1e-3
# How far a check sentence's vector may move between alone and inside the call of all four (issue 61), as
# |alone - together| / |alone|: float sums taken in another order move an fp32 graph, and an int8 one with one
# activation scale per row, by about 1e-7 (minilm-l6 and a tiny random BERT alike); int8 with one activation scale
# per call (onnxruntime's dynamic quantization as it is) by 0.15 on minilm-l6 and 3e-4 on the tiny BERT. A cosine
# is too blunt a measure here: 1 - cosine is half the square of the move, 4e-8 for that tiny BERT's 3e-4.
BATCH_RTOL = 1e-5


def reference(encoder: ElasticEncoder, layer: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The check sentences as model inputs, and what encoder.forward makes of them at `layer`."""
    features = encoder.tokenize(CHECK_SENTENCES)
    with torch.inference_mode():
        expected = encoder.forward(features, [layer])[layer].float().cpu().numpy()
    return {k: v.cpu().numpy().astype(np.int64) for k, v in features.items()}, expected


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return np.einsum("ij,ij->i", a, b)


def run_reference(path: Path, features: dict[str, np.ndarray], threads: int = 1) -> np.ndarray:
    graph = session(path, threads)
    return graph.run(None, {i.name: features[i.name] for i in graph.get_inputs()})[0]


def moved_by_call(path: Path, features: dict[str, np.ndarray], together: np.ndarray) -> float:
    """How far a text's vector moves with what shares its call: the largest |alone - together| / |alone| over the
    texts, `together` being the graph's output on `features` (the texts in one padded call) and `alone` each text
    run by itself, unpadded."""
    graph = session(path, 1)
    names = [i.name for i in graph.get_inputs()]
    alone = np.stack(
        [
            graph.run(None, {n: features[n][row : row + 1, mask] for n in names})[0][0]
            for row, mask in enumerate(features["attention_mask"].astype(bool))
        ]
    )
    return float((np.linalg.norm(alone - together, axis=1) / np.maximum(np.linalg.norm(alone, axis=1), 1e-12)).max())


def batch_problem(moved: float) -> str | None:
    """What is wrong when a text's vector moves with its call (`moved`, from moved_by_call) by more than BATCH_RTOL,
    else None."""
    if moved <= BATCH_RTOL:
        return None
    return (
        f"gives a text another vector alone than inside a call of other texts (|alone - together| / |alone| up to "
        f"{moved:.1e}, at most {BATCH_RTOL:g} is served)"
    )


def batch_record(path: Path, features: dict[str, np.ndarray], together: np.ndarray, what: str) -> dict:
    """How far a check sentence's vector moves between alone and inside the call of all of them (moved_by_call), as
    a graph cache's manifest records it; ExportError, naming `what` (the graph), when it is more than BATCH_RTOL: a
    graph whose vectors move with their call is not kept."""
    moved = moved_by_call(path, features, together)
    problem = batch_problem(moved)
    if problem is not None:
        raise ExportError(f"the ONNX graph of {what} {problem}")
    return {"moved_by_call": moved}


def int8_floor(entry: dict) -> float:
    recorded = entry.get("min_cosine_vs_torch")
    recorded = float(recorded) if isinstance(recorded, int | float) and np.isfinite(recorded) else INT8_MIN_COSINE
    return max(INT8_MIN_COSINE, recorded - INT8_COSINE_SLACK)


def check_graph(encoder: ElasticEncoder, path: Path, layer: int, quantize: str | None, entry: dict) -> str | None:
    """None if the cached graph at `path` computes layer `layer` of `encoder` (as `entry`, its manifest record,
    says it was built), else what is wrong with it."""
    try:
        graph = external_data_inside(path)
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # onnx cannot parse it
        return f"is not a readable ONNX graph ({type(exc).__name__}: {_first_line(exc)})"
    precision = graph_precision(graph)
    if precision != (quantize or "fp32"):
        # An fp32 graph under the int8 name would pass the cosine check and be scored and served as int8.
        held = "no quantized operator" if precision == "fp32" else "quantized operators"
        return f"holds {held}: it is an {precision} graph, not the {quantize or 'fp32'} graph its name says"
    features, expected = reference(encoder, layer)
    try:
        got = run_reference(path, features)
    except Exception as exc:  # onnxruntime: an unknown or custom op, a graph that does not run
        return f"does not load or run in onnxruntime ({type(exc).__name__}: {_first_line(exc)})"
    if got.shape != expected.shape:
        return f"gives vectors of shape {got.shape} where the model gives {expected.shape}"
    if quantize is None:
        diff = float(np.abs(got - expected).max())
        if not diff <= ONNX_ATOL:
            return f"differs from the model at layer {layer} by up to {diff:.2e} (more than {ONNX_ATOL:g})"
        return batch_problem(moved_by_call(path, features, got))
    lowest, floor = float(cosines(got, expected).min()), int8_floor(entry)
    if not lowest >= floor:
        return f"agrees with the model at layer {layer} only to a lowest cosine of {lowest:.4f} (needs {floor:.4f})"
    return batch_problem(moved_by_call(path, features, got))


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""
