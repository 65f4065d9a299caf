"""Exit heads: one small learned map per exit layer l < N, from the pooled layer-l vector into the model's output
space (what the last layer gives). A cell (l, d) is then the first d numbers of head_l(pool_l(x)).

A head may read more than its own layer: with inputs="stack" the head of exit l reads the pooled vectors of the
embedding output and of every layer up to l, side by side ([pool_0, pool_1, ..., pool_l]). An exit at l runs those
layers anyway, so the input costs one pooling per layer; the head has (l + 1) x D inputs. The embedding layer and
the early layers keep lexical detail that the exit's own layer has already mixed away ("first-last average"
pooling of BERT-flow and WhiteningBERT rests on the same observation); in closed form on all-MiniLM-L6-v2 a
stacked head gains 0.6-1.3 STS points over a head on the exit's layer alone (docs/exit-heads.md).

A pooled shallow layer lives in another space than the last layer; a plain affine map recovers most of the gap.
Fitted in closed form (ridge regression onto the last layer's own vectors, no labels) on all-MiniLM-L6-v2, it
lifts the STS average at (3,128) from about 50 to about 71 (docs/exit-heads.md). The last layer has no head.

Saved in a model folder and loaded from it by matryoshka2d.models.heads_on_disk.

Fitting (`fit_heads`) streams: for each exit it accumulates the normal equations X'X and X'Y in float64 batch by
batch, so memory does not grow with the data; every tenth sentence is held out, and the ridge strength is the one of
a small grid with the lowest held-out squared error (computed from held-out X'X, X'Y, Y'Y, no second pass; or,
with select="similarity", the one whose heads best keep the last layer's cosine similarities between held-out
sentences); the final head is refitted on all sentences with that strength.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from matryoshka2d.models.backbones import BackboneError

HEADS_FILE = "exit_heads.safetensors"
RECORD_KEY = "exit_heads"  # in matryoshka2d.json
KINDS = ("affine", "mlp")
INPUTS = ("exit", "stack")  # what a head reads: the exit's pooled vector, or those of layers 0..exit side by side
TARGETS = ("normalized", "raw")  # the last layer's vector scaled to length 1, or as pooled
# Ridge strengths tried, as multiples of the number of training sentences (lambda = r x n; the issue's
# measurement used 0.01 x n). The bias is never penalised.
RIDGE_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
HELD_OUT_EVERY = 10  # every tenth sentence is held out to choose the ridge strength
# How the ridge strength is chosen on the held-out sentences: "similarity" keeps the strength whose heads best
# preserve the last layer's cosine similarities between held-out sentences (Pearson over random pairs, what STS
# and retrieval use); "mse" the lowest squared error to the target vectors. The similarity criterion needs the
# held-out vectors themselves, so it keeps a fixed-size sample of them (memory stays bounded). "sts-dev" keeps the
# strength with the best STS-B dev Spearman, averaged over DEV_WIDTHS (issue 18 allows STS-B dev and nothing else
# of STS; the held-out sentences' criteria only see how close a head gets to the last layer, not the task).
SELECTIONS = ("similarity", "mse", "sts-dev")
DEV_WIDTHS = (64, 128, 256, None)  # cell widths the sts-dev criterion averages over (None: the full width)
SIMILARITY_SAMPLE = 2000  # held-out sentences kept for the similarity criterion
SIMILARITY_PAIRS = 20000


class HeadsError(BackboneError):
    """Exit heads that cannot be fitted, loaded or used; the message says which file or option and why."""


class ExitHead(nn.Module):
    """An affine map y = W x + b; the MLP kind adds a residual y += V gelu(U x + c) (V starts at zero, so an
    MLP head starts as its affine part)."""

    def __init__(self, dim_in: int, dim_out: int, kind: str = "affine", hidden: int | None = None):
        super().__init__()
        if kind not in KINDS:
            raise HeadsError(f"exit head kind '{kind}' is not known; choose one of {', '.join(KINDS)}")
        self.kind = kind
        self.linear = nn.Linear(dim_in, dim_out)
        if kind == "mlp":
            hidden = hidden or dim_in
            self.up = nn.Linear(dim_in, hidden)
            self.down = nn.Linear(hidden, dim_out, bias=False)
            nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.kind == "mlp":
            y = y + self.down(nn.functional.gelu(self.up(x)))
        return y


class ExitHeads(nn.Module):
    """One ExitHead per exit layer; `forward(layer, pooled)` maps layer `layer`'s pooled vectors (a tensor), or,
    for heads that read several layers (inputs="stack"), the pooled vectors of the layers `reads(layer)` names
    (a mapping layer -> tensor)."""

    def __init__(
        self,
        layers: Iterable[int],
        dim_in: int,
        dim_out: int,
        kind: str = "affine",
        hidden: int | None = None,
        inputs: str = "exit",
    ):
        super().__init__()
        if inputs not in INPUTS:
            raise HeadsError(f"exit head inputs '{inputs}' are not known; choose one of {', '.join(INPUTS)}")
        self.layers = sorted({int(n) for n in layers})
        self.dim_in, self.dim_out, self.kind, self.inputs = dim_in, dim_out, kind, inputs
        self.hidden = (hidden or dim_in) if kind == "mlp" else None
        self.heads = nn.ModuleDict(
            {str(n): ExitHead(self.in_features(n), dim_out, kind, self.hidden) for n in self.layers}
        )
        self.record: dict = {}  # how the heads were made (fit options, data, held-out errors), saved with them

    @classmethod
    def identity(
        cls, layers: Iterable[int], dim_in: int, dim_out: int, kind: str = "affine", inputs: str = "exit"
    ) -> ExitHeads:
        """Heads that start as the identity on the exit's own pooled vector (the first dim_out numbers when the
        sizes differ; a stacked head starts with zero weight on the other layers)."""
        heads = cls(layers, dim_in, dim_out, kind, inputs=inputs)
        with torch.no_grad():
            for head in heads.heads.values():
                head.linear.weight.zero_()
                head.linear.weight[:, -dim_in:].copy_(torch.eye(dim_out, dim_in))  # the exit's own layer is last
                head.linear.bias.zero_()
        heads.record = {"init": "identity"}
        return heads

    def reads(self, layer: int) -> list[int]:
        """The layers whose pooled vectors the head of `layer` reads, in the order they are stacked."""
        return list(range(0, layer + 1)) if self.inputs == "stack" else [layer]

    def in_features(self, layer: int) -> int:
        return self.dim_in * len(self.reads(layer))

    def gather(self, layer: int, pooled):
        """The input of the head of `layer`: the layer's pooled vectors (a tensor or array), or the layers it reads
        side by side, taken from a mapping layer -> vectors (torch tensors or numpy arrays)."""
        if not isinstance(pooled, Mapping):
            if self.inputs == "exit":
                return pooled
            raise HeadsError(
                f"the exit head of layer {layer} reads the pooled vectors of layers {self.reads(layer)}; it was "
                "given those of one layer only"
            )
        parts = [pooled[n] for n in self.reads(layer)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=-1) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts, axis=-1)

    def has(self, layer: int) -> bool:
        return str(layer) in self.heads

    def forward(self, layer: int, pooled) -> torch.Tensor:
        head = self.heads[str(layer)]
        return head(self.gather(layer, pooled).to(head.linear.weight.dtype))

    def describe(self) -> str:
        reads = ", each reading layers 0..its exit" if self.inputs == "stack" else ""
        return (
            f"{self.kind} exit heads at layers {','.join(map(str, self.layers))} ({self.dim_in} -> {self.dim_out}"
            f"{reads})"
        )

    def bytes_per_cell(self, dim: int, layer: int | None = None) -> int:
        """float32 bytes one exported cell of width `dim` keeps of its head (the first dim output rows); for
        stacked heads, of the head of `layer` (default the deepest)."""
        dim_in = self.in_features(layer if layer is not None else max(self.layers, default=1))
        params = dim * dim_in + dim  # W[:dim], b[:dim]
        if self.kind == "mlp":
            params += self.hidden * dim_in + self.hidden + dim * self.hidden
        return 4 * params


# ---- closed-form fitting -----------------------------------------------------------------------------------


@dataclass
class NormalEquations:
    """X'X and X'Y of [x, 1] -> y, plus Y'Y, accumulated in float64 (for the held-out error too)."""

    xtx: np.ndarray
    xty: np.ndarray
    yty: float = 0.0
    rows: int = 0

    @classmethod
    def empty(cls, dim_in: int, dim_out: int) -> NormalEquations:
        return cls(np.zeros((dim_in + 1, dim_in + 1)), np.zeros((dim_in + 1, dim_out)))

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        x1 = np.concatenate([x.astype(np.float64), np.ones((len(x), 1))], axis=1)
        y = y.astype(np.float64)
        self.xtx += x1.T @ x1
        self.xty += x1.T @ y
        self.yty += float(np.einsum("ij,ij->", y, y))
        self.rows += len(x)

    def solve(self, strength: float) -> np.ndarray:
        """[W'; b'] of the ridge solution with penalty `strength` on W (not on the bias)."""
        penalty = np.full(self.xtx.shape[0], strength)
        penalty[-1] = 0.0
        return np.linalg.solve(self.xtx + np.diag(penalty), self.xty)

    def squared_error(self, solution: np.ndarray) -> float:
        """sum ||[x,1] A - y||^2 over the accumulated rows, from the sums alone."""
        return float(
            np.einsum("ij,ij->", solution, self.xtx @ solution)
            - 2 * np.einsum("ij,ij->", solution, self.xty)
            + self.yty
        )


@dataclass
class FitReport:
    sentences: int
    held_out: int
    target: str
    strengths: dict[int, float] = field(default_factory=dict)  # layer -> chosen lambda / n
    held_out_mse: dict[int, dict[float, float]] = field(default_factory=dict)  # layer -> {lambda/n: mse}
    held_out_similarity: dict[int, dict[float, float]] = field(default_factory=dict)  # layer -> {lambda/n: r}
    dev_spearman: dict[int, dict[float, float]] = field(default_factory=dict)  # layer -> {lambda/n: STS-B dev}
    seconds: float = 0.0


def fit_heads(
    encoder,
    batches: Iterable[Sequence[str]],
    target: str = "normalized",
    kind: str = "affine",
    layers: Sequence[int] | None = None,
    mlp_epochs: int = 20,
    seed: int = 0,
    select: str = "mse",
    ridge: float | None = None,
    dev=None,
    log: Callable[[str], None] | None = None,
    inputs: str = "exit",
    progress: Callable[[int], None] | None = None,
) -> tuple[ExitHeads, FitReport]:
    """Fit exit heads on batches of distinct texts, with no labels: each exit's pooled vector is regressed onto
    the last layer's output vector (scaled to length 1 for target="normalized"). One encoder pass per batch,
    every exit at once. The MLP kind starts from the closed-form affine fit and trains its residual with Adam on
    the pooled vectors, which it keeps in memory (its memory grows with the data, unlike the affine fit).

    The ridge strength (lambda / n) is `ridge` when given, else the grid's best by `select`; select="sts-dev"
    needs `dev`, a pair set with sentences1, sentences2 and gold scores (STS-B dev, evaluate.sts.load_pairs).
    `inputs`: what each head reads (INPUTS): its exit's pooled vector, or those of layers 0..exit ("stack").
    `progress`, when given, is told how many texts each forward pass encoded (a duplicate, encoded once, counts at
    the end of its batch), and `log` then gets no count of the sentences encoded so far."""
    import time

    if target not in TARGETS:
        raise HeadsError(f"--target {target}: choose one of {', '.join(TARGETS)}")
    if kind not in KINDS:
        raise HeadsError(f"--kind {kind}: choose one of {', '.join(KINDS)}")
    if inputs not in INPUTS:
        raise HeadsError(f"--inputs {inputs}: choose one of {', '.join(INPUTS)}")
    if select not in SELECTIONS:
        raise HeadsError(f"--select {select}: choose one of {', '.join(SELECTIONS)}")
    if ridge is not None and not (np.isfinite(ridge) and ridge > 0):
        raise HeadsError(f"--ridge {ridge}: the ridge strength (a multiple of the number of sentences) must be > 0")
    if select == "sts-dev" and ridge is None and dev is None:
        raise HeadsError("--select sts-dev needs the STS-B dev pairs (stsb_dev.tsv under the data folder)")
    top = encoder.num_layers
    if top < 2:
        raise HeadsError(f"{encoder.name} has one layer: there is no exit below the last layer to fit a head for")
    exits = sorted({int(n) for n in (layers or range(1, top))})
    if bad := [n for n in exits if not 1 <= n < top]:
        raise HeadsError(f"--layers {bad}: exit heads go on layers 1..{top - 1} (the last layer has none)")
    start = time.perf_counter()
    d_in, d_out = encoder.transformer_size, encoder.hidden_size
    with torch.random.fork_rng(devices=[]):  # the MLP kind's hidden layer starts the same for the same seed
        torch.manual_seed(seed)
        heads = ExitHeads(exits, d_in, d_out, kind, inputs=inputs)
    head_layers = sorted({r for n in exits for r in heads.reads(n)})  # what the heads read
    pooled_layers = sorted({*head_layers, top})
    fit = {n: NormalEquations.empty(heads.in_features(n), d_out) for n in exits}
    held = {n: NormalEquations.empty(heads.in_features(n), d_out) for n in exits}
    kept: dict[int, list[np.ndarray]] = {n: [] for n in pooled_layers}  # pooled rows, for the MLP kind
    sample: dict[int, list[np.ndarray]] = {n: [] for n in [*exits, top]}  # held-out head inputs for the criterion
    sampled, seen, passed = 0, 0, 0  # passed: the texts `progress` was told of

    def counted(n: int) -> None:
        nonlocal passed
        passed += n
        progress(n)

    for texts in batches:
        texts = list(texts)
        if not texts:
            continue
        raw = encoder.pooled_states(texts, pooled_layers, pooled=True, progress=progress and counted)  # no heads
        if progress is not None and passed < seen + len(texts):
            progress(seen + len(texts) - passed)
            passed = seen + len(texts)
        y = encoder.cells_from_pooled(raw, [top], heads=False)[top]  # the last layer's output vectors
        if target == "normalized":
            y = y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
        position = np.arange(seen, seen + len(texts))
        out = position % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        take = np.flatnonzero(out)[: max(0, SIMILARITY_SAMPLE - sampled)]
        for n in exits:
            x = heads.gather(n, raw)
            fit[n].add(x[~out], y[~out])
            held[n].add(x[out], y[out])
            sample[n].append(x[take])
        if kind == "mlp":
            for n in pooled_layers:
                kept[n].append(y if n == top else raw[n])
        sample[top].append(y[take])
        sampled += len(take)
        seen += len(texts)
        if log and progress is None:
            log(f"heads fit: {seen} sentences encoded")
    train_rows = fit[exits[0]].rows
    if seen == 0:
        raise HeadsError("heads fit: the data holds no sentences")
    widest = max(heads.in_features(n) for n in exits)
    if train_rows <= widest:
        raise HeadsError(
            f"heads fit: {seen} sentences, {train_rows} of them for fitting; a head of {encoder.name} has up to "
            f"{widest + 1} inputs, so fitting needs more sentences than that (give at least {2 * widest})"
        )
    report = FitReport(sentences=seen, held_out=held[exits[0]].rows, target=target)
    pairs = _pairs(sampled, seed)
    target_cos = _cosines(np.concatenate(sample[top]), pairs) if sampled else None
    dev_pooled = None
    if select == "sts-dev" and ridge is None:
        dev_raw = encoder.pooled_states(list(dev.sentences1) + list(dev.sentences2), head_layers, pooled=True)
        dev_pooled = {n: heads.gather(n, dev_raw) for n in exits}
    for n in exits:
        errors, similarity, on_dev = {}, {}, {}
        for ratio in RIDGE_GRID:
            solution = fit[n].solve(ratio * train_rows)
            errors[ratio] = held[n].squared_error(solution) / max(1, held[n].rows) if held[n].rows else 0.0
            if target_cos is not None:
                mapped = np.concatenate(sample[n]) @ solution[:-1] + solution[-1]
                similarity[ratio] = float(np.corrcoef(_cosines(mapped, pairs), target_cos)[0, 1])
            if dev_pooled is not None:
                on_dev[ratio] = _dev_spearman(dev_pooled[n] @ solution[:-1] + solution[-1], dev.gold)
        if ridge is not None:
            best = float(ridge)
        elif dev_pooled is not None:
            best = max(on_dev, key=on_dev.get)
        elif not held[n].rows:
            best = 1e-2
        elif select == "similarity" and similarity:
            best = max(similarity, key=similarity.get)
        else:
            best = min(errors, key=errors.get)
        report.held_out_mse[n], report.held_out_similarity[n], report.strengths[n] = errors, similarity, best
        report.dev_spearman[n] = on_dev
        everything = NormalEquations(fit[n].xtx + held[n].xtx, fit[n].xty + held[n].xty, fit[n].yty + held[n].yty)
        solution = everything.solve(best * (train_rows + held[n].rows))
        with torch.no_grad():
            head = heads.heads[str(n)]
            head.linear.weight.copy_(torch.from_numpy(solution[:-1].T.copy()).float())
            head.linear.bias.copy_(torch.from_numpy(solution[-1].copy()).float())
    if kind == "mlp":
        pooled = {n: np.concatenate(rows) for n, rows in kept.items()}
        _train_mlp_residuals(heads, pooled, pooled[top], mlp_epochs, seed)
    report.seconds = round(time.perf_counter() - start, 1)
    heads.record = {
        "init": "closed-form ridge" + (" + MLP residual (Adam)" if kind == "mlp" else ""),
        "target": f"last layer ({target})",
        "inputs": "pooled layers 0..exit, side by side" if inputs == "stack" else "the exit's pooled layer",
        "sentences": report.sentences,
        "held_out": report.held_out,
        "ridge_lambda_over_n": {str(n): v for n, v in report.strengths.items()},
        "ridge_chosen_by": "given (--ridge)"
        if ridge is not None
        else ("STS-B dev Spearman" if select == "sts-dev" else f"held-out {select}"),
    }
    return heads, report


def _dev_spearman(mapped: np.ndarray, gold: np.ndarray) -> float:
    """STS-B dev Spearman of cosine, averaged over the DEV_WIDTHS prefixes of the heads' output (mapped holds the
    first sentences of every pair, then the second ones)."""
    from scipy.stats import spearmanr

    half = len(mapped) // 2
    widths = sorted({min(w or mapped.shape[1], mapped.shape[1]) for w in DEV_WIDTHS})
    scores = []
    for width in widths:
        cut = mapped[:, :width]
        unit = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
        scores.append(spearmanr(gold, (unit[:half] * unit[half:]).sum(1)).statistic)
    return float(np.mean(scores))


def _pairs(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random distinct pairs (i, j) of `rows` held-out sentences, the same for every ridge strength."""
    rng = np.random.default_rng(seed)
    i, j = rng.integers(0, max(rows, 1), SIMILARITY_PAIRS), rng.integers(0, max(rows, 1), SIMILARITY_PAIRS)
    keep = i != j
    return i[keep], j[keep]


def _cosines(x: np.ndarray, pairs: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return (unit[pairs[0]] * unit[pairs[1]]).sum(1)


def _train_mlp_residuals(
    heads: ExitHeads, pooled: dict[int, np.ndarray], y: np.ndarray, epochs: int, seed: int
) -> None:
    """Train each MLP head's residual (its affine part too) with Adam on mean squared error, full data in memory.
    `pooled`: the pooled vectors of every layer the heads read (stacked inputs are made one head at a time)."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.from_numpy(y).float()
    for n in heads.layers:
        head = heads.heads[str(n)]
        inputs = torch.from_numpy(heads.gather(n, pooled)).float()
        optimizer = torch.optim.Adam(head.parameters(), lr=1e-3)
        for _ in range(epochs):
            for idx in torch.randperm(len(inputs), generator=generator).split(256):
                loss = nn.functional.mse_loss(head(inputs[idx]), target[idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
