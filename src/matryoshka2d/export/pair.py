"""A query encoder and the model whose vectors its index holds, as ONE sentence-transformers folder (issue 42).

`export --model TEACHER --query-model STUDENT` (a query encoder distilled from the teacher, `distill --mode query`)
or `export --model M --query-cell LAYERxDIM` (a shallow cell of one model for queries, its last layer at the same
width for documents) writes a folder whose only module is sentence-transformers' own `Router.for_query_document`:
plain `SentenceTransformer(folder).encode_query(...)` runs the query route (the student, or the cell cut to its
layers), `.encode_document(...)` and `.encode(...)` the document route (the full model at the query's width). Each
route is the folder `export` writes for a cell, loaded by sentence-transformers and handed to the Router, which saves
every module of a route under `{route}_{i}_{Module}/` beside `router_config.json`; nothing of matryoshka2d is
needed to load it. `ElasticEncoder(folder)` loads the document route, with the query route as `query_encoder`
(models.encoder); `matryoshka2d.json` records what each route holds (`pair`), the student's `distill` record
included, so search and serve check a pair's query route against an index as they check a query encoder.

`--format onnx [--quantize int8]` adds each route's transformer as the graph sentence-transformers' ONNX backend
loads (`SentenceTransformer(folder, backend="onnx")`: a Router hands the backend to each route's Transformer, which
reads `{route}_0_Transformer/onnx/model.onnx` through optimum; pooling, head and Normalize stay torch modules there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from matryoshka2d.cells import Cell
from matryoshka2d.export.cell import (
    FORMATS,
    QUANTIZE,
    TORCH_ATOL,
    _check,
    check_not_overlapping,
    check_output,
    folder_size,
    reads_several_layers,
)
from matryoshka2d.export.onnx_graphs import CHECK_SENTENCES, ExportError, require_onnx
from matryoshka2d.export.pair_onnx import write_route_graphs
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.identity import PAIR_KEY, weights_sha256
from matryoshka2d.models.query_record import DISTILL_KEY, check_query_encoder, query_encoder_record_at
from matryoshka2d.models.st_folder import PAIR_ROUTES, ROUTER_CONFIG
from matryoshka2d.outputs import move_into_place, remove_tree, staged_for, temporary_folder, write_text


@dataclass
class PairReport:
    output: Path
    query: str
    document: str
    checks: dict[str, float] = field(default_factory=dict)  # what was compared -> max abs difference
    files: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        mb = 1024 * 1024
        out = [
            f"exported a query/document pair to {self.output} (sentence-transformers Router.for_query_document)",
            f"encode_query: {self.query}",
            f"encode_document and encode: {self.document}",
        ]
        out += [f"size on disk, {part}: {size / mb:.1f} MiB" for part, size in self.files.items()]
        out += [f"check, {what}: max |difference| {diff:.2e}" for what, diff in self.checks.items()]
        return out + self.notes


def export_pair(
    model: str | ElasticEncoder,
    output: str | Path,
    query_model: str | None = None,
    query_cell: Cell | None = None,
    fmt: str = "st",
    quantize: str | None = None,
    overwrite: bool = False,
) -> PairReport:
    """Write the pair to `output` (a temporary folder beside it, renamed at the end), checked: plain
    sentence-transformers on the written folder must give the student's (or the query cell's) vectors for
    encode_query and the model's for encode_document within 1e-5."""
    if (query_model is None) == (query_cell is None):
        raise ExportError("a pair takes one query side: --query-model FOLDER or --query-cell LAYERxDIM")
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    if quantize is not None and (quantize not in QUANTIZE or fmt != "onnx"):
        raise ExportError("--quantize int8 quantizes the ONNX graphs; add --format onnx")
    if fmt == "onnx":
        require_onnx()
    output = Path(output)
    check_output(output, overwrite)
    reads = [("--query-model", query_model), ("--model", model if isinstance(model, str) else model.location)]
    check_not_overlapping(output, reads)  # before anything loads
    encoder = model if isinstance(model, ElasticEncoder) else ElasticEncoder(model, device="cpu")
    check_not_overlapping(output, [("--model", encoder.location)])  # a model name is the folder it stands for
    top = encoder.num_layers
    if query_model is not None:
        record = query_encoder_record_at(query_model)
        if record is None:
            raise ExportError(
                f"--query-model {query_model}: not a query encoder (its matryoshka2d.json has no `distill` record of "
                "--mode query); make one with `matryoshka2d distill --mode query`, or pair a cell: --query-cell"
            )
        documents = {"model": encoder.name, "weights_sha256": weights_sha256(encoder), "pooling": encoder.pooling}
        check_query_encoder(record, query_model, documents, "--query-model")
        student = ElasticEncoder(query_model, device="cpu")
        dim = student.hidden_size
        query = {"kind": "query encoder", "from": str(query_model), "layer": student.num_layers, "dim": dim}
        query[DISTILL_KEY] = record
    else:
        query_cell = Cell(*query_cell)
        layer, dim = query_cell
        if not 1 <= layer < top:
            deeper = "deeper than" if layer > top else "not shallower than"
            raise ExportError(
                f"--query-cell {query_cell.label}: layer {layer} is {deeper} {encoder.name}, which has {top} layers; a "
                f"query cell is a shallow exit, 1..{top - 1} (the documents take layer {top})"
            )
        try:
            encoder.check_dim(dim)
        except ValueError as exc:
            raise ExportError(f"--query-cell {query_cell.label}: {exc}") from None
        if reads_several_layers(encoder, layer):
            raise ExportError(
                f"--query-cell {query_cell.label}: the exit head of layer {layer} reads several layers, which a "
                "sentence-transformers folder cannot hold (fit heads with --inputs exit)"
            )
        student = None
        query = {"kind": "query cell", "from": str(encoder.name), "layer": layer, "dim": dim}
    if dim > encoder.hidden_size:
        raise ExportError(f"the query side gives {dim} numbers, more than {encoder.name}'s {encoder.hidden_size}")
    normalize = encoder.normalize_output
    document = {"from": str(encoder.name), "layer": top, "dim": dim, "normalize": normalize}
    document["weights_sha256"] = weights_sha256(encoder)
    tmp = temporary_folder(output.parent, output.name[:40], stands_for=output)
    try:
        staging, parts = tmp / "pair", tmp
        staged_for(staging, output)  # a message about a file being built names the output, never the staging
        encoder.save(parts / "document", dim=dim if dim < encoder.hidden_size else None, normalize=normalize)
        if student is not None:
            student.save(parts / "query")
        else:
            encoder.save(parts / "query", keep_layers=query["layer"], dim=dim, normalize=normalize)
        routes = _write_router(parts / "query", parts / "document", staging)
        # Each route as ElasticEncoder loads it, checksummed for the record (a Router folder without a record
        # loads unchecked): a pair whose routes are swapped or whose weights are replaced is refused when it loads.
        unchecked = ElasticEncoder(str(staging), device="cpu")
        query["route_sha256"] = weights_sha256(unchecked.query_encoder)
        document["route_sha256"] = weights_sha256(unchecked)
        meta = {PAIR_KEY: {"query": query, "document": document, "routes": routes}}
        write_text(staging / "matryoshka2d.json", json.dumps(meta, indent=2, default=str))
        _write_card(staging, query, document)
        report = PairReport(output, _describe(query), _describe(document))
        want_query = (
            student.encode(CHECK_SENTENCES, normalize=student.normalize_output)
            if student is not None
            else encoder.encode(CHECK_SENTENCES, layer=query["layer"], dim=dim, normalize=normalize)
        )
        want_document = encoder.encode(CHECK_SENTENCES, dim=dim, normalize=normalize)
        _check_folder(staging, want_query, want_document, report)
        if fmt == "onnx":
            write_route_graphs(staging, quantize, report)
        report.files["whole folder"] = folder_size(staging)
        remove_tree(output)  # --overwrite (check_output refused an existing output without it)
        move_into_place(staging, output)
    finally:
        remove_tree(tmp)
    return report


def _write_router(query_dir: Path, document_dir: Path, target: Path) -> dict[str, list[str]]:
    """sentence-transformers loads both cells' folders and saves one model of a Router over their modules into
    `target` (a folder inside the export's temporary folder); returns each route's module folders."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Router

    query = SentenceTransformer(str(query_dir), device="cpu")
    document = SentenceTransformer(str(document_dir), device="cpu")
    router = Router.for_query_document(query_modules=list(query.children()), document_modules=list(document.children()))
    pair = SentenceTransformer(modules=[router], device="cpu", similarity_fn_name="cosine")
    pair.save(str(target), create_model_card=False)
    config = json.loads((target / ROUTER_CONFIG).read_text(encoding="utf-8"))
    return {route: list(config["structure"][route]) for route in PAIR_ROUTES}


def _check_folder(folder: Path, want_query: np.ndarray, want_document: np.ndarray, report: PairReport) -> None:
    """Plain sentence-transformers on the written folder, and ElasticEncoder on it, against the sources."""
    from sentence_transformers import SentenceTransformer

    pair = SentenceTransformer(str(folder), device="cpu")
    report.checks["sentence-transformers encode_query vs the query side"] = _check(
        pair.encode_query(CHECK_SENTENCES), want_query, TORCH_ATOL, "pair's query route"
    )
    report.checks["sentence-transformers encode_document vs the model"] = _check(
        pair.encode_document(CHECK_SENTENCES), want_document, TORCH_ATOL, "pair's document route"
    )
    _check(pair.encode(CHECK_SENTENCES), want_document, TORCH_ATOL, "pair's default route (encode)")
    loaded = ElasticEncoder(str(folder), device="cpu")
    normalize = loaded.normalize_output
    report.checks["ElasticEncoder on the pair vs the model"] = _check(
        loaded.encode(CHECK_SENTENCES, normalize=normalize), want_document, TORCH_ATOL, "pair (ElasticEncoder)"
    )
    q = loaded.query_encoder
    _check(q.encode(CHECK_SENTENCES, normalize=q.normalize_output), want_query, TORCH_ATOL, "pair's query_encoder")


def _describe(side: dict) -> str:
    what = side.get("kind", "the model")
    return f"{what} {side['from']}, layer {side['layer']}, {side['dim']} numbers"


def _write_card(folder: Path, query: dict, document: dict) -> None:
    """A short model card: what each route is and how to call it."""
    lines = [
        "---",
        "library_name: sentence-transformers",
        "tags: [sentence-transformers, sentence-similarity, feature-extraction, asymmetric, matryoshka2d]",
        "---",
        "",
        "# A query/document pair (matryoshka2d export)",
        "",
        "One folder, two routes (sentence-transformers `Router.for_query_document`):",
        "",
        f"- `encode_query`: {_describe(query)}",
        f"- `encode_document` and `encode`: {_describe(document)}",
        "",
        "The query vectors live in the documents' space: index documents with `encode_document`, search with",
        "`encode_query`.",
        "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
        'model = SentenceTransformer("path/to/this/folder")',
        'docs = model.encode_document(["A man is playing a guitar."])',
        'queries = model.encode_query(["who plays music?"])',
        "print(model.similarity(queries, docs))",
        "```",
        "",
    ]
    write_text(folder / "README.md", "\n".join(lines))
