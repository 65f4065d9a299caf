"""sentence-transformers folders both ways: what a folder's modules say (pooling, length, Normalize, a Dense
head), read through sentence-transformers' own module classes; and writing an encoder, or one cell of it, as a
folder that `SentenceTransformer(path)`, `AutoModel.from_pretrained(path)` and `ElasticEncoder(path)` all load.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from matryoshka2d.files import ConfinedFolder, OutsideFolderError
from matryoshka2d.models.backbones import POOLING_MODES, BackboneError, layer_stack
from matryoshka2d.models.card import write_model_card
from matryoshka2d.models.heads import HEADS_FILE, RECORD_KEY, HeadsError
from matryoshka2d.models.heads_on_disk import save_heads
from matryoshka2d.models.identity import RECORD_FILE, backbone_sha256, without_own_identity
from matryoshka2d.models.pooler import ACTIVATIONS, PoolerHead
from matryoshka2d.models.static import FOLDER as STATIC_FOLDER
from matryoshka2d.models.static import RECORD_KEY as STATIC_KEY
from matryoshka2d.outputs import make_folder, move_into_place, remove_file, remove_tree, temporary_folder, write_text

# sentence-transformers' pooling_mode names (any version: its Pooling module converts the legacy
# pooling_mode_*_token flags) -> ours.
ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last-token"}
OUR_TO_ST_POOLING = {ours: theirs for theirs, ours in ST_POOLING.items()}


@dataclass
class SentenceConfig:
    """What a sentence-transformers folder says about pooling, length, normalisation and a dense head.

    `dense` is the folder's sentence-transformers Dense module, loaded by sentence-transformers itself.
    """

    pooling: str | None = None
    max_length: int | None = None
    normalize: bool = False
    pooler_dir: str | None = None
    dense: nn.Module | None = None


# sentence-transformers' legacy pooling flags -> its pooling_mode names (its Pooling module's own table).
ST_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Where sentence-transformers' Transformer module keeps max_seq_length (its load_config tries these in order).
ST_TRANSFORMER_CONFIGS = tuple(
    f"sentence_{name}_config.json"
    for name in ("bert", "roberta", "distilbert", "camembert", "albert", "xlm-roberta", "xlnet")
)


def settings_module(kind: str, folder: Path):
    """The settings of a Transformer, Pooling or Normalize module of sentence-transformers read from its JSON,
    as (class name, settings), or None where only sentence-transformers can say (another module, a config that
    does not read plainly). Importing sentence-transformers costs about 200 MB of RSS (scikit-learn, pandas and
    pyarrow come with it) and seconds of start-up; a model whose modules are these three does not need it."""
    package, _, name = kind.rpartition(".")
    if not package.startswith("sentence_transformers.") or name not in ("Transformer", "Pooling", "Normalize"):
        return None
    try:
        if name == "Normalize":
            return name, {}
        if name == "Transformer":
            found = next((folder / f for f in ST_TRANSFORMER_CONFIGS if (folder / f).is_file()), None)
            config = json.loads(found.read_text()) if found else {}
            return name, {"max_seq_length": config.get("max_seq_length")}
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # sentence-transformers reads it and says what is wrong
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [ST_POOLING_FLAGS[k] for k, on in config.items() if k in ST_POOLING_FLAGS and on is True]
        mode = modes[0] if len(modes) == 1 else None
    return (name, {"pooling_mode": mode}) if isinstance(mode, str) else None


# ---- a query/document pair: one folder whose only module is sentence-transformers' Router ---------------------

ROUTER_CONFIG = "router_config.json"  # Router.save writes it beside modules.json
PAIR_ROUTES = ("query", "document")  # Router.for_query_document's routes; "document" is its default route


def confined(model_dir) -> ConfinedFolder:
    """`model_dir` as a ConfinedFolder (one given is kept as it is; a path is wrapped, its links not yet checked)."""
    return model_dir if isinstance(model_dir, ConfinedFolder) else ConfinedFolder(model_dir, "model", check=False)


def _named(folder: ConfinedFolder, name, named_by, field: str, folder_itself: bool = False) -> Path:
    """folder.path as a BackboneError: a name a file of the model folder gives, confined to the folder."""
    try:
        return folder.path(name, named_by, field, folder_itself)
    except OutsideFolderError as exc:
        raise BackboneError(str(exc)) from None


def _read_modules(folder: ConfinedFolder) -> tuple[Path, list | None]:
    """(modules.json, its list of modules, or None when the folder has none), every module's path checked to
    name a folder inside the model folder before anything there is opened."""
    modules_file = _named(folder, "modules.json", folder.folder, "sentence-transformers' module list")
    if not modules_file.is_file():
        return modules_file, None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BackboneError(f"{modules_file}: not valid JSON ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise BackboneError(f"{modules_file}: not a list of modules (objects with 'type' and 'path')")
    for i, module in enumerate(modules):
        kind = module.get("type", "")
        _named(folder, module.get("path", ""), modules_file, f"entry {i} ({kind or 'no type'}) path", True)
    return modules_file, modules


def model_folder(location) -> ConfinedFolder | None:
    """The one reader of a local model folder (a plain Hugging Face or sentence-transformers folder, one with exit
    heads or a static cell, a query encoder, a pair), checked before anything in it is opened: every name that its
    modules.json and a Router's router_config.json give stays inside it (files.inside), and no link in it leaves
    it (a file that transformers, tokenizers or safetensors open by a fixed name, a tokenizer.json or a
    model.safetensors, would otherwise be read from anywhere). A Hugging Face cache snapshot, whose files link into
    its own `../../blobs`, is a model folder (files.confinement). None for a hub id (not a local folder)."""
    if isinstance(location, ConfinedFolder):
        return location
    if location is None or not Path(location).is_dir():
        return None
    folder = confined(location)
    try:
        _read_modules(folder)
        router_routes(folder)
        folder.check_links()
    except OutsideFolderError as exc:
        raise BackboneError(str(exc)) from None
    except RuntimeError as exc:  # pathlib's "Symlink loop from ...": a link that leads nowhere
        raise BackboneError(
            f"{location}: a symbolic link in the model folder loops ({exc}); nothing in it was read: remove the link"
        ) from None
    return folder


def router_routes(model_dir) -> dict[str, list[tuple[str, str]]] | None:
    """The routes of a folder that sentence-transformers' Router.for_query_document wrote (route -> its modules as
    (type, subfolder), in order), read from router_config.json; None for a folder whose modules.json lists no
    Router. A Router of other routes (modalities, several tasks) is refused, naming what it holds. Every module a
    route names is checked to be a folder inside the model folder before anything is opened there."""
    if not model_dir:
        return None
    folder = confined(model_dir)
    root = folder.folder
    _, modules = _read_modules(folder)
    if modules is None or not any(str(m.get("type", "")).rpartition(".")[2] in ("Router", "Asym") for m in modules):
        return None
    where = _named(folder, ROUTER_CONFIG, root / "modules.json", "the Router's config")
    try:
        config = json.loads(where.read_text(encoding="utf-8"))
        types, structure = config["types"], config["structure"]
        routes = {name: [(types[module], module) for module in structure[name]] for name in structure}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackboneError(f"{where}: not a Router config sentence-transformers wrote ({exc!r})") from None
    for name, modules_of_route in routes.items():
        for i, (_, sub) in enumerate(modules_of_route):
            _named(folder, sub, where, f"structure.{name}[{i}]")
    if len(modules) != 1 or sorted(routes) != sorted(PAIR_ROUTES) or config.get("parameters", {}).get("route_mappings"):
        raise BackboneError(
            f"{root}: a Router with routes {sorted(routes)} and {len(modules)} top-level modules; matryoshka2d reads "
            "the Router of Router.for_query_document alone (routes 'query' and 'document')"
        )
    return routes


def route_transformer_dir(model_dir, route: str) -> Path:
    """The subfolder holding the Transformer (weights, config, tokenizer) of one route of a pair folder, checked to
    lie inside the pair folder."""
    folder = confined(model_dir)
    routes = router_routes(folder) or {}
    kind, sub = (routes.get(route) or [("", "")])[0]
    where = folder.folder / ROUTER_CONFIG
    if kind.rpartition(".")[2] != "Transformer":
        raise BackboneError(f"{where}: the {route} route does not start with a Transformer")
    return _named(folder, sub, where, f"structure.{route}[0]")


def read_sentence_config(model_dir, route: str | None = None) -> SentenceConfig:
    """Read a sentence-transformers folder's modules: Transformer, Pooling and Normalize from their JSON where it
    reads plainly (`settings_module`), anything else through sentence-transformers' own module classes.

    Each module that modules.json lists is resolved and loaded by the installed sentence-transformers (so every
    config format it reads, old `pooling_mode_mean_tokens` flags and new `pooling_mode` alike, is read here),
    except the Transformer, whose weights `load_transformer` loads; only its settings (max_seq_length) are read.
    A plain Hugging Face folder (no modules.json) gives an empty config. A query/document pair (router_routes)
    gives the modules of `route`, by default its document route. `model_dir`: a path (checked first:
    model_folder) or the ConfinedFolder that model_folder returned.
    """
    cfg = SentenceConfig()
    if model_dir is None:
        return cfg
    folder = model_folder(model_dir)
    if folder is None:
        return cfg
    root = folder.folder
    modules_file, modules = _read_modules(folder)
    if modules is None:
        bert_cfg = _named(folder, "sentence_bert_config.json", root, "sentence-transformers' settings")
        if bert_cfg.is_file():
            cfg.max_length = json.loads(bert_cfg.read_text(encoding="utf-8")).get("max_seq_length")
        return cfg
    routes = router_routes(folder)
    if routes is not None:
        modules = [{"type": kind, "path": sub} for kind, sub in routes[route or "document"]]
        modules_file = root / ROUTER_CONFIG
    dense_dirs = []
    for i, module in enumerate(modules):
        kind, sub = module.get("type", ""), module.get("path", "")
        where = f"{modules_file} entry {i} ({kind or 'no type'}, path '{sub}')"
        # before any of the module's files is read, here or by sentence-transformers
        module_dir = _named(folder, sub, modules_file, f"entry {i} ({kind or 'no type'}) path", folder_itself=True)
        plain = settings_module(kind, module_dir)
        if plain is None:
            from sentence_transformers.util.misc import import_module_class

            try:
                module_class = import_module_class(kind, str(root), trust_remote_code=False)
            except Exception as exc:
                raise BackboneError(f"{where}: sentence-transformers cannot resolve this module ({exc})") from None
        name = plain[0] if plain else module_class.__name__
        try:
            if name == "Transformer":
                config = plain[1] if plain else module_class.load_config(str(root), subfolder=sub)
                cfg.max_length = config.get("max_seq_length")
            elif name == "Pooling":
                mode = plain[1]["pooling_mode"] if plain else module_class.load(str(root), subfolder=sub).pooling_mode
                if mode not in ST_POOLING:
                    raise BackboneError(
                        f"{module_dir / 'config.json'}: pooling mode {mode!r} is not supported; matryoshka2d "
                        f"supports {', '.join(ST_POOLING)} (its names: {', '.join(POOLING_MODES)})"
                    )
                cfg.pooling = ST_POOLING[mode]
            elif name == "Normalize":
                cfg.normalize = True
            elif name == "Dense":
                if cfg.normalize:
                    raise BackboneError(f"{where}: a Dense module after Normalize is not supported")
                cfg.dense = module_class.load(str(root), subfolder=sub, trust_remote_code=False)
                cfg.pooler_dir = str(module_dir)
                dense_dirs.append(sub)
            else:
                raise BackboneError(
                    f"{where}: module {name} is not supported; matryoshka2d reads Transformer, Pooling, Dense "
                    "and Normalize"
                )
        except BackboneError:
            raise
        except Exception as exc:
            raise BackboneError(f"{where}: sentence-transformers could not load it ({exc})") from None
    if len(dense_dirs) > 1:
        raise BackboneError(
            f"{modules_file}: lists {len(dense_dirs)} Dense modules ({', '.join(dense_dirs)}); one is supported"
        )
    return cfg


def head_from_dense(dense: nn.Module, where: str | None, hidden: int) -> PoolerHead:
    """Our PoolerHead from a sentence-transformers Dense module that sentence-transformers loaded."""
    activation = type(dense.activation_function)
    name = f"{activation.__module__}.{activation.__qualname__}"
    if getattr(dense, "use_residual", False):
        raise BackboneError(f"{where}: Dense modules with use_residual are not supported")
    if dense.in_features != hidden:
        raise BackboneError(
            f"{where}: the Dense module takes {dense.in_features} numbers but the model's pooled vectors have {hidden}"
        )
    try:
        head = PoolerHead(dense.in_features, dense.out_features, activation=name, bias=dense.linear.bias is not None)
    except BackboneError as exc:
        raise BackboneError(f"{where}: {exc}") from None
    head.linear.load_state_dict(dense.linear.state_dict())
    return head


def layer_count_attrs(config) -> dict[str, int]:
    """The config fields that hold the number of layers (num_hidden_layers; n_layers for DistilBERT)."""
    return {a: getattr(config, a) for a in ("num_hidden_layers", "n_layers") if hasattr(config, a)}


# ---- writing ----------------------------------------------------------------------------------------------


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


def pair_route(location, display: str, route: str | None) -> tuple[str | None, str, str]:
    """(route, name, transformer folder) of a folder to load (a path, a hub id, or the ConfinedFolder of
    model_folder): a pair folder (router_routes) loads its document route unless `route` says "query"; any other
    folder loads as it is (route None), and may not be given one."""
    if router_routes(location) is None:
        if route is not None:
            raise BackboneError(f"{display} is not a query/document pair folder; route={route!r} is for one")
        return None, display, str(location.folder if isinstance(location, ConfinedFolder) else location)
    route = route or "document"
    if route not in PAIR_ROUTES:
        raise BackboneError(f"route {route!r}: a pair folder has routes {', '.join(PAIR_ROUTES)}")
    return route, display if route == "document" else f"{display}#{route}", str(route_transformer_dir(location, route))
