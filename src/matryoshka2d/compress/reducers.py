"""Post-hoc dimension reduction baselines: PCA, Isomap and LLE fitted on a corpus, applied to any cell.

Wang et al., "On the Dimensionality of Sentence Embeddings", sec. 5.1 "Baselines" and Table 3: PCA (linear),
Isomap (Tenenbaum et al., 2000) and LLE (Roweis & Saul, 2000), each fitted on the embeddings of the first 2,000
sentences of an unsupervised corpus (the paper: SimCSE's English Wikipedia sentences), then used to reduce the
embeddings of the evaluation sentences to d = 128, 64, 32, 16, 8.

Choices the paper leaves open, and what we do:
- Corpus: the first 2,000 *distinct* sentences of the file the user gives (one per line, or every text column
  of a TSV, see matryoshka2d.training.data.read_sentences); duplicates would make LLE's local fits singular. Without a
  file, the CLI uses the shared NLI training sentences (data/nli/train_triplets.tsv), our offline stand-in for
  Wikipedia.
- Input: the cell's raw vectors, by default the full width at each evaluated layer (`source_dim` reduces a
  narrower (layer, k) cell instead). One reducer is fitted per (layer, d) with n_components = d.
- Hyper-parameters: scikit-learn's defaults (n_neighbors = 5 for Isomap and LLE, LLE's method "standard" with
  reg 1e-3); the paper gives none. LLE's eigen solver is seeded (random_state = 0) for reproducibility. When
  ARPACK fails on LLE's singular weight matrix ("Factor is exactly singular"), LLE is fitted again with the dense
  eigensolver, then with reg 0.1 (`fit_lle`); if all fail, the error says so and suggests PCA.
- New points: PCA's transform is exact. Isomap and LLE are transductive; we use scikit-learn's out-of-sample
  `transform`, which is an approximation: Isomap places a new point from its geodesic distances through its
  nearest training points (the kernel-PCA extension), LLE from the barycentric weights of its nearest training
  points. The paper does not say how it embedded evaluation sentences that were not in the 2,000.
- Similarity: cosine of the reduced vectors, as for every other cell.

`ReducedCells` is a cell embedder (matryoshka2d.evaluate.grid.CellEmbedder), so `matryoshka2d eval sts
--reducer pca` reports reduced cells in the same grid format as truncated ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

REDUCERS = ("pca", "isomap", "lle")
PAPER_SAMPLES = 2000  # sec. 5.1: "the embeddings of the first 2,000 sentences"
DEFAULT_NEIGHBORS = 5  # scikit-learn's default for Isomap and LLE; the paper gives no value


def make_reducer(name: str, dim: int, n_neighbors: int = DEFAULT_NEIGHBORS, seed: int = 0):
    """An unfitted scikit-learn reducer to `dim` components."""
    from sklearn.decomposition import PCA
    from sklearn.manifold import Isomap, LocallyLinearEmbedding

    if name == "pca":
        return PCA(n_components=dim, random_state=seed)
    if name == "isomap":
        return Isomap(n_components=dim, n_neighbors=n_neighbors)
    if name == "lle":
        return LocallyLinearEmbedding(n_components=dim, n_neighbors=n_neighbors, random_state=seed)
    raise ValueError(f"unknown reducer '{name}'; choose one of {', '.join(REDUCERS)}")


def check_reduction(name: str, dim: int, samples: int, width: int, n_neighbors: int = DEFAULT_NEIGHBORS) -> None:
    """Fail before any fitting, naming what does not fit: the dim, the corpus size, the neighbours."""
    if name not in REDUCERS:
        raise ValueError(f"unknown reducer '{name}'; choose one of {', '.join(REDUCERS)}")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"{name}: target dim must be a positive integer, got {dim!r}")
    if dim > width:
        raise ValueError(f"{name}: cannot reduce {width}-dim vectors to {dim} dims (a reducer only reduces)")
    if name == "pca" and dim > samples:
        raise ValueError(f"pca: {dim} components need at least {dim} corpus sentences, got {samples}")
    if name != "pca":
        if n_neighbors < 1:
            raise ValueError(f"{name}: n_neighbors must be at least 1, got {n_neighbors}")
        if samples <= max(dim, n_neighbors):
            raise ValueError(
                f"{name}: {dim} components with {n_neighbors} neighbours need more than {max(dim, n_neighbors)} "
                f"corpus sentences, got {samples}"
            )


def fit_reducer(name: str, x: np.ndarray, dim: int, n_neighbors: int = DEFAULT_NEIGHBORS, seed: int = 0):
    """Fit a reducer to `dim` components on the rows of x (samples x width); returns the fitted estimator."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"{name}: need a non-empty 2-D array of corpus vectors, got shape {x.shape}")
    check_reduction(name, dim, len(x), x.shape[1], n_neighbors)
    if name == "lle":
        return fit_lle(x, dim, n_neighbors, seed)
    return make_reducer(name, dim, n_neighbors, seed).fit(x)


# LLE's attempts, in order: scikit-learn's defaults (ARPACK shift-invert for few components on many points), the
# dense eigensolver (no factorisation of the singular weight matrix), then a stronger regularisation of the local
# Gram matrices (near-duplicate neighbours make them singular).
LLE_ATTEMPTS = (("auto", 1e-3), ("dense", 1e-3), ("dense", 1e-1))


def fit_lle(x: np.ndarray, dim: int, n_neighbors: int = DEFAULT_NEIGHBORS, seed: int = 0):
    """LLE that does not die on ARPACK's "Factor is exactly singular": falls back to the dense solver and then
    to a larger `reg`; the estimator records what it took (`fit_attempt_`). Fails with a clear message if none
    gives a finite embedding."""
    import warnings

    from sklearn.manifold import LocallyLinearEmbedding

    problems = []
    for solver, reg in LLE_ATTEMPTS:
        model = LocallyLinearEmbedding(
            n_components=dim, n_neighbors=n_neighbors, eigen_solver=solver, reg=reg, random_state=seed
        )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                model.fit(x)
        except (ValueError, RuntimeError, np.linalg.LinAlgError) as exc:
            problems.append(f"eigen_solver={solver}, reg={reg}: {str(exc).splitlines()[0][:120]}")
            continue
        if not np.isfinite(model.embedding_).all():
            problems.append(f"eigen_solver={solver}, reg={reg}: non-finite embedding")
            continue
        model.fit_attempt_ = {"eigen_solver": solver, "reg": reg, "failed_before": problems}
        return model
    raise ValueError(
        f"lle: no {dim}-dim embedding of {len(x)} corpus vectors with {n_neighbors} neighbours ({'; '.join(problems)})"
        "; use --reducer pca, or a corpus with more distinct sentences"
    )


def corpus_sample(sentences: Sequence[str], samples: int = PAPER_SAMPLES) -> list[str]:
    """The first `samples` distinct non-empty sentences, in order."""
    if samples < 1:
        raise ValueError(f"the reducer corpus sample size must be at least 1, got {samples}")
    distinct = list(dict.fromkeys(s for s in sentences if s.strip()))
    if not distinct:
        raise ValueError("the reducer corpus has no sentences")
    return distinct[:samples]


class ReducedCells:
    """A cell embedder whose cell (n, d) is the encoder's layer-n vector reduced to d numbers by a reducer
    fitted on the corpus (see the module docstring). Fitting happens once, on first use."""

    def __init__(
        self,
        encoder,
        reducer: str,
        corpus: Sequence[str],
        layers: Iterable[int] | None = None,
        dims: Iterable[int] | None = None,
        samples: int = PAPER_SAMPLES,
        source_dim: int | None = None,
        n_neighbors: int = DEFAULT_NEIGHBORS,
        seed: int = 0,
        batch_size: int = 64,
        show_progress: bool = False,
        corpus_name: str | None = None,
        log=None,
    ):
        from matryoshka2d.evaluate.grid import check_cells, default_dims

        self.encoder, self.reducer = encoder, reducer
        self.source_dim = encoder.check_dim(source_dim)
        default = [d for d in default_dims(self.source_dim) if d < self.source_dim] or [self.source_dim]
        self.layers, self.dims = check_cells(
            layers or range(1, encoder.num_layers + 1), dims or default, encoder.num_layers, self.source_dim
        )
        self.corpus = corpus_sample(corpus, samples)
        for d in self.dims:
            check_reduction(reducer, d, len(self.corpus), self.source_dim, n_neighbors)
        self.samples, self.n_neighbors, self.seed = samples, n_neighbors, seed
        self.batch_size, self.show_progress = batch_size, show_progress
        self.corpus_name = corpus_name
        self.log = log or (lambda message: None)
        self.fitted: dict[tuple[int, int], object] = {}
        self.fit_seconds: float | None = None

    def cells(self) -> list[tuple[int, int]]:
        return [(n, d) for n in self.layers for d in self.dims]

    def _vectors(self, texts: Sequence[str]) -> dict[int, np.ndarray]:
        pooled = self.encoder.pooled_states(texts, self.layers, self.batch_size, self.show_progress)
        return {n: pooled[n][:, : self.source_dim] for n in self.layers}

    def fit(self) -> ReducedCells:
        if self.fitted:
            return self
        start = time.perf_counter()
        vectors = self._vectors(self.corpus)
        for n in self.layers:
            for d in self.dims:
                t0 = time.perf_counter()
                self.fitted[(n, d)] = fit_reducer(self.reducer, vectors[n], d, self.n_neighbors, self.seed)
                self.log(f"{self.reducer}: fitted layer {n} -> {d} dims in {time.perf_counter() - t0:.1f} s")
                attempt = getattr(self.fitted[(n, d)], "fit_attempt_", None)
                if attempt and attempt["failed_before"]:
                    self.log(
                        f"{self.reducer}: layer {n} -> {d}: took eigen_solver={attempt['eigen_solver']}, "
                        f"reg={attempt['reg']} after: {'; '.join(attempt['failed_before'])}"
                    )
        self.fit_seconds = time.perf_counter() - start
        return self

    def embed(self, texts: Sequence[str]) -> dict[tuple[int, int], np.ndarray]:
        self.fit()
        vectors = self._vectors(texts)
        out = {}
        for (n, d), model in self.fitted.items():
            x = vectors[n]
            out[(n, d)] = (
                model.transform(x.astype(np.float64)).astype(np.float32) if len(x) else np.zeros((0, d), np.float32)
            )
        return out

    def info(self) -> dict:
        info = self.encoder.info()
        return {
            **info,
            "model": f"{info['model']} + {self.reducer}",
            "batch_size": self.batch_size,
            "reducer": self.reducer,
            "reducer_corpus": self.corpus_name,
            "reducer_corpus_sentences": len(self.corpus),
            "reducer_source_dim": self.source_dim,
            "reducer_n_neighbors": None if self.reducer == "pca" else self.n_neighbors,
            "reducer_fit_seconds": None if self.fit_seconds is None else round(self.fit_seconds, 1),
            "reducer_out_of_sample": "exact (linear)" if self.reducer == "pca" else "scikit-learn transform (approx.)",
        }


def reducer_cells(
    cells,
    reducer: str,
    dims: Iterable[int] | None,
    corpus_file: str | Path | None,
    data_root: str | Path | None,
    samples: int = PAPER_SAMPLES,
    log=None,
) -> ReducedCells:
    """The `eval sts --reducer` embedder: the layers (and encoder) of an EncoderCells, reduced to `dims`.
    The corpus defaults to the shared NLI training sentences, DATA/nli/train_triplets.tsv."""
    from matryoshka2d.training.data import read_sentences

    if corpus_file:
        path = Path(corpus_file)
    elif data_root is not None:
        path = Path(data_root) / "nli" / "train_triplets.tsv"
    else:
        raise ValueError("--reducer needs a corpus: pass --reducer-corpus FILE")
    return ReducedCells(
        cells.encoder,
        reducer,
        read_sentences(path),
        layers=cells.layers,
        dims=dims,
        samples=samples,
        batch_size=cells.batch_size,
        show_progress=cells.show_progress,
        corpus_name=str(path),
        log=log,
    )
