"""ElasticEncoder: tokenize, run only the first n layers, pool, keep the first k numbers.

An exit at layer n really stops there: layers above n never run (matryoshka2d.models.exits: hooks on every layer,
and what a call asks for kept per thread, so one encoder serves different cells from several threads at once), and
one pass up to the deepest requested layer yields every cell of a (layer, dim) grid.

A model may carry a pooler head (a sentence-transformers Dense module, see matryoshka2d.models.pooler): it is applied
after pooling at every exit, and its output is the embedding. `hidden_size` is then the head's output size d
(the width of the embeddings every cell slices), while `transformer_size` stays the transformer's width D.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from matryoshka2d.cells import Cell, unit_rows
from matryoshka2d.models.backbones import (
    POOLING_MODES,
    BackboneError,
    architecture,
    count_parameters,
    default_device,
    final_norm,
    in_range,
    layer_stack,
    load_transformer,
    resolve,
)
from matryoshka2d.models.batching import check_texts, run_passes
from matryoshka2d.models.decoders import default_pooling, prepare_decoder
from matryoshka2d.models.exits import install_exit_hooks, run_to_exits
from matryoshka2d.models.identity import backbone_sha256
from matryoshka2d.models.pair_check import check_pair, check_pair_route, check_pair_routes
from matryoshka2d.models.pooler import PoolerHead, pool
from matryoshka2d.models.query_record import check_own_weights
from matryoshka2d.models.st_folder import (
    head_from_dense,
    model_folder,
    pair_route,
    read_sentence_config,
    router_routes,
)
from matryoshka2d.models.st_save import save_folder


class ElasticEncoder(nn.Module):
    """A sentence encoder whose every (layer, dim) cell can be used on its own.

    >>> enc = ElasticEncoder("minilm-l6")
    >>> enc.encode(["a cat sits", "a dog runs"], layer=2, dim=64).shape
    (2, 64)
    """

    def __init__(
        self,
        model: str = "minilm-l6",
        pooling: str | None = None,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        heads: bool = True,
        route: str | None = None,
    ):
        """`heads=False` leaves a folder's exit heads unloaded and unused (to compare both sides).

        A query/document pair (one folder with sentence-transformers' Router, `export --query-model` or
        `--query-cell`) loads as its document route, the model whose vectors an index holds, with the query route
        as `query_encoder`; `route="query"` loads the query route alone."""
        super().__init__()
        location, display = resolve(model)
        # the one reader of the folder (confined.ConfinedFolder), made before anything in it is opened: every name its
        # modules.json and router_config.json give stays inside it, and no link in it leaves it
        folder = model_folder(location)
        route, display, weights = pair_route(folder or location, display, route)
        if route is not None:  # a pair's routes against its record, before any weights load
            check_pair_routes(folder, router_routes(folder))
        transformer, tokenizer = load_transformer(weights, display)
        sentence_cfg = read_sentence_config(folder or location, route)
        self._setup(transformer, tokenizer, location, display, pooling, max_length, device, sentence_cfg)
        self.route = route
        self.__dict__["confined_folder"] = folder  # read again by the records' readers (models.identity)
        if route is not None:
            check_pair_route(self)  # this route's weights, layers and width are the ones exported
        if route == "document":  # kept out of this module's parameters: the weights checksum stays the route's own
            query = ElasticEncoder(model, max_length=max_length, device=device, route="query")
            object.__setattr__(self, "query_encoder", query)
            check_pair(self, query)  # the query side's record against the document side
        from matryoshka2d.models.heads_on_disk import load_heads, read_record

        record = read_record(folder or location) if route is None else None  # a pair's routes hold no exit heads
        self.folder_has_heads = record is not None  # whether or not they were loaded (--no-heads says which)
        if heads and record is not None:
            self.set_exit_heads(load_heads(folder or location, record, self))
        from matryoshka2d.models import static

        if (cell := static.read_record(folder or location)) is not None:  # layer 0 (models.static)
            self.set_static_cell(
                static.load_static_cell(folder or location, cell, backbone_sha256(self), self.hidden_size)
            )

        check_own_weights(self)  # a query encoder's record vouches for these weights and this width

    @classmethod
    def from_modules(
        cls,
        transformer: nn.Module,
        tokenizer,
        pooling: str = "mean",
        max_length: int | None = None,
        name: str = "in-memory model",
        device: str | torch.device | None = None,
    ) -> ElasticEncoder:
        """Wrap an already built transformer (tiny test models, or a model being trained)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(transformer, tokenizer, None, name, pooling, max_length, device, None)
        return self

    def _setup(self, transformer, tokenizer, location, display, pooling, max_length, device, sentence_cfg):
        chosen = pooling or (sentence_cfg.pooling if sentence_cfg else None) or default_pooling(transformer)
        prepare_decoder(transformer)  # attention follows config.is_causal (--bidirectional), no KV cache
        if chosen is None:
            raise BackboneError(
                f"{display} has no sentence-transformers pooling config; pass pooling= one of "
                f"{', '.join(POOLING_MODES)}"
            )
        if chosen not in POOLING_MODES:
            raise BackboneError(f"Unknown pooling '{chosen}'; choose one of {', '.join(POOLING_MODES)}")
        self.model = transformer
        self.tokenizer = tokenizer
        self.name = display
        self.location = location
        self.pooling = chosen
        install_exit_hooks(transformer)  # also fails early, naming the architecture, if it is not in the table
        self._final_norm = final_norm(transformer)
        limit = getattr(transformer.config, "max_position_embeddings", 512) or 512
        limit -= architecture(transformer).position_offset
        configured = max_length or (sentence_cfg.max_length if sentence_cfg else None)
        self.max_length = min(configured or tokenizer.model_max_length, limit, 8192)
        # Feed only what the model's forward takes (DistilBERT and decoders have no token_type_ids).
        accepted = inspect.signature(transformer.forward).parameters
        self._input_names = [n for n in tokenizer.model_input_names if n in accepted]
        self.head: PoolerHead | None = None
        if sentence_cfg is not None and sentence_cfg.dense is not None:
            self.head = head_from_dense(sentence_cfg.dense, sentence_cfg.pooler_dir, self.transformer_size)
        # The folder's Normalize module: unit-length vectors after slicing to a cell's dim. encode() keeps its
        # explicit normalize= argument; save() and export write the module again, after any truncation.
        self.normalize_output = bool(sentence_cfg.normalize) if sentence_cfg is not None else False
        self.exit_heads = None  # ExitHeads (matryoshka2d.models.heads), set by set_exit_heads
        self.use_heads = True  # apply the exit heads, when there are any, unless a call says otherwise
        self.folder_has_heads = False
        self.route = None  # "document" or "query" for a route of a query/document pair folder
        object.__setattr__(self, "query_encoder", None)  # a pair's query route (not a submodule: see __init__)
        self.static_cell = None  # StaticCell (matryoshka2d.models.static): layer 0, set by set_static_cell
        self.to(torch.device(device) if device is not None else default_device())
        self.model.eval()

    # ---- shape ---------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(layer_stack(self.model))

    @property
    def transformer_size(self) -> int:
        """The transformer's hidden width D (what pooling produces, before any pooler head)."""
        return int(self.model.config.hidden_size)

    @property
    def hidden_size(self) -> int:
        """The width of the sentence embeddings: the pooler head's output size if there is one, else D."""
        return self.head.out_features if self.head is not None else self.transformer_size

    def set_pooler(self, head: PoolerHead | None) -> PoolerHead | None:
        """Put a pooler head on (or take it off with None); returns the head that was there before."""
        if head is not None and head.in_features != self.transformer_size:
            raise BackboneError(
                f"a pooler taking {head.in_features} numbers does not fit {self.name}, whose pooled vectors have "
                f"{self.transformer_size}"
            )
        previous = self.head
        self.head = head.to(self.device) if head is not None else None
        return previous

    def set_exit_heads(self, heads) -> None:
        """Put exit heads on (None takes them off); they must map this model's pooled vectors to its output."""
        if heads is not None:
            if heads.dim_in != self.transformer_size or heads.dim_out != self.hidden_size:
                raise BackboneError(
                    f"exit heads mapping {heads.dim_in} -> {heads.dim_out} do not fit {self.name} (pooled vectors "
                    f"of {self.transformer_size}, output {self.hidden_size})"
                )
            if bad := [n for n in heads.layers if not 1 <= n < self.num_layers]:
                raise BackboneError(f"exit heads at layers {bad}: {self.name} has exits 1..{self.num_layers - 1}")
            heads = heads.to(self.device)
        self.exit_heads = heads

    def set_static_cell(self, cell) -> None:
        """Put a static cell on as layer 0 (None takes it off); it must output this model's vectors. A cell that does
        not say which backbone it was aligned to (one just made) is aligned to this model's weights as they are now:
        a save after they change drops it (st_save.save_folder)."""
        if cell is not None:
            if cell.dim_out != self.hidden_size:
                raise BackboneError(
                    f"a static cell giving {cell.dim_out} numbers does not fit {self.name}, whose vectors have "
                    f"{self.hidden_size}"
                )
            if getattr(cell, "aligned_to", None) is None:
                cell.aligned_to = backbone_sha256(self)
            cell = cell.to(self.device)
        self.static_cell = cell

    @property
    def layers(self) -> list[int]:
        """Every cell layer of the model: 0 when it holds a static cell, then 1..num_layers."""
        return ([0] if self.static_cell is not None else []) + list(range(1, self.num_layers + 1))

    def add_pooler(self, dim: int, seed: int = 0) -> PoolerHead:
        """A fresh D -> dim tanh head (BERT's pooler initialisation), put on the encoder and returned."""
        head = PoolerHead.fresh(self.transformer_size, dim, seed=seed)
        self.set_pooler(head)
        return self.head

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def info(self) -> dict:
        return {
            "model": self.name,
            "location": self.location,
            "architecture": self.model.config.model_type,
            "layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "transformer_size": self.transformer_size,
            "pooler": self.head.describe() if self.head is not None else None,
            "exit_heads": self.exit_heads.describe() if self.exit_heads is not None else None,
            "static_cell": self.static_cell.describe() if self.static_cell is not None else None,
            "pooling": self.pooling,
            "normalize": self.normalize_output,
            "max_length": self.max_length,
            "parameters": count_parameters(self),  # the transformer and the pooler head
        }

    def check_layer(self, layer: int | None) -> int:
        """An exit 1..num_layers (None: the last layer), or 0 when the model holds a static cell."""
        if layer is None:
            return self.num_layers
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) and layer == 0:
            if self.static_cell is None:
                from matryoshka2d.models.static import no_static_cell

                raise no_static_cell(self.name)
            return 0
        return in_range(layer, "layer", self.num_layers, f"{self.name}: it has {self.num_layers} layers")

    def check_dim(self, dim: int | None) -> int:
        """A width 1..hidden_size (None: all of it)."""
        if dim is None:
            return self.hidden_size
        return in_range(dim, "dim", self.hidden_size, f"{self.name}: its embeddings have {self.hidden_size} numbers")

    # ---- the differentiable core: one pass, pooled states of the requested layers ----------------------

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Pad a batch of texts to tensors on the encoder's device."""
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return {k: v.to(self.device) for k, v in batch.items() if k in self._input_names}

    def forward(
        self, features: dict[str, torch.Tensor], layers: Iterable[int], heads: bool | None = None, pooled: bool = False
    ) -> dict[int, torch.Tensor]:
        """Sentence vectors (B, hidden_size) after each requested layer, as `cell_vector` makes them (`heads`:
        None follows the encoder's `use_heads`); `pooled=True` gives the pooled vectors before any head
        (B, transformer_size). Runs max(layers) layers only."""
        mask = features["attention_mask"]
        use = self.use_heads if heads is None else heads
        layers = {int(n) for n in layers}
        reads = set(self.pooled_inputs(layers, use)) if not pooled else layers
        vectors = {n: pool(hidden, mask, self.pooling) for n, hidden in self.token_states(features, reads).items()}
        # token_states keys its output by the checked layer numbers, in order
        return {n: vectors[n] if pooled else self.cell_vector(n, vectors, use) for n in vectors if n in layers}

    def pooled_inputs(self, layers: Iterable[int], heads: bool | None = None) -> list[int]:
        """The layers whose pooled vectors the cells of `layers` are made from: the layers themselves, and the
        layers their exit heads also read (heads that read layers 0..exit, matryoshka2d.models.heads)."""
        use = self.use_heads if heads is None else heads
        out = {int(n) for n in layers}
        if use and self.exit_heads is not None:
            out |= {r for n in list(out) if self.exit_heads.has(n) for r in self.exit_heads.reads(n)}
        return sorted(out)

    def cell_vector(
        self, layer: int, pooled: torch.Tensor | Mapping[int, torch.Tensor], heads: bool = True
    ) -> torch.Tensor:
        """The one place a cell's vector is made from pooled layers: through the exit head of that layer when
        heads are on and the model has one (matryoshka2d.models.heads), else through the pooler head if the
        model has one. A cell (layer, dim) is the first dim numbers of this. `pooled`: the layer's pooled vectors,
        or a mapping layer -> pooled vectors holding at least `pooled_inputs([layer])` (heads that read several
        layers need it)."""
        if heads and self.exit_heads is not None and self.exit_heads.has(layer):
            return self.exit_heads(layer, pooled)
        own = pooled[layer] if isinstance(pooled, Mapping) else pooled
        return self.head(own) if self.head is not None else own

    def cells_from_pooled(
        self, pooled: Mapping[int, np.ndarray], layers: Iterable[int], heads: bool = True
    ) -> dict[int, np.ndarray]:
        """Full-width cell vectors of `layers` from the pooled vectors of `pooled_states(..., pooled=True)` (which
        must hold `pooled_inputs(layers, heads)`), as numpy float32."""
        device = self.device
        tensors = {n: torch.from_numpy(np.ascontiguousarray(v)).to(device) for n, v in pooled.items()}
        with torch.inference_mode():
            return {n: self.cell_vector(n, tensors, heads).float().cpu().numpy() for n in layers}

    def token_states(self, features: dict[str, torch.Tensor], layers: Iterable[int]) -> dict[int, torch.Tensor]:
        """Token states (B, T, D) after each requested layer (the final norm applied, for decoders); runs
        max(layers) layers only."""
        layers = {int(n) for n in layers}
        # Layer 0 is the embedding output (the input of the first layer): the shallowest exit of angle-emb's ESE,
        # which counts hidden_states[0]; no public cell uses it, so only training code asks for it.
        wanted = sorted({self.check_layer(n) for n in layers - {0}} | (layers & {0}))
        if not wanted:
            raise BackboneError("forward() needs at least one layer")
        stack = layer_stack(self.model)
        if self.__dict__.get("_hooked_stack") != id(stack):  # a stack replaced after loading (LoRA, tests)
            install_exit_hooks(self.model)
            self.__dict__["_hooked_stack"] = id(stack)
        captured = run_to_exits(self.model, stack, wanted, features)
        out = {}
        for n in wanted:
            hidden = captured[n]
            if self._final_norm is not None:
                hidden = self._final_norm(hidden)
            out[n] = hidden
        return out

    # ---- saving: a sentence-transformers folder (st_save.save_folder says what is in it) ------------------

    save = save_folder

    # ---- inference ------------------------------------------------------------------------------------

    def encode(
        self,
        texts: str | Sequence[str],
        layer: int | None = None,
        dim: int | None = None,
        batch_size: int = 64,
        normalize: bool = False,
        show_progress: bool = False,
        heads: bool | None = None,
    ) -> np.ndarray:
        """Embed texts at one cell: float32 array (len(texts), dim); a single string gives a vector. `heads`: use
        the exit heads (None: the encoder's `use_heads`)."""
        layer, dim = self.check_layer(layer), self.check_dim(dim)
        single = isinstance(texts, str)
        grid = self.encode_grid(
            [texts] if single else texts, [layer], [dim], batch_size, normalize, show_progress, heads=heads
        )
        out = grid[(layer, dim)]
        return out[0] if single else out

    def encode_grid(
        self,
        texts: Sequence[str],
        layers: Iterable[int] | None = None,
        dims: Iterable[int] | None = None,
        batch_size: int = 64,
        normalize: bool = False,
        show_progress: bool = False,
        heads: bool | None = None,
    ) -> dict[Cell, np.ndarray]:
        """Every requested (layer, dim) cell from one forward pass per batch, keyed by (layer, dim)."""
        layers = sorted({self.check_layer(n) for n in (layers or [self.num_layers])})
        dims = sorted({self.check_dim(d) for d in (dims or [self.hidden_size])})
        pooled = self.pooled_states(texts, layers, batch_size, show_progress, heads=heads)
        grid = {}
        for n in layers:
            for d in dims:
                cell = pooled[n][:, :d]
                if normalize:
                    cell = unit_rows(cell)
                grid[Cell(n, d)] = np.ascontiguousarray(cell, dtype=np.float32)
        return grid

    def pooled_states(
        self,
        texts: Sequence[str],
        layers: Iterable[int],
        batch_size: int = 64,
        show_progress: bool = False,
        heads: bool | None = None,
        pooled: bool = False,
        token_budget: int | None = None,
        encoded=None,
        progress: Callable[[int], None] | None = None,
    ) -> dict[int, np.ndarray]:
        """Full-width sentence vectors per layer as `forward` makes them, (len(texts), hidden_size) each (with
        `pooled=True`, the pooled vectors before any head, transformer_size wide); duplicates are encoded once.
        `token_budget` caps the padded positions of one forward pass (texts x their longest), so long texts go
        fewer at a time and a pass's activations stay bounded whatever the input. `encoded`: these texts already
        tokenized (the tokenizer's unpadded output, a list of ids per text and input, none longer than
        max_length), so a caller that tokenized them (the server counts tokens) does not pay for it twice.
        `progress`, when given, is called with the number of texts of each forward pass once it is done."""
        texts = check_texts(texts)
        # pooled vectors may include layer 0 (the embedding output), which exit heads reading layers 0..l need;
        # otherwise layer 0 is the static cell, which reads the texts themselves (its own tokenizer)
        layers = sorted({0 if pooled and n == 0 else self.check_layer(n) for n in layers})
        static = not pooled and 0 in layers
        if static:
            layers.remove(0)
            if not layers:  # the static cell alone: a table lookup per text, no de-duplication to gain from
                vectors = self.static_cell.encode(texts)
                if progress is not None:
                    progress(len(texts))
                return {0: vectors}
        if batch_size < 1:
            raise BackboneError(f"batch_size must be at least 1, got {batch_size}")
        unique: dict[str, int] = {}
        inverse = np.fromiter((unique.setdefault(t, len(unique)) for t in texts), dtype=np.int64, count=len(texts))
        width = self.transformer_size if pooled else self.hidden_size
        out = {n: np.zeros((len(unique), width), dtype=np.float32) for n in layers}
        if encoded is not None and len(encoded["input_ids"]) != len(texts):
            raise BackboneError(f"encoded holds {len(encoded['input_ids'])} rows for {len(texts)} texts")
        if static:
            out[0] = self.static_cell.encode(list(unique))
        if unique:
            if encoded is None:
                encoded = self.tokenizer(list(unique), truncation=True, max_length=self.max_length)
            elif len(unique) < len(texts):  # the rows of each text's first occurrence
                first = np.unique(inverse, return_index=True)[1]
                encoded = {k: [rows[i] for i in first] for k, rows in encoded.items()}
            run_passes(self, encoded, layers, out, batch_size, heads, pooled, token_budget, show_progress, progress)
        if len(unique) == len(texts):  # no duplicates: rows are already in the texts' order
            return out
        return {n: arr[inverse] for n, arr in out.items()}
