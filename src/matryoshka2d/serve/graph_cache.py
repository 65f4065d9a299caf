"""The ONNX graph cache of the server's onnx backend (serve/backends.OnnxBackend): one graph per exit layer, each
exactly `encoder.forward(features, [layer])` (ExitGraph in export/onnx_graphs.py), fp32 or int8
(onnx_graphs.quantize_int8, one activation scale per row; only the int8 graphs are kept: build_graph).

The graphs are cached beside the model (GraphCache), in a subfolder named by the checksum of the weights they are
built from, so that models share a cache folder: a manifest holds the checksum of the source weights and, for every
graph, its file's checksum and its cache key (cache_keys.cache_key over what the graph computes: `graph_key`); a
graph that is missing, whose file does not match its checksum, whose key is not this model's, or that was built from
other weights is rebuilt, never used, and so is one that, when a process first uses it, does not reproduce the model
on a few fixed texts as the build checked, or does not load (export/graph_check.py: `trusted`). Every file is written
through the one writer (matryoshka2d.outputs); the cache is kept by design inside the model folder it is built from
(`onnx-serve/`), a folder a command reads: outputs.allow_folder says so (serve/backends.OnnxBackend).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

from matryoshka2d import outputs
from matryoshka2d.cache_keys import cache_key
from matryoshka2d.confined import OutsideFolderError, inside
from matryoshka2d.export import graph_check
from matryoshka2d.export.graph_check import INT8_MIN_COSINE, check_graph, cosines, reference, run_reference
from matryoshka2d.export.onnx_graphs import OPSET, ExportError, export_exit, graph_metadata, quantize_int8
from matryoshka2d.files import file_sha256
from matryoshka2d.models.encoder import ElasticEncoder

# How each kind of graph is made; a cached graph made another way (an older recipe) is rebuilt. The int8 recipe
# names the fp32 one it starts from, so that a new fp32 recipe also rebuilds the int8 graphs.
FP32_RECIPE = "torch.onnx export of ExitGraph (encoder.forward at the layer): TorchScript, dynamo where it fails"
RECIPES = {
    None: FP32_RECIPE,
    "int8": f"onnx_graphs.quantize_int8 of the fp32 graph ({FP32_RECIPE}): scales per weight channel, activation row",
}
MANIFEST = "manifest.json"
CACHE_FOLDER = "onnx-serve"  # inside the model's folder when it is writable


# Configuration entries that do not change an exit graph (export itself turns the key/value cache off).
_NOT_IN_GRAPH = {"use_cache", "_name_or_path", "transformers_version"}


def weights_digest(encoder: ElasticEncoder) -> str:
    """A checksum of everything an exit graph is made of: every tensor of the encoder (transformer, pooler and
    any other head; names, dtypes, shapes and bytes), the pooling, the model's inputs and its configuration."""
    digest = hashlib.sha256()
    config = {k: v for k, v in encoder.model.config.to_dict().items() if k not in _NOT_IN_GRAPH}
    described = {"pooling": encoder.pooling, "inputs": list(encoder._input_names), "config": config}
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    for name, tensor in sorted(encoder.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def default_cache_folder(encoder: ElasticEncoder, digest: str) -> Path:
    """`onnx-serve/` inside the model's folder if it is there already (a cache that came with a read-only model is
    used read-only), or if that folder can be written and is not part of an installed package (minilm-l6 lives in
    site-packages); else under matryoshka2d's cache, named by the weights."""
    location = Path(encoder.location) if encoder.location else None
    installed = location is not None and {"site-packages", "dist-packages"} & set(location.resolve().parts)
    beside = location is not None and location.is_dir() and not installed
    if beside and ((location / CACHE_FOLDER).is_dir() or outputs.writing_problem(location) is None):
        return location / CACHE_FOLDER
    from matryoshka2d.models.backbones import cache_dir

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(encoder.name)).strip("-") or "model"
    return cache_dir() / CACHE_FOLDER / f"{name}-{digest[:12]}"


def cache_folder_problem(folder: str | Path) -> str | None:
    """What stops `folder` from being (made) a graph cache, or None: it, or a folder above it, is a file; or it
    does not exist and cannot be created where it would go. (An existing folder that cannot be written is a
    read-only cache: its graphs are used, and a missing one is a message then.)"""
    folder = Path(folder)
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                return f"{path} is a file, not a folder; give a folder for the ONNX graphs"
            if path != folder and not os.access(path, os.W_OK | os.X_OK):
                return f"cannot be created: {path} is not writable"
            return None
    return None


def weights_folder(source: str) -> str:
    """The name of the subfolder of a graph cache that holds the graphs built from the weights `source`."""
    return f"weights-{source[:16]}"


GRAPH_KIND = "onnx-exit-graph"  # the cache kind in the key


def graph_key(source: str, pooling: str | None, layer: int, quantize: str | None) -> str:
    """The cache key of one exit graph (cache_keys.cache_key). A graph computes `encoder.forward` at `layer` from
    token ids: it holds the weights (every tensor, exit heads included), the pooling and the model's inputs and
    configuration, all of which `source` (weights_digest) covers, the pooling also on its own; and it is made by a
    recipe (exporter, opset, precision). The tokenizer and the maximum length are not in it: the backend
    tokenizes, with the model's own tokenizer and max length, before the graph runs, so a graph serves any of them
    exactly (tests/test_cache_keys.py shows it); texts and widths do not apply (full width, sliced after)."""
    return cache_key(
        GRAPH_KIND,
        weights_sha256=source,
        config_sha256=None,  # in `source`: weights_digest covers the configuration with the tensors
        tokenizer_sha256=None,
        max_length=None,
        pooling=pooling,
        widths=None,
        texts_sha256=None,
        layer=int(layer),
        precision=quantize or "fp32",
        recipe=RECIPES[quantize],
        opset=OPSET,
    )


class GraphCache:
    """A cache folder (`root`) holds the graphs of any number of models, each model's in a subfolder named by the
    checksum of the weights they were built from (`weights_folder`; weights_digest covers every tensor, exit heads
    included), so that a query encoder and its teacher, or two versions of one model, share a cache folder without
    replacing each other's graphs. A subfolder holds `layer-N.onnx` / `layer-N.int8.onnx` and a manifest with the
    full checksum of the source weights and of each graph. A graph counts only if the manifest names it, for these
    weights, under the cache key of this model's graph (`graph_key`), with the checksum of the file as it is now;
    every name is resolved inside the subfolder (confined.inside: a link out is refused before it is read). A cache
    that cannot be written is used as it is; one that can is written only through the one writer."""

    def __init__(self, root: Path, source: str, pooling: str | None = None):
        self.root, self.source, self.pooling = Path(root), source, pooling
        self.graphs: dict[str, dict] = {}
        try:
            self.folder = inside(self.root, weights_folder(source), self.root, "the graph folder of these weights")
            manifest_path = inside(self.folder, MANIFEST, self.folder, "the graph manifest")
        except OutsideFolderError as exc:
            raise ExportError(f"{exc}: remove it, or pass another --onnx-cache") from None
        try:
            manifest = json.loads(manifest_path.read_text())
            if isinstance(manifest, dict) and manifest.get("source_sha256") == source:
                self.graphs = dict(manifest.get("graphs") or {})
        except (OSError, ValueError):
            pass  # no manifest, or a damaged one: nothing in the folder is trusted

    @staticmethod
    def file_name(layer: int, quantize: str | None) -> str:
        return f"layer-{layer}{'.' + quantize if quantize else ''}.onnx"

    def key(self, layer: int, quantize: str | None) -> str:
        return graph_key(self.source, self.pooling, layer, quantize)

    def path_of(self, layer: int, quantize: str | None) -> Path:
        return self.folder / self.file_name(layer, quantize)

    def valid(self, layer: int, quantize: str | None) -> Path | None:
        """The graph's path if the manifest vouches for the file as it is; OutsideFolderError, before the file is
        opened, if its name leads out of the folder."""
        name = self.file_name(layer, quantize)
        entry = self.graphs.get(name)
        if not isinstance(entry, dict) or entry.get("recipe") != RECIPES[quantize]:
            return None
        if entry.get("cache_key") != self.key(layer, quantize):  # made under other settings (or before keys)
            return None
        path = inside(self.folder, name, self.folder / MANIFEST, f"graphs[{name!r}]")
        if not path.is_file() or file_sha256(path) != entry.get("sha256"):
            return None
        return path

    def drop(self, layer: int, quantize: str | None) -> None:
        """Forget a graph that failed its check (and remove its file, or the link in its place, where the folder
        can be written), so that it is rebuilt."""
        name = self.file_name(layer, quantize)
        self.graphs.pop(name, None)
        with contextlib.suppress(OSError):  # a read-only cache: not used; building one is refused with a message
            outputs.remove_file(self.folder / name)  # a link in its place is removed, never what it points at

    def writing_problem(self) -> str | None:
        """Why a graph cannot be added here (the cache, or the folder that would hold it, cannot be written)."""
        try:
            outputs.make_folder(self.folder, check=False)  # its files are checked one by one as they are written
        except OSError as exc:
            return exc.strerror or str(exc)
        return outputs.writing_problem(self.folder)

    def add(self, layer: int, quantize: str | None, details: dict) -> Path:
        """Record the graph written at `path_of(layer, quantize)` with its checksum and cache key (the manifest is
        rewritten through the one writer: whole, or the old one)."""
        name = self.file_name(layer, quantize)
        path = self.folder / name
        self.graphs[name] = {
            "layer": layer,
            "quantize": quantize,
            "recipe": RECIPES[quantize],
            "cache_key": self.key(layer, quantize),
            "sha256": file_sha256(path),
            **details,
        }
        manifest = {"source_sha256": self.source, "graphs": dict(sorted(self.graphs.items()))}
        outputs.write_json(self.folder / MANIFEST, manifest)
        return path


def trusted(encoder: ElasticEncoder, cache: GraphCache, layer: int, quantize: str | None, log) -> Path | None:
    """The cached graph of `layer`, if the manifest vouches for it and it computes this model's layer
    (graph_check.check_graph: fp32 within ONNX_ATOL of torch, int8 by cosine and by holding quantized operators,
    on the fixed check sentences); a graph that fails, or whose name leads out of the cache, is dropped from the
    cache, with a line saying why, and None returned (build it)."""
    try:
        path = cache.valid(layer, quantize)
    except OutsideFolderError as exc:
        log(f"{exc}: it is not read, and the graph is rebuilt")
        cache.drop(layer, quantize)
        return None
    if path is None:
        return None
    problem = check_graph(encoder, path, layer, quantize, cache.graphs[path.name])
    if problem is None:
        return path
    log(f"the cached ONNX graph {path} {problem}: it is not used, and is rebuilt")
    cache.drop(layer, quantize)
    return None


def build_graph(encoder: ElasticEncoder, cache: GraphCache, layer: int, quantize: str | None, log=None) -> Path:
    """Export (and quantize) one exit layer into the cache. The fp32 graph reproduces encoder.forward within
    ONNX_ATOL (export_onnx checks it and records how closely); the int8 one records how closely it agrees (max
    |difference|, lowest cosine) and must reach INT8_MIN_COSINE; neither may move a text's vector with its call.

    An int8 graph is quantized from the fp32 graph of its layer: the cached one when the cache holds it (and it
    passes its check), else one exported for it under a temporary name and not kept. Only what is served is
    written: the fp32 graphs of an int8 server would be four times the disk of its int8 graphs (minilm-l6: 535 MB
    for six layers of both, of which int8 about 130), and rebuilding one costs seconds per layer."""
    log = log or (lambda message: print(message, file=sys.stderr))
    problem = cache.writing_problem()
    if problem is not None:
        kind = "int8 graph" if quantize else "graph"
        raise ExportError(
            f"the ONNX graph cache {cache.root} holds no usable {kind} of layer {layer} for the weights of "
            f"{encoder.name} (in {cache.folder.name}), and cannot be written ({problem}): pass --onnx-cache with a "
            "folder that can be written, where the graphs are built once"
        )
    fp32 = trusted(encoder, cache, layer, None, log) if quantize else None
    features, expected = reference(encoder, layer)
    graph = f"{'int8 ' if quantize else ''}layer {layer} of {encoder.name}"  # what an error names
    if quantize is None:  # exported straight into the cache: a temporary file beside, renamed when checked
        with outputs.writing(cache.path_of(layer, None)) as tmp:
            made = graph_metadata(export_exit(encoder, layer, tmp))
            moved = graph_check.batch_record(tmp, features, run_reference(tmp, features), graph)
        made = {"exporter": made["exporter"], "max_abs_difference_vs_torch": float(made["max_abs_difference_vs_torch"])}
        return cache.add(layer, None, made | moved)
    with outputs.writing(cache.path_of(layer, quantize)) as tmp:  # renamed into the cache once it is checked
        scratch = None
        try:
            if fp32 is None:  # the fp32 graph only as the input of quantization, under a temporary name, not kept
                scratch = tmp.with_name(f"{tmp.stem}.fp32.onnx")
                fp32 = export_exit(encoder, layer, scratch)
            built = quantize_int8(fp32, tmp)
        finally:
            if scratch is not None:
                outputs.remove_file(scratch)
        got = run_reference(built, features)
        agreement = {
            "max_abs_difference_vs_torch": float(np.abs(got - expected).max()),
            "min_cosine_vs_torch": float(cosines(got, expected).min()),
        }
        if not agreement["min_cosine_vs_torch"] >= INT8_MIN_COSINE:  # nothing is moved into the cache
            raise ExportError(
                f"int8 quantization of layer {layer} of {encoder.name} agrees with the model only to a lowest "
                f"cosine of {agreement['min_cosine_vs_torch']:.4f} on the check sentences (at least "
                f"{INT8_MIN_COSINE} is served): serve it in fp32 (no --quantize)"
            )
        agreement |= graph_check.batch_record(built, features, got, graph)
    return cache.add(layer, quantize, agreement)
