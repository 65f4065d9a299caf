"""Layer 0: the static cell of a model, a token table and a head that land in the model's own output space.

Every transformer has one more cell below its first layer: the output of each vocabulary token run through the
model alone. model2vec (a maintained library) distils that table (`distill_from_model`: one forward pass per
token, mean-pooled, SIF-weighted; here without PCA, so every row stays in the model's own D-dim space), and a
sentence is then the mean of its tokens' rows: no attention, no layers, a small fraction of a millisecond. A table
alone is far from the model's sentence vectors (the context is missing); a head, an affine map fitted in closed
form onto the model's own unit vectors of unlabelled text (the ridge fit of the exit heads, models.heads), brings
it into the space the model's index was built in, and `distill --mode static` then trains table and head towards
the model's vectors (training.distill).

The cell is sentence-transformers' own modules, so that a folder of it is what plain sentence-transformers loads:
`StaticEmbedding` (an EmbeddingBag over the table, tokenized without special tokens) then `Dense` (the head, no
activation). In a model folder it sits beside the transformer:

MODEL/static/                 a sentence-transformers folder of those two modules: modules.json, the table
                              (model.safetensors, tokenizer.json) at its root, the head in 1_Dense/
MODEL/matryoshka2d.json       key `static`: the folder, the sha256 of each of its files, the sizes, the sha256 of
                              the backbone the cell was aligned to, and how it was made

A folder whose files do not match the record, or whose record names another backbone than the folder's, is refused
when the model loads (as exit heads are: models.heads_on_disk). Its weights are read as safetensors and its
tokenizer as tokenizer.json; nothing in it runs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from matryoshka2d.files import file_sha256
from matryoshka2d.models.backbones import BackboneError, fast_tokenizer
from matryoshka2d.models.heads_fit import HELD_OUT_EVERY, RIDGE_GRID, NormalEquations
from matryoshka2d.models.identity import confined_folder, folder_record
from matryoshka2d.outputs import move_into_place, remove_tree, temporary_folder

FOLDER = "static"
RECORD_KEY = "static"  # in matryoshka2d.json
DENSE_DIR = "1_Dense"
# sentence-transformers saves the input module (the table) at the folder's root, the others in their folders
FILES = ("model.safetensors", "tokenizer.json", f"{DENSE_DIR}/model.safetensors")
# model2vec's pooling names for ours (its create_embeddings pools each token's own forward pass the same way)
MODEL2VEC_POOLING = {"mean": "mean", "cls": "first", "last-token": "last"}
ENCODE_BATCH = 1024  # texts per EmbeddingBag call: a pass costs microseconds per text


class StaticCellError(BackboneError):
    """A static cell that cannot be made, loaded or used; the message names the file, option or model."""


def no_static_cell(name: str) -> StaticCellError:
    """The message for layer 0 asked of a model that holds no static cell."""
    return StaticCellError(
        f"layer 0 is a model's static cell (a token table and a head, matryoshka2d.models.static), and {name} holds "
        f"none: make one with `matryoshka2d distill --mode static --teacher {name} --data ... --output DIR` and use "
        "DIR, or ask for a layer from 1"
    )


class StaticCell(nn.Module):
    """sentence-transformers' StaticEmbedding (the table) and Dense (the head, identity activation): a text's
    vector is head(mean of its tokens' rows), exactly as plain sentence-transformers computes it from the folder."""

    def __init__(self, embedding, head):
        super().__init__()
        self.embedding, self.head = embedding, head
        self.record: dict = {}  # how it was made, saved with it
        # the backbone sha256 (models.identity) whose output space the cell lands in: the record's when loaded, the
        # model's when put on it (ElasticEncoder.set_static_cell); a model saved with other weights drops the cell
        self.aligned_to: str | None = None

    @classmethod
    def build(cls, tokenizer, table: np.ndarray | torch.Tensor, dim_out: int) -> StaticCell:
        """A cell on a `tokenizers.Tokenizer` and a (vocabulary x D) table, its head the first `dim_out` rows of the
        identity (fitted later: fit_head)."""
        from sentence_transformers.base.modules import Dense
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding
        from tokenizers import Tokenizer

        # A copy without padding: a tokenizer that pads (a tokenizer.json may say so) gives each text of a call the
        # call's longest length, its pad tokens counted in the mean, so a text's vector moved with its call (issue 61)
        tokenizer = Tokenizer.from_str(tokenizer.to_str())
        tokenizer.no_padding()
        table = torch.as_tensor(np.asarray(table, dtype=np.float32) if isinstance(table, np.ndarray) else table)
        embedding = StaticEmbedding(tokenizer, embedding_weights=table.float().contiguous())
        dim_in = embedding.embedding_dim
        head = Dense(
            dim_in, dim_out, bias=True, activation_function=nn.Identity(), init_weight=torch.eye(dim_in)[:dim_out]
        )
        nn.init.zeros_(head.linear.bias)
        return cls(embedding, head)

    @property
    def dim_in(self) -> int:
        return int(self.embedding.embedding_dim)

    @property
    def dim_out(self) -> int:
        return int(self.head.linear.out_features)

    @property
    def vocabulary(self) -> int:
        return int(self.embedding.num_embeddings)

    def describe(self) -> str:
        return f"layer 0: a table of {self.vocabulary} tokens x {self.dim_in}, head {self.dim_in} -> {self.dim_out}"

    def features(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The texts' token ids and offsets, as StaticEmbedding tokenizes them (no special tokens, no limit)."""
        device = self.head.linear.weight.device
        return {k: v.to(device) for k, v in self.embedding.preprocess(list(texts)).items()}

    def forward(self, features: dict[str, torch.Tensor], head: bool = True) -> torch.Tensor:
        """(B, dim_out) vectors (with head=False the tokens' mean, (B, dim_in))."""
        mean = self.embedding({"input_ids": features["input_ids"], "offsets": features["offsets"]})[
            "sentence_embedding"
        ]
        return self.head({"sentence_embedding": mean})["sentence_embedding"] if head else mean

    def encode(self, texts: Sequence[str], head: bool = True, batch_size: int = ENCODE_BATCH) -> np.ndarray:
        """float32 (len(texts), dim_out) vectors (the tokens' mean with head=False): what the modules compute
        (StaticEmbedding's tokens without special tokens, EmbeddingBag's mean, the head's linear map), called as
        functions on their weights, without the modules' dict wrappers and checks (a query's whole call is a few
        tenths of a millisecond, and they cost a third of it)."""
        if len(texts) <= batch_size:
            with torch.inference_mode():
                return self._vectors(list(texts), head).numpy()
        return np.concatenate([self.encode(texts[b : b + batch_size], head) for b in range(0, len(texts), batch_size)])

    def _vectors(self, texts: list[str], head: bool) -> torch.Tensor:
        table, linear = self.embedding.embedding.weight, self.head.linear
        ids = [e.ids for e in self.embedding.tokenizer.encode_batch(texts, add_special_tokens=False)]
        flat = torch.tensor([i for row in ids for i in row], dtype=torch.long, device=table.device)
        offsets = torch.tensor([0, *itertools.accumulate(len(row) for row in ids[:-1])], device=table.device)
        mean = nn.functional.embedding_bag(flat, table, offsets, mode="mean")
        return (nn.functional.linear(mean, linear.weight, linear.bias) if head else mean).float().cpu()

    def sentence_transformer(self, dim: int | None = None, normalize: bool = False):
        """A plain SentenceTransformer of this cell: the table, the head cut to its first `dim` rows (exact: the
        other rows are not computed), and Normalize when asked."""
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.base.modules import Dense, Normalize
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding

        rows = dim or self.dim_out
        table = self.embedding.embedding.weight.detach().float().cpu().clone()
        embedding = StaticEmbedding(self.embedding.tokenizer, embedding_weights=table)
        head = Dense(self.dim_in, rows, bias=True, activation_function=nn.Identity())
        weight, bias = self.head.linear.weight.detach().float().cpu(), self.head.linear.bias.detach().float().cpu()
        head.linear.load_state_dict({"weight": weight[:rows].clone(), "bias": bias[:rows].clone()})
        modules = [embedding, head, *([Normalize()] if normalize else [])]
        return SentenceTransformer(modules=modules, device="cpu", similarity_fn_name="cosine")

    def save(self, folder: str | Path) -> dict:
        """Write the cell as a sentence-transformers folder (built in a temporary folder beside it and moved into
        place: the one writer, matryoshka2d.outputs); returns the record for matryoshka2d.json (without the
        backbone, which the model's save adds)."""
        folder = Path(folder)
        staging = temporary_folder(folder.parent, folder.name)
        try:
            self.sentence_transformer().save(str(staging), create_model_card=False)
            remove_tree(folder)
            move_into_place(staging, folder)
        finally:
            remove_tree(staging)
        return {
            "folder": folder.name,
            "files": {name: file_sha256(folder / name) for name in FILES},
            "vocabulary": self.vocabulary,
            "dim_in": self.dim_in,
            "dim_out": self.dim_out,
            **({"made": self.record} if self.record else {}),
        }


# ---- in a model folder --------------------------------------------------------------------------------------


def read_record(folder) -> dict | None:
    """The `static` record of a model folder's matryoshka2d.json, or None when it holds no static cell."""
    return folder_record(folder, RECORD_KEY, StaticCellError)


def load_static_cell(folder, record: dict, backbone: str, dim_out: int) -> StaticCell:
    """The static cell a model folder's record describes, checked against its files (the table, the tokenizer and
    the head, each by its sha256 in the record) and against the backbone (`backbone`: the folder's backbone sha256;
    `dim_out`: the model's output width). The folder and its files are resolved inside the model folder (`folder`:
    a path or its confined.ConfinedFolder), so a Hugging Face cache snapshot's links into its blobs/ read too."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    confined = confined_folder(folder)
    folder = confined.folder
    record_file = folder / "matryoshka2d.json"
    where = f"{record_file} ({RECORD_KEY})"
    try:
        sub, files, aligned = record["folder"], dict(record["files"]), record["backbone_sha256"]
        dim_in, out = int(record["dim_in"]), int(record["dim_out"])
    except (KeyError, TypeError, ValueError) as exc:
        raise StaticCellError(f"{where}: the record is incomplete or malformed ({exc!r})") from None
    try:
        root = confined.path(sub, record_file, f"{RECORD_KEY}.folder")
        paths = {name: confined.path(f"{sub}/{name}", record_file, f"{RECORD_KEY}.files") for name in FILES}
    except ValueError as exc:
        raise StaticCellError(str(exc)) from None
    for name, path in paths.items():
        if not path.is_file():
            raise StaticCellError(f"{where} names {name}, which is missing from {root}")
        if file_sha256(path) != files.get(name):
            raise StaticCellError(f"{path}: the file is damaged or was changed (its sha256 is not the one in {where})")
    if aligned != backbone:
        raise StaticCellError(
            f"{root} ({where}): this static cell was aligned to another backbone (sha256 {str(aligned)[:12]}..., "
            f"this model's is {backbone[:12]}...): its vectors live in that model's space; distill one for this "
            "model with `matryoshka2d distill --mode static`"
        )
    if out != dim_out:
        raise StaticCellError(f"{where}: the cell outputs {out} numbers, the model {dim_out}")
    try:
        table = load_file(str(paths[FILES[0]]))["embedding.weight"]
        head = load_file(str(paths[FILES[2]]))
        tokenizer = Tokenizer.from_file(str(paths[FILES[1]]))
    except (SafetensorError, KeyError, OSError, Exception) as exc:  # tokenizers raises a bare Exception
        raise StaticCellError(f"{root}: cannot read the static cell ({str(exc).splitlines()[0]})") from None
    for key, tensor in [("embedding.weight", table), *head.items()]:
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise StaticCellError(f"{root}: {key} holds NaN, inf or no float numbers")
    if tuple(table.shape) != (tokenizer.get_vocab_size(), dim_in):
        raise StaticCellError(
            f"{root}: a table of {tuple(table.shape)} for a tokenizer of {tokenizer.get_vocab_size()} tokens and "
            f"{dim_in} numbers"
        )
    cell = StaticCell.build(tokenizer, table, out)
    try:
        cell.head.linear.load_state_dict({"weight": head["linear.weight"], "bias": head["linear.bias"]})
    except (KeyError, RuntimeError) as exc:
        raise StaticCellError(f"{root}/{DENSE_DIR}: not the head of this table ({str(exc).splitlines()[0]})") from None
    cell.record = dict(record.get("made") or {})
    cell.aligned_to = aligned
    return cell


# ---- made: model2vec's table, the closed-form head -----------------------------------------------------------


def distill_table(encoder, log: Callable[[str], None] | None = None) -> StaticCell:
    """model2vec's static table of `encoder`'s transformer (`distill_from_model`, no PCA, float32: every row in the
    model's own pooled space), with an identity head of the model's output width. The encoder is not changed
    (model2vec works on a copy of its embeddings)."""
    try:
        from model2vec.distill import distill_from_model
    except ImportError as exc:  # pragma: no cover - a dependency
        raise StaticCellError(f"the static cell needs model2vec and skeletoken ({exc})") from None
    if encoder.pooling not in MODEL2VEC_POOLING:
        raise StaticCellError(f"{encoder.name}: pooling '{encoder.pooling}' has no model2vec equivalent")
    fast_tokenizer(encoder.tokenizer, encoder.name, "a static cell (model2vec reads its vocabulary)")
    start = time.perf_counter()
    was_training = encoder.model.training
    try:
        static = distill_from_model(
            encoder.model,
            encoder.tokenizer,
            device=str(encoder.device),
            pca_dims=None,
            quantize_to="float32",
            pooling=MODEL2VEC_POOLING[encoder.pooling],
        )
    finally:
        encoder.model.train(was_training)
    if getattr(static, "token_mapping", None) is not None:  # pragma: no cover - only with vocabulary_quantization
        raise StaticCellError("model2vec returned a quantized vocabulary; distill without vocabulary_quantization")
    table = np.asarray(static.embedding, dtype=np.float32)
    if getattr(static, "weights", None) is not None:  # pragma: no cover - SIF weights folded in already without it
        table = table * np.asarray(static.weights, dtype=np.float32)[:, None]
    cell = StaticCell.build(static.tokenizer, table, encoder.hidden_size).to(encoder.device)
    seconds = round(time.perf_counter() - start, 1)
    cell.record = {
        "table": "model2vec distill_from_model, no PCA, float32",
        "model2vec": _version("model2vec"),
        "sif_coefficient": static.config.get("sif_coefficient") if isinstance(static.config, dict) else None,
        "table_seconds": seconds,
    }
    if log:
        log(f"static cell: model2vec table of {cell.vocabulary} tokens x {cell.dim_in} in {seconds:.1f} s")
    return cell


def check_texts_told_apart(cell: StaticCell, texts: Sequence[str], model: str) -> None:
    """A table that reads every text as the same tokens (a tokenizer whose vocabulary holds none of the texts'
    words but special tokens: every word is its unknown token) gives one vector for every text, and training it
    teaches nothing: refused, naming the model and what its table reads, before the teacher's targets and the steps.
    The texts' own vectors are compared (the tokens' means), so any cause of one vector for all is caught."""
    if len(texts) < 2:
        return
    means = cell.encode(texts, head=False)
    if np.abs(means - means[0]).max() > 1e-6 * max(float(np.abs(means).max()), 1e-30):
        return
    tokenizer = cell.embedding.tokenizer
    read = tokenizer.encode(texts[0], add_special_tokens=False).tokens[:6]
    vocabulary = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    raise StaticCellError(
        f"{model}: its static cell reads every one of the {len(texts)} texts as the same tokens (the first: "
        f"{' '.join(read) or 'no token at all'}), so layer 0 would give one vector for every text and the run would "
        f"train nothing: the table's vocabulary ({len(vocabulary)} tokens: {', '.join(vocabulary[:8])}"
        f"{', ...' if len(vocabulary) > 8 else ''}) holds no token of these texts but special ones. Distill the "
        "static cell of a model whose tokenizer has the texts' words"
    )


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:  # pragma: no cover
        return None


def fit_head(cell: StaticCell, texts: Sequence[str], targets: np.ndarray, batch: int = 4096) -> dict:
    """The closed-form head: the ridge map (models.heads_fit.NormalEquations) from each text's token mean onto its
    target (the model's unit vector of the text), every tenth text held out to choose the strength of the grid
    with the lowest held-out squared error, then refitted on all texts with it. Sets the head in place (an
    optimizer may hold its parameters); returns what was chosen."""
    if len(texts) != len(targets):
        raise StaticCellError(f"fit_head: {len(texts)} texts and {len(targets)} targets")
    start = time.perf_counter()
    fit = NormalEquations.empty(cell.dim_in, cell.dim_out)
    held = NormalEquations.empty(cell.dim_in, cell.dim_out)
    for b in range(0, len(texts), batch):
        x = cell.encode(texts[b : b + batch], head=False)
        y = np.asarray(targets[b : b + batch], dtype=np.float32)
        out = np.arange(b, b + len(x)) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        fit.add(x[~out], y[~out])
        held.add(x[out], y[out])
    if fit.rows == 0:
        raise StaticCellError("fit_head: no texts to fit the head on")
    errors = {r: held.squared_error(fit.solve(r * fit.rows)) / max(held.rows, 1) for r in RIDGE_GRID}
    best = min(errors, key=errors.get) if held.rows else RIDGE_GRID[len(RIDGE_GRID) // 2]
    everything = NormalEquations(fit.xtx + held.xtx, fit.xty + held.xty, fit.yty + held.yty, fit.rows + held.rows)
    solution = everything.solve(best * everything.rows)  # [W'; b']
    device = cell.head.linear.weight.device
    with torch.no_grad():
        cell.head.linear.weight.copy_(torch.from_numpy(solution[:-1].T.astype(np.float32)).to(device))
        cell.head.linear.bias.copy_(torch.from_numpy(solution[-1].astype(np.float32)).to(device))
    report = {
        "head": "closed-form ridge onto the model's unit vectors (models.heads_fit.NormalEquations)",
        "head_texts": everything.rows,
        "ridge": best,
        "held_out_mse": {str(r): round(e, 6) for r, e in errors.items()},
        "head_seconds": round(time.perf_counter() - start, 1),
    }
    cell.record = {**cell.record, **report}
    return report
