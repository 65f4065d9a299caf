"""ONNX graphs of an encoder: an exit layer or a whole cell as one graph (token ids and attention mask in,
`sentence_embedding` out), written by torch.onnx and kept only once onnxruntime reproduces the module on other
texts; the exporter and its check recorded in the graph; int8 by onnxruntime's dynamic quantization with one
activation scale per row (quantize_int8); and a cell's graph run in onnxruntime (OnnxCellEncoder). They need the
`onnx` extra (onnx, onnxscript, onnxruntime).

An exported cell's folder (matryoshka2d.export.cell) holds them as `onnx/cell.onnx` and `onnx/cell_int8.onnx`;
the ONNX backend of the server (matryoshka2d.serve.backends) exports one graph per exit layer.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from matryoshka2d import outputs
from matryoshka2d.confined import ConfinedFolder, OutsideFolderError, inside
from matryoshka2d.models.batching import length_batches
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.pooler import pool

ONNX_FILE = "onnx/cell.onnx"
ONNX_INT8_FILE = "onnx/cell_int8.onnx"
CHECK_SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument on a stage in front of a very large and enthusiastic crowd.",
    "The market fell.",
    "Rain.",
]
ONNX_ATOL = 1e-4  # onnxruntime fp32 vs torch


class ExportError(ValueError):
    """An export could not be made as asked; the message says what and where."""


def require_onnx() -> None:
    missing = []
    for module in ("onnx", "onnxscript", "onnxruntime"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        from matryoshka2d.extras import install_line  # the package is on no index: the checkout's extra

        raise ExportError(f"--format onnx needs {', '.join(missing)}, not installed: {install_line('onnx')}")


def graph_inputs(input_ids, attention_mask, token_type_ids=None) -> dict:
    """A graph's inputs as the model's features: token_type_ids only for the models that take them."""
    features = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        features["token_type_ids"] = token_type_ids
    return features


class CellGraph(nn.Module):
    """The whole cell of a cut encoder as one module: transformer (all its layers), pool, head, normalize."""

    def __init__(self, encoder: ElasticEncoder, normalize: bool):
        super().__init__()
        self.encoder, self.normalize = encoder, normalize

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        hidden = self.encoder.model(**graph_inputs(input_ids, attention_mask, token_type_ids)).last_hidden_state
        vectors = pool(hidden, attention_mask, self.encoder.pooling)
        if self.encoder.head is not None:
            vectors = self.encoder.head(vectors)
        if self.normalize:
            vectors = nn.functional.normalize(vectors, dim=-1)
        return vectors


class ExitGraph(nn.Module):
    """What `encoder.forward(features, [layer])` computes, as one module: the sentence vectors after `layer`
    layers (pooled, then whatever forward applies after pooling), full width, not normalised. Export it with
    the stack cut to `layer` layers (export_exit), so the graph holds only the layers that run."""

    def __init__(self, encoder: ElasticEncoder, layer: int):
        super().__init__()
        self.encoder, self.layer = encoder, layer

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        return self.encoder.forward(graph_inputs(input_ids, attention_mask, token_type_ids), [self.layer])[self.layer]


class SlicedExitGraph(nn.Module):
    """ExitGraph cut to the cell: the first `dim` numbers, normalised when the cell is."""

    def __init__(self, encoder: ElasticEncoder, layer: int, dim: int, normalize: bool):
        super().__init__()
        self.exit, self.dim, self.normalize = ExitGraph(encoder, layer), dim, normalize

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        vectors = self.exit(input_ids, attention_mask, token_type_ids)[:, : self.dim]
        return nn.functional.normalize(vectors, dim=-1) if self.normalize else vectors


def export_exit(encoder: ElasticEncoder, layer: int, path: Path, exporters=None) -> Path:
    """One exit layer of a whole encoder as an ONNX graph (ExitGraph: `sentence_embedding`, full width)."""
    from matryoshka2d.models.st_save import truncated_stack

    layer = encoder.check_layer(layer)
    with truncated_stack(encoder.model, layer):
        return export_onnx(encoder, path, ExitGraph(encoder, layer), exporters or EXPORTERS)


# Which torch.onnx exporter writes a graph: the TorchScript one first, because onnxruntime runs its graph faster
# (minilm-l6, one thread, batches of 8 NLI sentences, CPU ms per text, TorchScript against dynamo: int8 0.93 vs
# 1.09 at layer 3 and 1.68 vs 1.98 at layer 6; fp32 1.86 vs 2.08 and 3.65 vs 4.19; docs/benchmarks.md, issue 19);
# dynamo where TorchScript fails (it traces, is deprecated in torch, and some models do not trace). A traced graph
# can also hold only for the shapes it was traced on, so each graph must reproduce the module in onnxruntime on
# other texts (another batch size, longer and shorter) before it is kept. The exporter used is written into the
# graph's metadata (`exporter`).
EXPORTERS = ("torchscript", "dynamo")


OPSET = 18


class TokenStatesGraph(nn.Module):
    """The transformer alone, token states out (`last_hidden_state`): the graph sentence-transformers' ONNX backend
    runs in place of a Transformer module, pooling and the rest staying its torch modules (export.pair)."""

    def __init__(self, encoder: ElasticEncoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        return self.encoder.model(**graph_inputs(input_ids, attention_mask, token_type_ids)).last_hidden_state


def export_onnx(
    cut: ElasticEncoder,
    path: Path,
    graph: nn.Module | None = None,
    exporters=EXPORTERS,
    output: str = "sentence_embedding",
) -> Path:
    """torch.onnx export of a cut encoder (its full depth is the cell's depth), batch and length dynamic; `graph`
    is the module to export (default: the whole cell, CellGraph) and `output` the name of what it gives
    (`last_hidden_state` for TokenStatesGraph: batch and length dynamic there too). The first of `exporters`
    that succeeds writes it."""
    if hasattr(cut.model.config, "use_cache"):
        cut.model.config.use_cache = False  # decoders: no key/value cache outputs in the graph
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in cut._input_names]
    sample = cut.tokenize(["a first short sentence", "and a second, slightly longer sentence here"])
    args = tuple(sample[n] for n in names)
    graph = (graph if graph is not None else CellGraph(cut, cut.normalize_output)).eval()
    check = cut.tokenize(CHECK_SENTENCES)
    check_args = tuple(check[n] for n in names)
    with torch.no_grad():
        expected = graph(*check_args).float().numpy()
    failures = []
    for exporter in exporters:
        try:
            # the one writer: the exporter writes a temporary file beside `path`, moved into place once it is
            # checked and its metadata set (a failed exporter leaves nothing; a link at `path` is replaced)
            with outputs.writing(path) as tmp:
                with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # tracer and deprecation warnings: the graph is checked after
                    _EXPORT[exporter](graph, args, names, tmp, output)
                diff = _check_graph(tmp, dict(zip(names, check_args, strict=True)), expected)
                _set_metadata(tmp, {"exporter": exporter, "max_abs_difference_vs_torch": repr(diff)})
        except outputs.OutputError:
            raise  # the destination itself is refused: no exporter can write there
        except Exception as error:  # any failure of one exporter means: try the next
            failures.append(f"{exporter}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            continue
        if failures:
            print(f"ONNX export of {path.name}: {'; '.join(failures)}; written by {exporter}", file=sys.stderr)
        return path
    raise ExportError(f"no torch.onnx exporter could export {path.name}: " + "; ".join(failures))


def _export_torchscript(graph: nn.Module, args: tuple, names: list[str], path: Path, output: str) -> None:
    output_axes = {0: "batch"} if output == "sentence_embedding" else {0: "batch", 1: "sequence"}
    torch.onnx.export(
        graph,
        args,
        str(path),
        input_names=names,
        output_names=[output],
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names} | {output: output_axes},
        opset_version=OPSET,
        dynamo=False,
    )


def _export_dynamo(graph: nn.Module, args: tuple, names: list[str], path: Path, output: str) -> None:
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence")
    program = torch.onnx.export(
        graph,
        args,
        input_names=names,
        output_names=[output],
        dynamic_shapes={n: {0: batch, 1: length} for n in names},
        dynamo=True,
        external_data=False,
        verbose=False,
    )
    program.save(str(path))


_EXPORT = {"torchscript": _export_torchscript, "dynamo": _export_dynamo}


def _check_graph(path: Path, features: dict[str, torch.Tensor], expected: np.ndarray) -> float:
    """The graph in onnxruntime must give what the module gave on `features` (other texts than it was exported
    with) within ONNX_ATOL; returns the largest difference."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: features[i.name].numpy() for i in session.get_inputs()})[0]
    diff = float(np.abs(got - expected).max()) if got.shape == expected.shape else float("inf")
    if not diff <= ONNX_ATOL:
        raise ExportError(
            f"its graph does not reproduce the model on other texts: shape {got.shape} vs {expected.shape}, "
            f"max |difference| {diff:.2e} > {ONNX_ATOL:g}"
        )
    return diff


def _set_metadata(path: Path, values: dict[str, str]) -> None:
    """Set metadata on a graph being written (`path` is the one writer's temporary file, see export_onnx)."""
    import onnx

    model = onnx.load(str(path))
    props = {p.key: p.value for p in model.metadata_props} | values
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(path))


def graph_metadata(path: Path) -> dict[str, str]:
    """What export_onnx wrote into a graph: `exporter` and `max_abs_difference_vs_torch` (its check); empty for
    graphs written before they were recorded."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}


def graph_exporter(path: Path) -> str | None:
    """The exporter that wrote an ONNX graph (None for graphs written before it was recorded)."""
    return graph_metadata(path).get("exporter")


def quantize_int8(source: Path, target: Path) -> Path:
    """The int8 graph of an fp32 graph, the one recipe of `export --quantize int8`, `serve --quantize int8`, `eval
    --backend onnx-int8` and `pick`: onnxruntime's dynamic quantization of every MatMul with constant weights (int8
    weights, one scale per output channel: on minilm-l6 at layer 6 the lowest cosine to fp32 over 600 STS sentences
    went from 0.934 with one scale per matrix to 0.988, issue 19), then its activations given one scale per row
    (export.int8_rows.scale_rows), so that a text's vector does not depend on what shares its call."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from matryoshka2d.export.int8_rows import RowScaleError, scale_rows

    # the one writer: the graph is quantized into a temporary file beside `target` and moved into place when
    # whole; the pre-processed graph it starts from lies under that temporary name too, and is removed
    with outputs.writing(target) as tmp:
        prepared = tmp.with_name(f"{tmp.stem}.prep.onnx")
        try:
            quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
            quantize_dynamic(
                str(prepared),
                str(tmp),
                weight_type=QuantType.QInt8,
                per_channel=True,
                extra_options={"MatMulConstBOnly": True},  # a product of two activations stays fp32
            )
            onnx.save(scale_rows(onnx.load(str(tmp))), str(tmp))
        except RowScaleError as exc:
            raise ExportError(f"{source.name}: cannot give its int8 activations one scale per row: {exc}") from None
        finally:
            outputs.remove_file(prepared)
    return target


def external_data_inside(path: Path):
    """The graph (onnx's ModelProto, without its external data), after refusing (OutsideFolderError) one whose
    tensors name external data outside its folder, before anything but the graph file itself is read (onnxruntime,
    and an older one without its own check, would read it)."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            location = {e.key: e.value for e in tensor.external_data}.get("location")
            inside(path.parent, location, path, f"tensor {tensor.name!r} external_data location")
    return model


# The operators int8 quantization puts in a graph (onnxruntime's dynamic quantization: MatMul -> DynamicQuantizeLinear
# + MatMulInteger, or the fused forms; with one scale per row, quantize_int8: QuantizeLinear + MatMulIntegerToFloat);
# an fp32 graph has none of them.
QUANTIZED_OPS = frozenset(
    {
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "QLinearMatMul",
        "QAttention",
        "QuantizeLinear",
        "DequantizeLinear",
        "ConvInteger",
        "QLinearConv",
        "QGemm",
    }
)


def graph_precision(model) -> str:
    """'int8' when the graph (a ModelProto) computes with quantized operators, else 'fp32': what the graph is, not
    what its file name or a manifest says."""
    nodes = list(model.graph.node)
    while nodes:
        node = nodes.pop()
        if node.op_type in QUANTIZED_OPS:
            return "int8"
        nodes.extend(n for attribute in node.attribute for g in [attribute.g, *attribute.graphs] for n in g.node)
    return "fp32"


class OnnxCellEncoder:
    """Run an exported cell's ONNX graph in onnxruntime: the folder's tokenizer, sorted batches, no torch model."""

    def __init__(self, folder: str | Path, file: str = ONNX_FILE, threads: int | None = None):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        from matryoshka2d.models.st_folder import read_sentence_config

        folder = Path(folder)
        try:
            # before anything in it is opened (the tokenizer's files too): no link in the folder leaves it
            ConfinedFolder(folder, "exported cell")
            graph = inside(folder, file, folder, "the exported cell's graph")
            if not graph.is_file():
                raise ExportError(f"{graph}: no such ONNX file; export with --format onnx")
            external_data_inside(graph)
        except OutsideFolderError as exc:
            raise ExportError(str(exc)) from None
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.max_length = (
            read_sentence_config(str(folder)).max_length
            or _exported_max_length(folder)  # an ONNX-only folder has no sentence-transformers modules
            or self.tokenizer.model_max_length
        )
        self.inputs = [i.name for i in self.session.get_inputs()]

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        encoded = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        out = None
        for idx in length_batches([len(x) for x in encoded["input_ids"]], batch_size):
            rows = [{k: encoded[k][i] for k in self.inputs if k in encoded} for i in idx]
            batch = self.tokenizer.pad(rows, return_tensors="np")
            (vectors,) = self.session.run(None, {k: batch[k].astype(np.int64) for k in self.inputs})
            if out is None:
                out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
            out[idx] = vectors
        return out if out is not None else np.zeros((0, 0), dtype=np.float32)


def _exported_max_length(folder: Path) -> int | None:
    try:
        meta = ConfinedFolder(folder, "exported cell", check=False).read_json("matryoshka2d.json")
        return int(meta["exported_cell"]["max_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
