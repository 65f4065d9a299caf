"""Export one (layer, dim) cell as a standalone model: only `layer` layers on disk, pooling, the first `dim`
numbers, and Normalize as the cell does.

The folder is a sentence-transformers folder written by sentence-transformers (see ElasticEncoder.save): plain
`SentenceTransformer(folder)` gives the cell's embeddings and `AutoModel.from_pretrained(folder)` loads the cut
transformer. `--format onnx` adds `onnx/cell.onnx`, the whole cell as one graph (token ids and attention mask in,
`sentence_embedding` out: transformer, pooling, head, slice, normalize), exported with torch.onnx; `--quantize
int8` adds `onnx/cell_int8.onnx`, made by onnxruntime's dynamic quantization (int8 weights of the matrix
multiplications, activations quantized on the fly). Both need the `onnx` extra (onnx, onnxscript, onnxruntime).

A cell whose exit head reads the pooled vectors of several layers (`heads fit --inputs stack`) has no
sentence-transformers form (a Pooling module pools one layer): it exports with `--format onnx` only, as the graph,
the tokenizer and matryoshka2d.json, and without it the export is refused with what to do instead.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from matryoshka2d.models.backbones import count_parameters
from matryoshka2d.models.batching import length_batches
from matryoshka2d.models.encoder import ElasticEncoder, pool

FORMATS = ("st", "onnx")
QUANTIZE = ("int8",)
ONNX_FILE = "onnx/cell.onnx"
ONNX_INT8_FILE = "onnx/cell_int8.onnx"
CHECK_SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument on a stage in front of a very large and enthusiastic crowd.",
    "The market fell.",
    "Rain.",
]
TORCH_ATOL = 1e-5  # sentence-transformers on the exported folder vs ElasticEncoder.encode at the cell
ONNX_ATOL = 1e-4  # onnxruntime fp32 vs torch


class ExportError(ValueError):
    """An export could not be made as asked; the message says what and where."""


@dataclass
class ExportReport:
    output: Path
    layer: int
    dim: int
    normalize: bool
    parameters_kept: int
    parameters_full: int
    files: dict[str, int] = field(default_factory=dict)  # part -> bytes on disk
    checks: dict[str, float] = field(default_factory=dict)  # what was compared -> max abs difference
    sts: dict[str, float] = field(default_factory=dict)  # STS-B Spearman x 100 per form
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        mb = 1024 * 1024
        out = [
            f"exported cell (layer {self.layer}, dim {self.dim}{', normalized' if self.normalize else ''}) "
            f"to {self.output}",
            f"parameters kept: {self.parameters_kept:,} of {self.parameters_full:,} "
            f"({100 * self.parameters_kept / self.parameters_full:.1f}%)",
        ]
        out += [f"size on disk, {part}: {size / mb:.1f} MiB" for part, size in self.files.items()]
        out += [f"check, {what}: max |difference| {diff:.2e}" for what, diff in self.checks.items()]
        out += [f"STS-B test Spearman x 100, {form}: {score:.2f}" for form, score in self.sts.items()]
        return out + self.notes


def folder_size(path: Path, exclude: str | None = None) -> int:
    return sum(
        p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and (not exclude or exclude not in p.parts)
    )


def check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ExportError(f"--output {output} is a file; give a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(f"--output {output} is not empty; pass --overwrite to replace its contents")


def check_not_overlapping(output: Path, encoder: ElasticEncoder) -> None:
    """The export must not replace the model it reads (its heads and the rest of the folder would be gone), nor
    be written inside it, nor around it."""
    if not encoder.location:
        return
    source, target = Path(encoder.location).resolve(), output.resolve()
    if target == source or target.is_relative_to(source) or source.is_relative_to(target):
        raise ExportError(
            f"--output {output} {'is' if target == source else 'overlaps'} the folder of the model it exports "
            f"({encoder.location}); --overwrite would replace that model: write the cell to a folder apart from it"
        )


def export_cell(
    model: str | ElasticEncoder,
    layer: int,
    dim: int,
    output: str | Path,
    fmt: str = "st",
    quantize: str | None = None,
    overwrite: bool = False,
    normalize: bool | None = None,
    sts_file: str | Path | None = None,
) -> ExportReport:
    """Write the cell to `output` (atomically: a temporary folder beside it, renamed at the end) and check it."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    if quantize is not None and quantize not in QUANTIZE:
        raise ExportError(f"--quantize {quantize!r} is not supported; choose {', '.join(QUANTIZE)}")
    if quantize and fmt != "onnx":
        raise ExportError("--quantize int8 quantizes the ONNX graph; add --format onnx")
    if fmt == "onnx":
        require_onnx()
    output = Path(output)
    check_output(output, overwrite)
    encoder = model if isinstance(model, ElasticEncoder) else ElasticEncoder(model, device="cpu")
    check_not_overlapping(output, encoder)
    layer, dim = encoder.check_layer(layer), encoder.check_dim(dim)
    normalize = encoder.normalize_output if normalize is None else normalize
    metadata = _source_metadata(encoder)
    metadata["exported_cell"] = {"from": str(encoder.name), "layer": layer, "dim": dim, "normalize": normalize}
    output.parent.mkdir(parents=True, exist_ok=True)
    if reads_several_layers(encoder, layer):
        if fmt != "onnx":
            raise ExportError(
                f"the exit head of layer {layer} reads the pooled vectors of layers "
                f"{encoder.exit_heads.reads(layer)}; a sentence-transformers folder pools one layer, so this cell "
                "exports as an ONNX graph only: add --format onnx (or fit heads with --inputs exit)"
            )
        return _export_onnx_only(encoder, layer, dim, normalize, quantize, output, metadata, sts_file)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as tmp:
        staging = Path(tmp) / "cell"
        encoder.save(staging, keep_layers=layer, dim=dim, normalize=normalize, metadata=metadata)
        cut = ElasticEncoder(str(staging), device="cpu")
        report = ExportReport(
            output, layer, dim, normalize, count_parameters(cut.model), count_parameters(encoder.model)
        )
        if encoder.head is not None:
            report.parameters_kept += count_parameters(encoder.head)
            report.parameters_full += count_parameters(encoder.head)
            report.notes.append(f"(pooler head kept: {encoder.head.describe()})")
        if dim < encoder.hidden_size:
            report.notes.append(
                f"(the first {dim} numbers are kept by a {dim}x{encoder.hidden_size} identity Dense module, "
                "not counted as parameters)"
            )
        expected = encoder.encode(CHECK_SENTENCES, layer=layer, dim=dim, normalize=normalize)
        report.checks["sentence-transformers vs encode()"] = _check_sentence_transformers(staging, expected)
        report.files["torch weights (model.safetensors)"] = (staging / "model.safetensors").stat().st_size
        if fmt == "onnx":
            export_onnx(cut, staging / ONNX_FILE)
            _check_onnx(encoder, staging, expected, quantize, sts_file, report)
        _move_into_place(staging, output, report)
    full = Path(encoder.location) / "model.safetensors" if encoder.location else None
    if full is not None and full.is_file():
        report.files["full model's torch weights, for comparison"] = full.stat().st_size
    return report


def reads_several_layers(encoder: ElasticEncoder, layer: int) -> bool:
    """Whether the cell's vectors come from an exit head that reads the pooled vectors of several layers
    (matryoshka2d.models.heads, inputs="stack"): no stock sentence-transformers module can hold such a head."""
    heads = encoder.exit_heads if encoder.use_heads else None
    return heads is not None and heads.has(layer) and len(heads.reads(layer)) > 1


class SlicedExitGraph(nn.Module):
    """ExitGraph cut to the cell: the first `dim` numbers, normalised when the cell is."""

    def __init__(self, encoder: ElasticEncoder, layer: int, dim: int, normalize: bool):
        super().__init__()
        self.exit, self.dim, self.normalize = ExitGraph(encoder, layer), dim, normalize

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        vectors = self.exit(input_ids, attention_mask, token_type_ids)[:, : self.dim]
        return nn.functional.normalize(vectors, dim=-1) if self.normalize else vectors


def _export_onnx_only(encoder, layer, dim, normalize, quantize, output: Path, metadata, sts_file) -> ExportReport:
    """A cell whose exit head reads several layers: the ONNX graph (the layers up to the exit, their pooled
    vectors, the head, slice, normalize), the tokenizer and matryoshka2d.json; no sentence-transformers modules.
    Checked against encode() in onnxruntime like any ONNX export."""
    from matryoshka2d.models.st_folder import truncated_stack

    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as tmp:
        staging = Path(tmp) / "cell"
        staging.mkdir()
        encoder.tokenizer.save_pretrained(staging)
        head = encoder.exit_heads.heads[str(layer)]
        with truncated_stack(encoder.model, layer):
            kept = count_parameters(encoder.model)
            export_onnx(encoder, staging / ONNX_FILE, SlicedExitGraph(encoder, layer, dim, normalize))
        head_rows = dim * (head.linear.in_features + 1)  # the rows of the head the cell reads
        report = ExportReport(output, layer, dim, normalize, kept + head_rows, count_parameters(encoder.model))
        cell = {**metadata["exported_cell"], "format": "onnx only", "max_length": encoder.max_length}
        metadata = {**metadata, "exported_cell": cell}
        (staging / "matryoshka2d.json").write_text(json.dumps(metadata, indent=2, default=str))
        report.notes.append(
            f"(ONNX only: the exit head of layer {layer} reads the pooled vectors of layers "
            f"{encoder.exit_heads.reads(layer)}, which a sentence-transformers folder cannot hold; run the graph with "
            "onnxruntime, e.g. matryoshka2d.deploy.export.OnnxCellEncoder)"
        )
        expected = encoder.encode(CHECK_SENTENCES, layer=layer, dim=dim, normalize=normalize)
        _check_onnx(encoder, staging, expected, quantize, sts_file, report)
        _move_into_place(staging, output, report)
    return report


def _check_onnx(encoder, staging: Path, expected: np.ndarray, quantize, sts_file, report: ExportReport) -> None:
    """The written fp32 graph against encode() at the cell in onnxruntime; then the int8 graph, if asked, and its
    STS-B score next to torch's."""
    report.notes.append(f"(ONNX graph written by torch.onnx's {graph_exporter(staging / ONNX_FILE)} exporter)")
    got = OnnxCellEncoder(staging, ONNX_FILE).encode(CHECK_SENTENCES)
    report.checks["onnxruntime fp32 vs encode()"] = _check(got, expected, ONNX_ATOL, "ONNX fp32 graph")
    report.files[f"ONNX fp32 ({ONNX_FILE})"] = (staging / ONNX_FILE).stat().st_size
    if quantize == "int8":
        quantize_int8(staging / ONNX_FILE, staging / ONNX_INT8_FILE)
        report.files[f"ONNX int8 ({ONNX_INT8_FILE})"] = (staging / ONNX_INT8_FILE).stat().st_size
        _score_int8(encoder, staging, report.layer, report.dim, report.normalize, sts_file, report)


def _move_into_place(staging: Path, output: Path, report: ExportReport) -> None:
    """The checked folder replaces `output` (whose overwrite check_output allowed before anything was written)."""
    report.files["whole folder"] = folder_size(staging)
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)


def _source_metadata(encoder: ElasticEncoder) -> dict:
    """The training record of the source folder, so the exported card still says how the model was made."""
    if encoder.location:
        record = Path(encoder.location) / "matryoshka2d.json"
        if record.is_file():
            try:
                return json.loads(record.read_text())
            except json.JSONDecodeError:
                pass
    return {}


def _check(got: np.ndarray, expected: np.ndarray, atol: float, what: str) -> float:
    diff = float(np.abs(got - expected).max())
    if got.shape != expected.shape or not diff <= atol:
        raise ExportError(
            f"the exported {what} does not reproduce the cell: shape {got.shape} vs {expected.shape}, "
            f"max |difference| {diff:.2e} > {atol:g}"
        )
    return diff


def _check_sentence_transformers(folder: Path, expected: np.ndarray) -> float:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return _check(model.encode(CHECK_SENTENCES), expected, TORCH_ATOL, "sentence-transformers folder")


# ---- ONNX -----------------------------------------------------------------------------------------------


def require_onnx() -> None:
    missing = []
    for module in ("onnx", "onnxscript", "onnxruntime"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ExportError(f"--format onnx needs {', '.join(missing)}, not installed: pip install 'matryoshka2d[onnx]'")


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


def export_exit(encoder: ElasticEncoder, layer: int, path: Path, exporters=None) -> Path:
    """One exit layer of a whole encoder as an ONNX graph (ExitGraph: `sentence_embedding`, full width)."""
    from matryoshka2d.models.st_folder import truncated_stack

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


def export_onnx(cut: ElasticEncoder, path: Path, graph: nn.Module | None = None, exporters=EXPORTERS) -> Path:
    """torch.onnx export of a cut encoder (its full depth is the cell's depth), batch and length dynamic; `graph`
    is the module to export (default: the whole cell, CellGraph). The first of `exporters` that succeeds writes
    it."""
    if hasattr(cut.model.config, "use_cache"):
        cut.model.config.use_cache = False  # decoders: no key/value cache outputs in the graph
    path.parent.mkdir(parents=True, exist_ok=True)
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
        path.unlink(missing_ok=True)
        try:
            with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tracer and deprecation warnings: the graph is checked after
                _EXPORT[exporter](graph, args, names, path)
            diff = _check_graph(path, dict(zip(names, check_args, strict=True)), expected)
        except Exception as error:  # any failure of one exporter means: try the next
            failures.append(f"{exporter}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            path.unlink(missing_ok=True)
            continue
        _set_metadata(path, {"exporter": exporter, "max_abs_difference_vs_torch": repr(diff)})
        if failures:
            print(f"ONNX export of {path.name}: {'; '.join(failures)}; written by {exporter}", file=sys.stderr)
        return path
    raise ExportError(f"no torch.onnx exporter could export {path.name}: " + "; ".join(failures))


def _export_torchscript(graph: nn.Module, args: tuple, names: list[str], path: Path) -> None:
    torch.onnx.export(
        graph,
        args,
        str(path),
        input_names=names,
        output_names=["sentence_embedding"],
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names} | {"sentence_embedding": {0: "batch"}},
        opset_version=OPSET,
        dynamo=False,
    )


def _export_dynamo(graph: nn.Module, args: tuple, names: list[str], path: Path) -> None:
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence")
    program = torch.onnx.export(
        graph,
        args,
        input_names=names,
        output_names=["sentence_embedding"],
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
    """onnxruntime dynamic quantization: int8 weights, activations quantized at run time. The weights get one
    scale per output channel, not one per matrix: on minilm-l6 at layer 6 the lowest cosine to the fp32 vectors
    over 600 STS sentences went from 0.934 to 0.988 (mean 0.968 to 0.994) at the same speed (docs/benchmarks.md,
    issue 19)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = target.with_suffix(".prep.onnx")
    try:
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
        quantize_dynamic(str(prepared), str(target), weight_type=QuantType.QInt8, per_channel=True)
    finally:
        prepared.unlink(missing_ok=True)
    return target


class OnnxCellEncoder:
    """Run an exported cell's ONNX graph in onnxruntime: the folder's tokenizer, sorted batches, no torch model."""

    def __init__(self, folder: str | Path, file: str = ONNX_FILE, threads: int | None = None):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        from matryoshka2d.models.st_folder import read_sentence_config

        folder = Path(folder)
        if not (folder / file).is_file():
            raise ExportError(f"{folder / file}: no such ONNX file; export with --format onnx")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(folder / file), options, providers=["CPUExecutionProvider"])
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
        meta = json.loads((folder / "matryoshka2d.json").read_text(encoding="utf-8"))
        return int(meta["exported_cell"]["max_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _score_int8(encoder, folder, layer, dim, normalize, sts_file, report: ExportReport) -> None:
    """STS-B test Spearman of the int8 graph next to fp32 torch at the same cell (if the data can be found)."""
    from matryoshka2d.evaluate.sts import distinct_rows, load_pairs, pair_spearman

    if sts_file is None:
        from matryoshka2d.paths import sts_file as shared_sts_file

        try:
            sts_file = shared_sts_file("stsb_test.tsv")
        except FileNotFoundError as exc:
            report.notes.append(f"STS-B score skipped: {exc}; pass --sts-file")
            return
    sts_file = Path(sts_file)
    if not sts_file.is_file():
        report.notes.append(f"STS-B score skipped: {sts_file} not found; pass --sts-file")
        return
    pairs = load_pairs(sts_file, "stsb")
    rows = distinct_rows(pairs)
    forms = {
        "torch fp32": encoder.encode(list(rows), layer=layer, dim=dim),
        "ONNX int8": OnnxCellEncoder(folder, ONNX_INT8_FILE).encode(list(rows)),
    }
    for form, vectors in forms.items():
        report.sts[form] = pair_spearman(pairs, vectors, rows)
    report.notes.append(f"(STS-B: {sts_file}, {len(pairs.gold)} pairs)")
