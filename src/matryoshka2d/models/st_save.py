"""Writing sentence-transformers folders: an encoder, or one cell of it, saved as a folder that
`SentenceTransformer(path)`, `AutoModel.from_pretrained(path)` and `ElasticEncoder(path)` all load, written by
sentence-transformers' own modules and moved into place by the one writer (matryoshka2d.outputs). Reading one is
models.st_folder.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from torch import nn

from matryoshka2d.models.backbones import BackboneError, layer_stack
from matryoshka2d.models.card import write_model_card
from matryoshka2d.models.heads import HEADS_FILE, RECORD_KEY, HeadsError
from matryoshka2d.models.heads_on_disk import save_heads
from matryoshka2d.models.identity import RECORD_FILE, backbone_sha256
from matryoshka2d.models.pooler import ACTIVATIONS
from matryoshka2d.models.query_record import without_own_identity
from matryoshka2d.models.st_folder import OUR_TO_ST_POOLING
from matryoshka2d.models.static import FOLDER as STATIC_FOLDER
from matryoshka2d.models.static import RECORD_KEY as STATIC_KEY
from matryoshka2d.outputs import make_folder, move_into_place, remove_file, remove_tree, temporary_folder, write_text


@contextlib.contextmanager
def truncated_stack(model: nn.Module, depth: int):
    """Temporarily cut the model's layer stack to its first `depth` layers, for saving a cut model only (the
    exits never mutate the model: see models.exits.ExitRequest)."""
    stack = layer_stack(model)
    if depth == len(stack):
        yield stack
        return
    parent, name = _parent_of(model, stack)
    setattr(parent, name, nn.ModuleList(list(stack)[:depth]))
    try:
        yield stack
    finally:
        setattr(parent, name, stack)


def _parent_of(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for module in model.modules():
        for name, sub in module.named_children():
            if sub is child:
                return module, name
    raise BackboneError("layer stack not found in its model")  # pragma: no cover - table guarantees it


def layer_count_attrs(config) -> dict[str, int]:
    """The config fields that hold the number of layers (num_hidden_layers; n_layers for DistilBERT)."""
    return {a: getattr(config, a) for a in ("num_hidden_layers", "n_layers") if hasattr(config, a)}


def save_folder(
    self,
    path: str | Path,
    keep_layers: int | None = None,
    metadata: dict | None = None,
    dim: int | None = None,
    normalize: bool | None = None,
) -> Path:
    """Write a sentence-transformers folder that loads with `SentenceTransformer(path)`,
    `AutoModel.from_pretrained(path)` and `ElasticEncoder(path)`.

    sentence-transformers writes the folder itself from its own modules: Transformer (safetensors weights,
    tokenizer), Pooling, the pooler head as a Dense module if there is one, and Normalize when the model
    normalizes, plus modules.json and config_sentence_transformers.json. A model card (README.md) follows.

    `keep_layers` cuts the saved model to its first layers (config and weights: the layers above are not
    written at all). `dim` keeps the first `dim` numbers of each embedding (an identity Dense module, exact,
    before Normalize, so the folder gives the cell's vectors). `normalize` overrides the model's own
    Normalize. `metadata` (method, training config, ...) goes to matryoshka2d.json.

    Exit heads (matryoshka2d.models.heads): a whole model keeps them (exit_heads.safetensors and their record in
    matryoshka2d.json); a model cut to layer n < N keeps the head of layer n as a Dense module holding only the
    output rows the cell needs, so plain sentence-transformers gives the cell's vectors, head included.

    A static cell (layer 0, matryoshka2d.models.static) is kept by a whole model whose backbone is still the one the
    cell was aligned to (`StaticCell.aligned_to`): the `static/` folder and its record in matryoshka2d.json. A model
    whose weights changed since (train, distill, merge) is saved without it: the cell's vectors live in the old
    weights' space, and a record stamped with the new weights would vouch for them.

    Every file goes through the one writer (matryoshka2d.outputs): the third-party writers (transformers,
    sentence-transformers, safetensors) write into a temporary folder inside `path`, whose files are then moved
    into place one by one (entry points, modules.json and config.json, last); a file of an earlier save that the
    new one does not have (exit heads, a module folder, a static cell) is removed first. A caller wanting the whole
    folder atomic writes to a temporary folder and renames (training.checkpoints.save_model_atomically).
    """
    out = Path(path)
    n = self.check_layer(keep_layers) if keep_layers else self.num_layers
    width = self.check_dim(dim) if dim is not None else None
    normalize = self.normalize_output if normalize is None else bool(normalize)
    metadata = None if metadata is None else {k: v for k, v in metadata.items() if k not in (RECORD_KEY, STATIC_KEY)}
    metadata = without_own_identity(metadata)  # a query encoder's checksum is of its folder, not of this one
    heads = self.exit_heads if self.use_heads else None
    cell_head = cut_head(self, n)
    whole = n == self.num_layers
    heads = heads if whole else None
    cell = self.static_cell if whole else None
    backbone = backbone_sha256(self) if heads is not None or cell is not None else None
    if cell is not None and getattr(cell, "aligned_to", None) != backbone:
        cell = None  # a stale cell: the weights it was aligned to changed since (it is not carried over)
    make_folder(out)
    staging = temporary_folder(out, "save")
    try:
        with truncated_stack(self.model, n):
            original = layer_count_attrs(self.model.config)
            for attr in original:
                setattr(self.model.config, attr, n)
            try:
                self.model.save_pretrained(staging, safe_serialization=True)
            finally:
                for attr, value in original.items():
                    setattr(self.model.config, attr, value)
        self.tokenizer.save_pretrained(staging)
        model = sentence_transformer_modules(self, staging, width, normalize, cell_head)
        model.save(str(staging), create_model_card=False)
        if heads is not None:
            metadata = {**(metadata or {}), RECORD_KEY: save_heads(heads, staging, backbone)}
        if cell is not None:  # a whole model keeps its layer 0 (models.static)
            record = {**cell.save(staging / STATIC_FOLDER), "backbone_sha256": cell.aligned_to}
            metadata = {**(metadata or {}), STATIC_KEY: record}
        if metadata is not None:
            write_text(staging / RECORD_FILE, json.dumps(metadata, indent=2, default=str))
        widths = matryoshka_widths(metadata, width or self.hidden_size)
        write_matryoshka_config(staging / "config.json", widths)
        write_model_card(
            staging, self, layers=n, dim=width, normalize=normalize, metadata=metadata, widths=widths, results=out
        )
        _replace_model_files(staging, out)
    finally:
        remove_tree(staging)
    return out


def cut_head(self, n: int):
    """The exit head that a folder of the model cut to its first `n` layers keeps as a Dense module (None for the
    whole model, or no head at layer n), or HeadsError for one that a sentence-transformers folder cannot hold.
    save_folder checks it first, and a training run before its first step (training.run_loop), so that no run is
    refused only at its save."""
    heads = self.exit_heads if self.use_heads else None
    cell_head = heads.heads[str(n)] if heads is not None and n < self.num_layers and heads.has(n) else None
    if cell_head is not None and cell_head.kind != "affine":
        raise HeadsError(
            f"the exit head of layer {n} is a {cell_head.kind} head; a sentence-transformers folder can hold an "
            "affine head only (a Dense module): fit affine heads to export this cell"
        )
    if cell_head is not None and len(heads.reads(n)) > 1:
        raise HeadsError(
            f"the exit head of layer {n} reads the pooled vectors of layers {heads.reads(n)}; a sentence-transformers "
            "folder pools one layer: export the cell as an ONNX graph only (export --format onnx), serve it from the "
            "model with its heads (`serve`), or fit heads with --inputs exit"
        )
    return cell_head


ENTRY_POINTS = ("modules.json", "config.json")  # what sentence-transformers and transformers open first


def _replace_model_files(staging: Path, out: Path) -> None:
    """Move a saved model's files from `staging` into `out`; what an earlier save into `out` left and this one
    does not write (its exit heads, module folders such as 2_Dense, a static cell, its matryoshka2d.json) is removed
    first, so that no file outlives its record and no record its files."""
    new = sorted(p.name for p in staging.iterdir())
    for old in sorted(out.iterdir()):
        module_folder = re.fullmatch(r"\d+_\w+", old.name) or old.name == STATIC_FOLDER
        if old.name in (HEADS_FILE, RECORD_FILE) and old.name not in new:
            remove_file(old)
        elif module_folder and (old.is_dir() or old.is_symlink()):
            remove_tree(old) if not old.is_symlink() else remove_file(old)
    for name in [n for n in new if n not in ENTRY_POINTS] + [n for n in ENTRY_POINTS if n in new]:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            remove_tree(target)
        move_into_place(staging / name, target)


def matryoshka_widths(metadata: dict | None, width: int) -> list[int]:
    """The widths of this folder's vectors that training put a loss on, up to `width`, and `width` itself.

    Read from the run's record: `trained_widths` (written since issue 20), else the method's own settings (dims
    of mrl, 2dmse and asymmetric; the sizes of starbucks; k of ese). A folder with no training record claims
    only its full width.
    """
    metadata = metadata or {}
    trained = metadata.get("trained_widths")
    if not isinstance(trained, list):
        method = metadata.get("method") if isinstance(metadata.get("method"), dict) else {}
        trained = list(method.get("dims") or [])
        trained += [size[1] for size in method.get("sizes") or [] if isinstance(size, list) and len(size) == 2]
        if isinstance(method.get("k"), int):
            trained.append(method["k"])
    return sorted({int(w) for w in trained if isinstance(w, int) and 0 < w <= width} | {width})


def write_matryoshka_config(config_path: Path, widths: list[int]) -> None:
    """Add the keys vLLM and SGLang read from config.json before they accept an OpenAI `dimensions` field.

    vLLM (PR #16331) treats a model as Matryoshka when `matryoshka_dimensions` is non-empty or `is_matryoshka` is
    true, and then accepts only the listed widths; SGLang does the same unless `is_matryoshka` is true, which
    allows any width. So `matryoshka_dimensions` lists the trained widths, and `is_matryoshka` is true only when
    there is more than one.
    """
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["is_matryoshka"] = len(widths) > 1
    config["matryoshka_dimensions"] = widths
    write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def sentence_transformer_modules(self, folder: Path, dim: int | None, normalize: bool, cell_head=None):
    """A SentenceTransformer on the Hugging Face files in `folder`, with this encoder's modules after it; with
    `cell_head` (an affine exit head), that head in place of any pooler head, cut to the cell's `dim` rows."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(folder), max_seq_length=self.max_length)
    modules = [transformer, Pooling(self.transformer_size, pooling_mode=OUR_TO_ST_POOLING[self.pooling])]
    if cell_head is not None:
        rows = dim or self.hidden_size
        dense = Dense(self.transformer_size, rows, bias=True, activation_function=nn.Identity())
        weight, bias = cell_head.linear.weight.detach().float().cpu(), cell_head.linear.bias.detach().float().cpu()
        dense.linear.load_state_dict({"weight": weight[:rows].clone(), "bias": bias[:rows].clone()})
        modules.append(dense)
        dim = None  # the head's rows are the cell's numbers already
    elif self.head is not None:
        dense = Dense(
            self.head.in_features,
            self.head.out_features,
            bias=self.head.linear.bias is not None,
            activation_function=ACTIVATIONS[self.head.activation_name](),
        )
        dense.linear.load_state_dict({k: v.detach().float().cpu() for k, v in self.head.linear.state_dict().items()})
        modules.append(dense)
    if dim is not None and dim < self.hidden_size:
        # Keep the first `dim` numbers: y = I[:dim] x is exact in floating point (products by 0 and 1).
        modules.append(
            Dense(
                self.hidden_size,
                dim,
                bias=False,
                activation_function=nn.Identity(),
                init_weight=torch.eye(self.hidden_size)[:dim].clone(),
            )
        )
    if normalize:
        modules.append(Normalize())
    return SentenceTransformer(modules=modules, device="cpu", similarity_fn_name="cosine")
