"""Fitting exit heads (models.heads) in closed form, with no labels: each exit's pooled vector is regressed onto the
last layer's own output vector.

Fitting (`fit_heads`) streams: for each exit it accumulates the normal equations X'X and X'Y in float64 batch by
batch, so memory does not grow with the data; every tenth sentence is held out, and the ridge strength is the one of
a small grid with the lowest held-out squared error (computed from held-out X'X, X'Y, Y'Y, no second pass; or,
with select="similarity", the one whose heads best keep the last layer's cosine similarities between held-out
sentences); the final head is refitted on all sentences with that strength.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from matryoshka2d.models.heads import INPUTS, KINDS, ExitHeads, HeadsError

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

    _check_fit_options(target, kind, inputs, select, ridge, dev)
    exits = _exit_layers(encoder, layers)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # the MLP kind's hidden layer starts the same for the same seed
        torch.manual_seed(seed)
        heads = ExitHeads(exits, encoder.transformer_size, encoder.hidden_size, kind, inputs=inputs)
    sums = _sum_batches(encoder, heads, batches, target, kind == "mlp", log, progress)
    report = FitReport(sentences=sums.seen, held_out=sums.held[exits[0]].rows, target=target)
    dev_pooled = None
    if select == "sts-dev" and ridge is None:
        dev_raw = encoder.pooled_states(list(dev.sentences1) + list(dev.sentences2), sums.head_layers, pooled=True)
        dev_pooled = {n: heads.gather(n, dev_raw) for n in exits}
    pairs = _pairs(sums.sampled, seed)
    target_cos = _cosines(np.concatenate(sums.sample[encoder.num_layers]), pairs) if sums.sampled else None
    for n in exits:
        on_dev = (dev_pooled[n], dev.gold) if dev_pooled is not None else None
        best = _choose_strength(n, sums, report, select, pairs, target_cos, on_dev)
        strength = float(ridge) if ridge is not None else best
        report.strengths[n] = strength
        # the chosen strength, fitted again on every sentence (the held-out ones too)
        fit, held = sums.fit[n], sums.held[n]
        everything = NormalEquations(fit.xtx + held.xtx, fit.xty + held.xty, fit.yty + held.yty)
        solution = everything.solve(strength * (fit.rows + held.rows))
        with torch.no_grad():
            head = heads.heads[str(n)]
            head.linear.weight.copy_(torch.from_numpy(solution[:-1].T.copy()).float())
            head.linear.bias.copy_(torch.from_numpy(solution[-1].copy()).float())
    if kind == "mlp":
        pooled = {n: np.concatenate(rows) for n, rows in sums.kept.items()}
        _train_mlp_residuals(heads, pooled, pooled[encoder.num_layers], mlp_epochs, seed)
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


def _check_fit_options(target: str, kind: str, inputs: str, select: str, ridge: float | None, dev) -> None:
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


def _exit_layers(encoder, layers: Sequence[int] | None) -> list[int]:
    """The exits heads are fitted for: `layers`, else every exit below the last layer."""
    top = encoder.num_layers
    if top < 2:
        raise HeadsError(f"{encoder.name} has one layer: there is no exit below the last layer to fit a head for")
    exits = sorted({int(n) for n in (layers or range(1, top))})
    if bad := [n for n in exits if not 1 <= n < top]:
        raise HeadsError(f"--layers {bad}: exit heads go on layers 1..{top - 1} (the last layer has none)")
    return exits


@dataclass
class _Sums:
    """What one pass over the texts leaves, per exit: the normal equations of the fitting sentences and of the
    held-out ones (every HELD_OUT_EVERY-th), up to SIMILARITY_SAMPLE held-out head inputs for the similarity
    criterion (the last layer's targets of the same sentences under its own number), and, for the MLP kind, every
    pooled row of the layers the heads read and the targets."""

    head_layers: list[int]  # what the heads read
    fit: dict[int, NormalEquations]
    held: dict[int, NormalEquations]
    sample: dict[int, list[np.ndarray]]
    kept: dict[int, list[np.ndarray]]
    seen: int = 0
    sampled: int = 0


def _sum_batches(encoder, heads: ExitHeads, batches, target: str, keep: bool, log, progress) -> _Sums:
    """One encoder pass per batch (no heads), every exit and the last layer at once, summed into _Sums; too few
    sentences to fit a head of the widest input is an error naming the number."""
    top, exits, d_out = encoder.num_layers, heads.layers, encoder.hidden_size
    head_layers = sorted({r for n in exits for r in heads.reads(n)})
    pooled_layers = sorted({*head_layers, top})
    sums = _Sums(
        head_layers,
        fit={n: NormalEquations.empty(heads.in_features(n), d_out) for n in exits},
        held={n: NormalEquations.empty(heads.in_features(n), d_out) for n in exits},
        sample={n: [] for n in [*exits, top]},
        kept={n: [] for n in pooled_layers},
    )
    passed = 0  # the texts `progress` was told of

    def counted(n: int) -> None:
        nonlocal passed
        passed += n
        progress(n)

    for texts in batches:
        texts = list(texts)
        if not texts:
            continue
        raw = encoder.pooled_states(texts, pooled_layers, pooled=True, progress=progress and counted)  # no heads
        if progress is not None and passed < sums.seen + len(texts):
            progress(sums.seen + len(texts) - passed)
            passed = sums.seen + len(texts)
        y = encoder.cells_from_pooled(raw, [top], heads=False)[top]  # the last layer's output vectors
        if target == "normalized":
            y = y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
        position = np.arange(sums.seen, sums.seen + len(texts))
        out = position % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        take = np.flatnonzero(out)[: max(0, SIMILARITY_SAMPLE - sums.sampled)]
        for n in exits:
            x = heads.gather(n, raw)
            sums.fit[n].add(x[~out], y[~out])
            sums.held[n].add(x[out], y[out])
            sums.sample[n].append(x[take])
        if keep:
            for n in pooled_layers:
                sums.kept[n].append(y if n == top else raw[n])
        sums.sample[top].append(y[take])
        sums.sampled += len(take)
        sums.seen += len(texts)
        if log and progress is None:
            log(f"heads fit: {sums.seen} sentences encoded")
    train_rows = sums.fit[exits[0]].rows
    if sums.seen == 0:
        raise HeadsError("heads fit: the data holds no sentences")
    widest = max(heads.in_features(n) for n in exits)
    if train_rows <= widest:
        raise HeadsError(
            f"heads fit: {sums.seen} sentences, {train_rows} of them for fitting; a head of {encoder.name} has up to "
            f"{widest + 1} inputs, so fitting needs more sentences than that (give at least {2 * widest})"
        )
    return sums


def _choose_strength(n: int, sums: _Sums, report: FitReport, select: str, pairs, target_cos, dev) -> float:
    """The ridge strength of exit `n` the grid's criteria choose: STS-B dev Spearman when `dev` (the head inputs
    of the dev pairs, their gold scores) is given, else the held-out criterion (similarity or mse). Each
    criterion's value per strength goes to `report`."""
    fit, held = sums.fit[n], sums.held[n]
    errors, similarity, on_dev = {}, {}, {}
    for ratio in RIDGE_GRID:
        solution = fit.solve(ratio * fit.rows)
        errors[ratio] = held.squared_error(solution) / max(1, held.rows) if held.rows else 0.0
        if target_cos is not None:
            mapped = np.concatenate(sums.sample[n]) @ solution[:-1] + solution[-1]
            similarity[ratio] = float(np.corrcoef(_cosines(mapped, pairs), target_cos)[0, 1])
        if dev is not None:
            on_dev[ratio] = _dev_spearman(dev[0] @ solution[:-1] + solution[-1], dev[1])
    report.held_out_mse[n], report.held_out_similarity[n], report.dev_spearman[n] = errors, similarity, on_dev
    if on_dev:
        return max(on_dev, key=on_dev.get)
    if not held.rows:
        return 1e-2
    if select == "similarity" and similarity:
        return max(similarity, key=similarity.get)
    return min(errors, key=errors.get)


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
