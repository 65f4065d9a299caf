"""Export one (layer, dim) cell as a standalone model: only `layer` layers on disk, pooling, the first `dim`
numbers, and Normalize as the cell does.

The folder is a sentence-transformers folder written by sentence-transformers (see ElasticEncoder.save): plain
`SentenceTransformer(folder)` gives the cell's embeddings and `AutoModel.from_pretrained(folder)` loads the cut
transformer. `--format onnx` adds `onnx/cell.onnx`, the whole cell as one graph (token ids and attention mask in,
`sentence_embedding` out: transformer, pooling, head, slice, normalize), exported with torch.onnx; `--quantize
int8` adds `onnx/cell_int8.onnx`, made by the one int8 recipe (onnx_graphs.quantize_int8: int8 weights of the matrix
multiplications, activations quantized on the fly with one scale per row, so that a text's vector does not depend
on what shares its call). Both need the `onnx` extra (onnx, onnxscript, onnxruntime);
the graphs are made and checked by matryoshka2d.export.onnx_graphs.

A cell whose exit head reads the pooled vectors of several layers (`heads fit --inputs stack`) has no
sentence-transformers form (a Pooling module pools one layer): it exports with `--format onnx` only, as the graph,
the tokenizer and matryoshka2d.json, and without it the export is refused with what to do instead.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.export.graph_check import batch_problem, moved_by_call, run_reference
from matryoshka2d.export.onnx_graphs import (
    CHECK_SENTENCES,
    ONNX_ATOL,
    ONNX_FILE,
    ONNX_INT8_FILE,
    ExportError,
    OnnxCellEncoder,
    SlicedExitGraph,
    export_onnx,
    graph_exporter,
    quantize_int8,
    require_onnx,
)
from matryoshka2d.models.backbones import count_parameters
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.query_record import record_own_identity, without_own_identity
from matryoshka2d.outputs import (
    check_apart,
    make_folder,
    move_into_place,
    remove_tree,
    staged_for,
    temporary_folder,
    write_json,
)
from matryoshka2d.outputs.disk import kind_of, mounts_at_or_below

FORMATS = ("st", "onnx")
QUANTIZE = ("int8",)
TORCH_ATOL = 1e-5  # sentence-transformers on the exported folder vs ElasticEncoder.encode at the cell


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
    """Before any work: the export replaces `output` as a whole, so it must be a folder (or nothing yet), empty
    unless `overwrite`, not a link (which the export would have to follow to delete what it points at), and
    neither a mount point nor holding one (what is mounted there is another place's)."""
    if output.is_symlink():
        raise ExportError(
            f"--output {output} is a symbolic link (-> {output.readlink()}): export replaces its folder as a whole "
            "and never deletes or fills through a link; give a folder path that is not a link"
        )
    if output.exists() and not output.is_dir():
        raise ExportError(f"--output {output} is {kind_of(output) or 'a file'}; give a folder")
    if output.is_dir() and mounts_at_or_below(output):
        raise ExportError(
            f"--output {output} is, or holds, a mount point ({mounts_at_or_below(output)[0]}): export replaces its "
            "folder as a whole and never deletes across a mount; give a folder that is not mounted, inside it"
        )
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(f"--output {output} is not empty; pass --overwrite to replace its contents")


def check_not_overlapping(output: Path, reads: ElasticEncoder | list[tuple[str, str | None]]) -> None:
    """The export must not replace what it reads (a model, the heads and the rest of its folder, a pair's query
    encoder), nor be written inside it, nor around it (rule 1, outputs.check_apart; the command checks it too, before
    loading). `reads`: the encoder, or (option, folder) pairs."""
    if isinstance(reads, ElasticEncoder):
        reads = [("--model", reads.location)]
    try:
        check_apart(output, "--output", reads)
    except ValueError as exc:
        raise ExportError(str(exc)) from None


def check_format(layer: int, fmt: str, quantize: str | None) -> None:
    """The format options of a cell's export, which need no model: export_cell checks them first, and `pick` builds
    its export commands through them, so that it never recommends one that export refuses."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    if quantize is not None and quantize not in QUANTIZE:
        raise ExportError(f"--quantize {quantize!r} is not supported; choose {', '.join(QUANTIZE)}")
    if quantize and fmt != "onnx":
        raise ExportError("--quantize int8 quantizes the ONNX graph; add --format onnx")
    if layer == 0 and fmt != "st":
        raise ExportError(
            "--layer 0 is the static cell: a table lookup and one matrix, which exports as a sentence-transformers "
            "folder (StaticEmbedding and Dense) only; leave out --format onnx"
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
    check_format(layer, fmt, quantize)
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
    if layer == 0:
        return _export_static(encoder, dim, normalize, fmt, output, metadata)
    if reads_several_layers(encoder, layer):
        if fmt != "onnx":
            raise ExportError(
                f"the exit head of layer {layer} reads the pooled vectors of layers "
                f"{encoder.exit_heads.reads(layer)}; a sentence-transformers folder pools one layer, so this cell "
                "exports as an ONNX graph only: add --format onnx (or fit heads with --inputs exit)"
            )
        return _export_onnx_only(encoder, layer, dim, normalize, quantize, output, metadata, sts_file)
    with _staging(output) as staging:
        encoder.save(staging, keep_layers=layer, dim=dim, normalize=normalize, metadata=metadata)
        cut = ElasticEncoder(str(staging), device="cpu")
        record_own_identity(staging, cut)  # a query encoder's cell: its own checksum and width
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


def _export_onnx_only(encoder, layer, dim, normalize, quantize, output: Path, metadata, sts_file) -> ExportReport:
    """A cell whose exit head reads several layers: the ONNX graph (the layers up to the exit, their pooled
    vectors, the head, slice, normalize), the tokenizer and matryoshka2d.json; no sentence-transformers modules.
    Checked against encode() in onnxruntime like any ONNX export."""
    from matryoshka2d.models.st_save import truncated_stack

    with _staging(output) as staging:
        make_folder(staging, check=False)
        encoder.tokenizer.save_pretrained(staging)
        head = encoder.exit_heads.heads[str(layer)]
        with truncated_stack(encoder.model, layer):
            kept = count_parameters(encoder.model)
            export_onnx(encoder, staging / ONNX_FILE, SlicedExitGraph(encoder, layer, dim, normalize))
        head_rows = dim * (head.linear.in_features + 1)  # the rows of the head the cell reads
        report = ExportReport(output, layer, dim, normalize, kept + head_rows, count_parameters(encoder.model))
        cell = {**metadata["exported_cell"], "format": "onnx only", "max_length": encoder.max_length}
        metadata = {**metadata, "exported_cell": cell}
        write_json(staging / "matryoshka2d.json", _plain(metadata))
        report.notes.append(
            f"(ONNX only: the exit head of layer {layer} reads the pooled vectors of layers "
            f"{encoder.exit_heads.reads(layer)}, which a sentence-transformers folder cannot hold; run the graph with "
            "onnxruntime, e.g. matryoshka2d.export.onnx_graphs.OnnxCellEncoder)"
        )
        expected = encoder.encode(CHECK_SENTENCES, layer=layer, dim=dim, normalize=normalize)
        _check_onnx(encoder, staging, expected, quantize, sts_file, report)
        _move_into_place(staging, output, report)
    return report


def _export_static(encoder, dim, normalize, fmt, output: Path, metadata) -> ExportReport:
    """Layer 0, the static cell (matryoshka2d.models.static): a sentence-transformers folder of StaticEmbedding (the
    table) and Dense (the head, cut to the cell's rows), Normalize when the cell normalizes; checked against encode()
    in plain sentence-transformers."""
    from matryoshka2d.models.static import RECORD_KEY

    if fmt != "st":
        raise ExportError(
            "--layer 0 is the static cell: a table lookup and one matrix, which exports as a sentence-transformers "
            "folder (StaticEmbedding and Dense) only; leave out --format onnx"
        )
    cell = encoder.static_cell
    metadata = {k: v for k, v in metadata.items() if k != RECORD_KEY}  # no model folder around it any more
    with _staging(output) as staging:
        cell.sentence_transformer(dim, normalize).save(str(staging), create_model_card=False)
        write_json(staging / "matryoshka2d.json", _plain(metadata))
        kept = cell.vocabulary * cell.dim_in + dim * (cell.dim_in + 1)
        full = count_parameters(encoder.model) + (count_parameters(encoder.head) if encoder.head is not None else 0)
        report = ExportReport(output, 0, dim, normalize, kept, full)
        report.notes.append(
            f"(the static cell: a table of {cell.vocabulary} tokens x {cell.dim_in} and the first {dim} rows of its "
            f"head; parameters compared with the transformer{' and its pooler head' if encoder.head else ''})"
        )
        expected = encoder.encode(CHECK_SENTENCES, layer=0, dim=dim, normalize=normalize)
        report.checks["sentence-transformers vs encode()"] = _check_sentence_transformers(staging, expected)
        report.files["torch weights (model.safetensors)"] = (staging / "model.safetensors").stat().st_size
        _move_into_place(staging, output, report)
    return report


def _check_onnx(encoder, staging: Path, expected: np.ndarray, quantize, sts_file, report: ExportReport) -> None:
    """The written fp32 graph against encode() at the cell in onnxruntime; then the int8 graph, if asked, and its
    STS-B score next to torch's."""
    report.notes.append(f"(ONNX graph written by torch.onnx's {graph_exporter(staging / ONNX_FILE)} exporter)")
    got = OnnxCellEncoder(staging, ONNX_FILE).encode(CHECK_SENTENCES)
    report.checks["onnxruntime fp32 vs encode()"] = _check(got, expected, ONNX_ATOL, "ONNX fp32 graph")
    report.files[f"ONNX fp32 ({ONNX_FILE})"] = (staging / ONNX_FILE).stat().st_size
    graphs = [("fp32", ONNX_FILE)]
    if quantize == "int8":
        quantize_int8(staging / ONNX_FILE, staging / ONNX_INT8_FILE)
        report.files[f"ONNX int8 ({ONNX_INT8_FILE})"] = (staging / ONNX_INT8_FILE).stat().st_size
        graphs.append(("int8", ONNX_INT8_FILE))
    features = {k: v.cpu().numpy().astype(np.int64) for k, v in encoder.tokenize(CHECK_SENTENCES).items()}
    for precision, file in graphs:  # a text's vector must not move with what shares its call (issue 61)
        moved = moved_by_call(staging / file, features, run_reference(staging / file, features))
        if batch_problem(moved) is not None:
            raise ExportError(f"the exported ONNX {precision} graph {batch_problem(moved)}")
        report.checks[f"onnxruntime {precision}, a text alone vs in a call, relative"] = moved
    if quantize == "int8":
        _score_int8(encoder, staging, report.layer, report.dim, report.normalize, sts_file, report)


@contextlib.contextmanager
def _staging(output: Path) -> Iterator[Path]:
    """A folder to build the cell in: `cell` inside a new hidden folder beside `output` (the same file system, so
    the final rename is atomic), removed with whatever is left in it when the export fails or is interrupted."""
    holder = temporary_folder(output.parent, output.name, stands_for=output)
    staged_for(holder / "cell", output)  # a message about a file being built names the output, never the staging
    try:
        yield holder / "cell"
    finally:
        remove_tree(holder)


def _move_into_place(staging: Path, output: Path, report: ExportReport) -> None:
    """The checked folder replaces `output` (whose overwrite check_output allowed before anything was written),
    through the one writer: the old folder is removed (never through a link), the new one renamed into place."""
    report.files["whole folder"] = folder_size(staging)
    if output.exists() or output.is_symlink():
        remove_tree(output)
    move_into_place(staging, output)


def _plain(metadata: dict) -> dict:
    """The record as JSON takes it: what json cannot write (a path, a date) as its text, as json's default=str."""
    return json.loads(json.dumps(metadata, default=str))


def _source_metadata(encoder: ElasticEncoder) -> dict:
    """The training record of the source folder, so the exported card still says how the model was made."""
    if encoder.location:
        # Read through the one confined reader: a record that is a link out of the model folder is refused, not read.
        record = ConfinedFolder(encoder.location, "model").path("matryoshka2d.json")
        if record.is_file():
            try:
                loaded = json.loads(record.read_text(encoding="utf-8"))
            except (ValueError, RecursionError):  # not JSON, not UTF-8: the card simply says less
                loaded = None
            if isinstance(loaded, dict):
                return without_own_identity(loaded)
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
