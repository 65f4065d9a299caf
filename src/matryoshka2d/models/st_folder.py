"""Reading sentence-transformers folders: the one reader of a local model folder (model_folder, confined before
anything in it is opened), what its modules say (pooling, length, Normalize, a Dense head), read through
sentence-transformers' own module classes, and the routes of a query/document pair (sentence-transformers' Router).
Writing one is models.st_save.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from matryoshka2d.confined import ConfinedFolder, OutsideFolderError
from matryoshka2d.models.backbones import POOLING_MODES, BackboneError
from matryoshka2d.models.pooler import PoolerHead

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
    modules.json and a Router's router_config.json give stays inside it (confined.inside), and no link in it leaves
    it (a file that transformers, tokenizers or safetensors open by a fixed name, a tokenizer.json or a
    model.safetensors, would otherwise be read from anywhere). A Hugging Face cache snapshot, whose files link into
    its own `../../blobs`, is a model folder (confined.confinement). None for a hub id (not a local folder), once
    the snapshot of it that transformers will read from the local cache, if there is one, is checked the same way."""
    if isinstance(location, ConfinedFolder):
        return location
    if location is None or not Path(location).is_dir():
        snapshot = cached_snapshot(location)
        if snapshot is not None:
            _checked(confined(snapshot), snapshot)
        return None
    return _checked(confined(location), location)


def cached_snapshot(hub_id) -> Path | None:
    """The folder of the local Hugging Face cache that transformers loads `hub_id` from (the snapshot of its
    default revision), or None: not an id of the form owner/name, or not in the cache (transformers downloads it)."""
    if not isinstance(hub_id, str) or hub_id.count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(hub_id, "config.json")
    except (ValueError, OSError):  # not a valid repository id
        return None
    return Path(found).parent if isinstance(found, str) else None


def _checked(folder: ConfinedFolder, location) -> ConfinedFolder:
    """`folder` after its module lists and links are checked, their refusals as BackboneError naming `location`."""
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
