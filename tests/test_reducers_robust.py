"""LLE survives ARPACK's singular factorisation (dense solver, then more regularisation) or fails clearly; Isomap
is scikit-learn's and recovers the known structure of a Swiss roll (issue 12, list 7)."""

import numpy as np
import pytest
from scipy.stats import spearmanr

from matryoshka2d.compress import reducers
from matryoshka2d.compress.reducers import fit_lle, fit_reducer


def test_lle_falls_back_to_the_dense_solver_when_arpack_fails(monkeypatch):
    from sklearn.manifold import LocallyLinearEmbedding

    real_fit = LocallyLinearEmbedding.fit

    def arpack_fails(self, x, y=None):
        if self.eigen_solver != "dense":
            raise ValueError("Error in determining null-space with ARPACK. Error message: 'Factor is exactly singular'")
        return real_fit(self, x, y)

    monkeypatch.setattr(LocallyLinearEmbedding, "fit", arpack_fails)
    x = np.random.default_rng(0).normal(size=(300, 16))
    model = fit_reducer("lle", x, 4)
    assert model.fit_attempt_["eigen_solver"] == "dense" and "Factor is exactly singular" in str(
        model.fit_attempt_["failed_before"]
    )
    assert np.isfinite(model.transform(x[:5])).all()


def test_lle_that_cannot_be_fitted_says_why(monkeypatch):
    from sklearn.manifold import LocallyLinearEmbedding

    def always_fails(self, x, y=None):
        raise ValueError("Factor is exactly singular")

    monkeypatch.setattr(LocallyLinearEmbedding, "fit", always_fails)
    with pytest.raises(ValueError, match=r"lle: no 4-dim embedding of 300 corpus vectors.*use --reducer pca"):
        fit_lle(np.zeros((300, 16)), 4)
    assert len(reducers.LLE_ATTEMPTS) == 3


def test_isomap_is_scikit_learns_and_unrolls_a_swiss_roll():
    from sklearn.datasets import make_swiss_roll
    from sklearn.manifold import Isomap

    x, t = make_swiss_roll(n_samples=800, noise=0.0, random_state=0)
    ours = fit_reducer("isomap", x, 2, n_neighbors=10)
    theirs = Isomap(n_components=2, n_neighbors=10).fit(x)
    np.testing.assert_allclose(np.abs(ours.embedding_), np.abs(theirs.embedding_), atol=1e-8)
    # The roll's position along the spiral (t) is one axis of the unrolled sheet; PCA cannot recover it.
    best = max(abs(spearmanr(ours.embedding_[:, i], t).statistic) for i in range(2))
    pca = fit_reducer("pca", x, 2).transform(x)
    assert best > 0.99
    assert max(abs(spearmanr(pca[:, i], t).statistic) for i in range(2)) < best - 0.2
    # New points land where their neighbours are (the out-of-sample transform).
    x_new, t_new = make_swiss_roll(n_samples=100, noise=0.0, random_state=1)
    placed = ours.transform(x_new)
    axis = int(np.argmax([abs(spearmanr(ours.embedding_[:, i], t).statistic) for i in range(2)]))
    assert abs(spearmanr(placed[:, axis], t_new).statistic) > 0.98
