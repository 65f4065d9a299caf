"""Exit heads: which choices matter (issue 18), measured side by side on one encoding of the same sentences.

Every variant is fitted on the same pooled vectors of the same fit sentences (NLI triplet sentences by default)
and scored on the same STS 7-set average (Spearman x 100 of cosine, SentEval "all" per set), at a few cells:
- no head (the pooled layer, sliced);
- affine per exit, target the last layer's vector scaled to length 1 (the default of `heads fit`);
- affine per exit, target the raw last-layer vector;
- affine per (exit, width): for cell (l, d) a head fitted onto the first d numbers of the last layer's vector,
  scaled to length 1 (the last layer's own cell (N, d));
- MLP per exit: the default affine head plus a residual MLP trained with Adam (as `heads fit --kind mlp`);
- affine, stacked: a head reading the pooled vectors of the embedding output and of every layer up to its exit,
  side by side (as `heads fit --inputs stack`).
Ridge strengths are chosen by squared error on a held-out tenth (`heads fit --select mse`), or fixed at
`--ridge R` x n for every variant (the issue's own measurement used 0.01). Then the cost of a head: time next to the
layers it saves, and bytes per exported cell.

    python benchmarks/exit_heads_choices.py [--sentences 10000] [--cells 1:64 3:128 5:384]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from common import DEFAULT_DATA, header
from matryoshka2d.evaluate.sts import STS_SETS, load_pairs, spearman_x100, sts_file
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.models.heads_fit import HELD_OUT_EVERY, RIDGE_GRID, NormalEquations, _train_mlp_residuals
from matryoshka2d.training.data import read_sentences


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def ridge(x: np.ndarray, y: np.ndarray, fixed: float | None = None) -> np.ndarray:
    """[W'; b'] with the strength of RIDGE_GRID that has the lowest held-out error (or `fixed` x n), refitted on
    all rows."""
    best = fixed
    if best is None:
        out = np.arange(len(x)) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        fit, held = NormalEquations.empty(x.shape[1], y.shape[1]), NormalEquations.empty(x.shape[1], y.shape[1])
        fit.add(x[~out], y[~out])
        held.add(x[out], y[out])
        best = min(RIDGE_GRID, key=lambda r: held.squared_error(fit.solve(r * fit.rows)))
    everything = NormalEquations.empty(x.shape[1], y.shape[1])
    everything.add(x, y)
    return everything.solve(best * len(x))


def apply(solution: np.ndarray, x: np.ndarray) -> np.ndarray:
    return x @ solution[:-1] + solution[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--data", default=str(DEFAULT_DATA / "nli" / "train_triplets.tsv"))
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--sentences", type=int, default=10000, help="distinct fit sentences")
    parser.add_argument("--cells", nargs="+", default=["1:64", "3:128", "5:384"])
    parser.add_argument("--mlp-epochs", type=int, default=10)
    parser.add_argument("--ridge", type=float, default=None, help="fixed ridge strength x n (default: held-out mse)")
    parser.add_argument("--cost-only", action="store_true", help="only the cost of a head in time and bytes")
    args = parser.parse_args()
    print(header())
    cells = [tuple(int(v) for v in c.split(":")) for c in args.cells]
    encoder = ElasticEncoder(args.model, device="cpu")
    top = encoder.num_layers
    layers = sorted(set(range(0, max(n for n, _ in cells) + 1)) | {top})  # 0: the embedding output (stacked heads)
    if args.cost_only:
        head_cost(encoder, read_sentences(args.data)[:64], cells)
        return
    fit_texts = read_sentences(args.data)[: args.sentences]
    start = time.perf_counter()
    fit_x = encoder.pooled_states(fit_texts, layers, pooled=True)
    print(f"encoded {len(fit_texts)} fit sentences at layers {layers} in {time.perf_counter() - start:.0f} s")
    sets = {name: load_pairs(sts_file(Path(args.data_dir), "raw", name), name) for name in STS_SETS}
    texts = list(dict.fromkeys(t for p in sets.values() for t in p.sentences1 + p.sentences2))
    row = {t: i for i, t in enumerate(texts)}
    sts_x = encoder.pooled_states(texts, layers, pooled=True)
    target_raw = fit_x[top]  # minilm has no pooler head: the last layer's pooled vector is its output

    def score(vectors: np.ndarray, dim: int) -> float:
        v = unit(vectors[:, :dim])
        per_set = []
        for pairs in sets.values():
            a = v[[row[t] for t in pairs.sentences1]]
            b = v[[row[t] for t in pairs.sentences2]]
            per_set.append(spearman_x100(pairs.gold, (a * b).sum(1)))
        return float(np.mean(per_set))

    variants: dict[str, dict] = {
        name: {}
        for name in (
            "no head",
            "affine, normalized target (default)",
            "affine, raw target",
            "affine per (exit, width)",
            "MLP",
            "affine, stacked layers 0..exit",
        )
    }
    for n, d in cells:
        if n == top:
            for name in variants:
                variants[name][(n, d)] = score(sts_x[top], d)
            continue
        variants["no head"][(n, d)] = score(sts_x[n], d)
        normalized = ridge(fit_x[n], unit(target_raw), args.ridge)
        variants["affine, normalized target (default)"][(n, d)] = score(apply(normalized, sts_x[n]), d)
        variants["affine, raw target"][(n, d)] = score(apply(ridge(fit_x[n], target_raw, args.ridge), sts_x[n]), d)
        variants["affine per (exit, width)"][(n, d)] = score(
            apply(ridge(fit_x[n], unit(target_raw[:, :d]), args.ridge), sts_x[n]), d
        )
        heads = ExitHeads([n], fit_x[n].shape[1], target_raw.shape[1], kind="mlp")
        with torch.no_grad():
            heads.heads[str(n)].linear.weight.copy_(torch.from_numpy(normalized[:-1].T.copy()).float())
            heads.heads[str(n)].linear.bias.copy_(torch.from_numpy(normalized[-1].copy()).float())
        _train_mlp_residuals(heads, {n: fit_x[n]}, unit(target_raw), args.mlp_epochs, seed=0)
        with torch.no_grad():
            mlp = heads(n, torch.from_numpy(sts_x[n])).numpy()
        variants["MLP"][(n, d)] = score(mlp, d)
        stacked_fit = np.concatenate([fit_x[k] for k in range(0, n + 1)], axis=1)
        stacked_sts = np.concatenate([sts_x[k] for k in range(0, n + 1)], axis=1)
        variants["affine, stacked layers 0..exit"][(n, d)] = score(
            apply(ridge(stacked_fit, unit(target_raw), args.ridge), stacked_sts), d
        )
    strength = f"ridge {args.ridge} x n" if args.ridge is not None else "ridge chosen by held-out squared error"
    print(f"\nSTS 7-set average, Spearman x 100 of cosine; {len(fit_texts)} fit sentences of {args.data}; {strength}")
    print("| variant | " + " | ".join(f"({n},{d})" for n, d in cells) + " |")
    print("|---|" + "---:|" * len(cells))
    for name, values in variants.items():
        print(f"| {name} | " + " | ".join(f"{values[c]:.2f}" for c in cells) + " |")

    head_cost(encoder, texts[:64], cells)


def head_cost(encoder, texts: list[str], cells) -> None:
    """A head's matrix product next to the model's layers, per text at batch 64; and its bytes per exported cell."""
    top, width = encoder.num_layers, encoder.hidden_size
    batch = encoder.tokenize(texts)
    with torch.inference_mode():
        for n in (1, top):
            encoder(batch, [n])
        timings = {}
        for n in (1, top):
            t0 = time.perf_counter()
            for _ in range(10):
                encoder(batch, [n])
            timings[n] = (time.perf_counter() - t0) / 10 / len(texts) * 1000
        x = encoder(batch, [1], pooled=True)[1]
        head_ms = {}
        for inputs in (1, top):  # a head on its exit's layer; a stacked head on the deepest exit (layers 0..N-1)
            head, stacked = torch.nn.Linear(inputs * x.shape[1], width), x.repeat(1, inputs)
            t0 = time.perf_counter()
            for _ in range(200):
                head(stacked)
            head_ms[inputs] = (time.perf_counter() - t0) / 200 / len(texts) * 1000
    layer_ms = (timings[top] - timings[1]) / (top - 1)
    print(
        f"\ncost per text at batch {len(texts)}: exit at layer 1 {timings[1]:.3f} ms, all {top} layers "
        f"{timings[top]:.3f} ms (one layer about {layer_ms:.3f} ms); one {x.shape[1]} x {width} head "
        f"{head_ms[1]:.4f} ms ({100 * head_ms[1] / layer_ms:.2f}% of a layer); a stacked head at exit {top - 1} "
        f"({top * x.shape[1]} x {width}) {head_ms[top]:.4f} ms ({100 * head_ms[top] / layer_ms:.2f}% of a layer)"
    )
    for n, d in cells:
        if n < top:
            print(
                f"exported cell ({n},{d}): its head is a Dense module of {d} x {x.shape[1]} weights + {d} biases, "
                f"float32: {4 * d * (x.shape[1] + 1) / 1024:.1f} KiB"
            )


if __name__ == "__main__":
    main()
