"""mteb's encoder for any cell of a model: a (layer, dim) cell, layer 0 (the static cell), and a query/document pair.

`mteb.evaluate(model, tasks)` takes any object with an `encode` of mteb's signature and an `mteb_model_meta`
(mteb/evaluate.py, `_sanitize_model`: "hasattr(model, 'mteb_model_meta')"); `AbsEncoder` (mteb/models/abs_encoder.py)
gives the rest of mteb's `EncoderProtocol` (similarity, similarity_pairwise, prompts). mteb hands the texts over as a
DataLoader of batches holding "text" (mteb/_create_dataloaders.py) and says with `prompt_type` which side of an
asymmetric task they are: retrieval encodes its queries with `PromptType.query` and its corpus with
`PromptType.document` (mteb/models/search_wrappers.py, `SearchEncoderWrapper.search` and `.index`); STS and
classification pass None (mteb/_evaluators/any_sts_evaluator.py). So a pair's query side answers `PromptType.query`
only, and everything else goes through the cell itself, the full cell whose vectors an index would hold.

Nothing here encodes on its own: the vectors are the evaluators' (`evaluate.grid.EncoderCells`, one pass up to the
deepest layer asked for, each distinct text once, widths by slicing; layer 0 through the model's static cell), made
once for every cell evaluated (`SharedPass`): mteb runs one cell at a time, and the second cell of a task reads what
the first one's pass already computed. Vectors come back at unit length, as our evaluators compare them
(`cells.unit_rows`); mteb's cosine does not change on them.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction
from mteb.types import PromptType

from matryoshka2d.cells import Cell, unit_rows
from matryoshka2d.evaluate.grid import EncoderCells, embed_distinct


def cell_label(cell: Cell) -> str:
    """'6x384': how a cell is written on the command line (--cells, --query-cell) and names its output folder."""
    return f"{cell[0]}x{cell[1]}"


class SharedPass:
    """The cells of one encoder for the texts of the task being evaluated, computed in one pass for all of them.

    `vectors(texts, cell)` encodes the texts once (every cell layer of `cells` in one pass of `EncoderCells`) and
    keeps the result until `forget()`, so the next cell of the same task slices what is already there. The key is
    the texts themselves (a sha256 over them, in order), so two calls with other texts never share vectors.
    """

    def __init__(self, encoder, cells: Iterable[Cell], batch_size: int = 64, show_progress: bool = False):
        cells = sorted(set(cells))
        self.encoder = encoder
        self.embedder = EncoderCells(
            encoder,
            sorted({n for n, _ in cells}),
            sorted({d for _, d in cells}),
            batch_size=batch_size,
            show_progress=show_progress,
        )
        self._kept: dict[bytes, tuple[dict[Cell, np.ndarray], np.ndarray]] = {}
        self.seconds = 0.0  # the time spent encoding, every pass together: a cell's share of it is read as a delta

    def vectors(self, texts: Sequence[str], cell: Cell) -> np.ndarray:
        key = _texts_key(texts)
        if key not in self._kept:
            start = time.perf_counter()
            arrays, rows = embed_distinct(self.embedder, texts)
            self._kept[key] = arrays, np.fromiter((rows[t] for t in texts), dtype=np.int64, count=len(texts))
            self.seconds += time.perf_counter() - start
        arrays, index = self._kept[key]
        return unit_rows(arrays[cell])[index]

    def forget(self) -> None:
        """Drop the vectors kept: the task they were for is done."""
        self._kept.clear()


def _texts_key(texts: Sequence[str]) -> bytes:
    digest = hashlib.sha256(str(len(texts)).encode())
    for text in texts:
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.digest()


@dataclass
class QuerySide:
    """Where a pair's queries go: the pass of the query model (or of the model itself, for a query cell) at `layer`,
    the first dim numbers of the document cell's width. `label` names it ('query model q2', 'query cell 3x128')."""

    queries: SharedPass
    layer: int
    label: str

    def vectors(self, texts: Sequence[str], dim: int) -> np.ndarray:
        return self.queries.vectors(texts, (self.layer, dim))


class CellEncoder(AbsEncoder):
    """One cell of a model as mteb's encoder: documents and every symmetric task through the cell, queries
    (`PromptType.query`) through `query` when the cell is one side of a pair.

    `routed` counts the texts each side encoded ('cell', 'query side'), what a pair's evaluation shows went where.
    """

    def __init__(self, documents: SharedPass, cell: Cell, query: QuerySide | None = None, revision: str | None = None):
        self.documents, self.cell, self.query = documents, cell, query
        self.routed: Counter[str] = Counter()
        encoder = documents.encoder
        name = f"matryoshka2d/{Path(str(encoder.name)).name}-{cell_label(cell)}"
        if query is not None:
            name += "-queries-" + query.label.replace(" ", "-")
        # Fields mteb reads (mteb/models/model_meta.py, ModelMeta): the name and revision name its result folders
        # (model_name_as_path, ResultCache.get_task_result_path); similarity_fn_name: cosine (AbsEncoder.similarity).
        # What the model knows of itself fills the rest; what nobody recorded (release date, languages, license)
        # stays None, as mteb writes a field it does not know.
        parameters = model_parameters(encoder, cell)
        self.mteb_model_meta = ModelMeta(
            loader=None,
            name=name.replace(" ", "_"),
            revision=revision,
            release_date=None,
            languages=None,
            n_parameters=parameters["n_parameters"],
            n_embedding_parameters=parameters["n_embedding_parameters"],
            memory_usage_mb=parameters["memory_usage_mb"],
            max_tokens=encoder.max_length,
            embed_dim=cell[1],
            license=None,
            open_weights=None,
            public_training_code=None,
            public_training_data=None,
            framework=["PyTorch", "Sentence Transformers"],
            reference=None,
            similarity_fn_name=ScoringFunction.COSINE,
            use_instructions=False,
            training_datasets=None,
        )

    def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs) -> np.ndarray:
        """The batches' texts as float32 unit vectors of the cell's width, in the order mteb gave them."""
        texts = [text for batch in inputs for text in batch["text"]]
        if prompt_type == PromptType.query and self.query is not None:
            self.routed["query side"] += len(texts)
            return self.query.vectors(texts, self.cell[1])
        self.routed["cell"] += len(texts)
        return self.documents.vectors(texts, self.cell)


def model_parameters(encoder, cell: Cell) -> dict:
    """What mteb's ModelMeta holds of a model's size, for a cell of `encoder`: at layer 0 the static cell's own
    parameters (its token table and head, all it runs), else the model's (the transformer, its pooler and exit heads,
    the static cell left out: the cell is cut from them), the input token table among them, and their bytes in MiB."""
    import torch

    static = getattr(encoder, "static_cell", None)
    if cell[0] == 0 and static is not None:
        tensors = list(static.parameters())
        table = static.embedding
    else:
        skipped = {id(p) for p in static.parameters()} if static is not None else set()
        tensors = [p for p in encoder.parameters() if id(p) not in skipped]
        table = encoder.model.get_input_embeddings() if hasattr(encoder.model, "get_input_embeddings") else None
    embedding = [p for p in table.parameters()] if isinstance(table, torch.nn.Module) else []
    return {
        "n_parameters": sum(p.numel() for p in tensors),
        "n_embedding_parameters": sum(p.numel() for p in embedding) or None,
        "memory_usage_mb": round(sum(p.numel() * p.element_size() for p in tensors) / 2**20, 2),
    }


# ---- the query side of a pair: checked as every other reader of a query encoder checks it -------------------------


def query_model_side(encoder, student, cells: Sequence[Cell], batch_size: int = 64) -> QuerySide:
    """`--query-model`: a query encoder distilled from `encoder` (`distill --mode query`, or `--mode static`: its layer
    0), checked as `eval retrieval --query-model` checks it (retrieval/cascade.py, _check_query_encoders, through
    models.identity): distilled from these weights and pooling, towards the layer the cells' documents are at."""
    from matryoshka2d.models.query_record import (
        check_query_cells,
        check_query_encoder,
        documents_identity,
        query_encoder_layer,
        query_encoder_record,
    )

    record = query_encoder_record(student)
    if record is None:
        raise ValueError(
            f"--query-model {student.name}: not a query encoder (its folder has no `distill` record of --mode query or "
            "static); make one with `matryoshka2d distill --mode query`, or pair a cell of the model: --query-cell"
        )
    check_query_encoder(record, student.name, documents_identity(encoder), "--query-model")
    check_query_cells(record, student.name, cells, "--query-model")
    if too_wide := [c for c in cells if c[1] > student.hidden_size]:
        raise ValueError(
            f"--query-model {student.name} gives {student.hidden_size} numbers, fewer than cell "
            f"{cell_label(too_wide[0])} holds: give cells of at most {student.hidden_size} numbers"
        )
    layer = query_encoder_layer(record, student)
    queries = SharedPass(student, [(layer, d) for _, d in cells], batch_size)
    return QuerySide(queries, layer, f"query model {Path(str(student.name)).name}")


def query_cell_side(encoder, query_cell: Cell, cells: Sequence[Cell], batch_size: int = 64) -> QuerySide:
    """`--query-cell LxD`: queries at layer L of the model itself, documents at each cell (n, D) with n >= L, as
    `export --query-cell` pairs them (export/pair.py: the query cell and the documents share a width)."""
    layer, dim = query_cell
    encoder.check_layer(layer)
    encoder.check_dim(dim)
    for cell in cells:
        if cell[1] != dim:
            raise ValueError(
                f"--query-cell {cell_label(query_cell)} pairs queries of {dim} numbers with documents of the same "
                f"width, but cell {cell_label(cell)} has {cell[1]}: give cells of width {dim} (e.g. "
                f"{encoder.num_layers}x{dim}), or leave --cells out"
            )
        if cell[0] < layer:
            raise ValueError(
                f"--query-cell {cell_label(query_cell)}: cell {cell_label(cell)}'s documents are at layer {cell[0]}, "
                f"shallower than the queries' layer {layer}; a query cell is the shallow side of a pair"
            )
    return QuerySide(SharedPass(encoder, [query_cell], batch_size), layer, f"query cell {cell_label(query_cell)}")


def pair_folder_side(encoder, cells: Sequence[Cell], batch_size: int = 64) -> QuerySide | None:
    """A pair folder given as --model (`export --query-model/--query-cell`): its query route for queries (loaded by
    ElasticEncoder as `query_encoder`), at all of its layers; None for any other model."""
    route = getattr(encoder, "query_encoder", None)
    if route is None:
        return None
    top = route.num_layers
    return QuerySide(SharedPass(route, [(top, d) for _, d in cells], batch_size), top, "the pair's query route")
