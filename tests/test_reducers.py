"""Post-hoc reducers (PCA, Isomap, LLE): output shapes, PCA is lossless on data that already lives in d
orthogonal directions, the cell embedder plugs into the STS grid, and errors name what does not fit."""

import json

import numpy as np
import pytest
from scipy.spatial.distance import pdist

from helpers.data import WORDS
from matryoshka2d.cli import main
from matryoshka2d.compress.reducers import REDUCERS, ReducedCells, corpus_sample, fit_reducer
from matryoshka2d.evaluate.sts import evaluate_sts
from matryoshka2d.models.encoder import ElasticEncoder

pytestmark = pytest.mark.usefixtures("one_thread")


def sentences(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(2, 7))) for _ in range(n)]


@pytest.mark.parametrize("name", REDUCERS)
def test_each_reducer_gives_d_numbers_for_new_points(name):
    rng = np.random.default_rng(0)
    fitted = fit_reducer(name, rng.normal(size=(80, 16)), 4)
    out = fitted.transform(rng.normal(size=(7, 16)))
    assert out.shape == (7, 4) and np.isfinite(out).all()


def test_pca_on_data_in_orthogonal_directions_is_lossless():
    rng = np.random.default_rng(1)
    basis, _ = np.linalg.qr(rng.normal(size=(32, 5)))  # 5 orthonormal directions in 32 dims
    x = rng.normal(size=(200, 5)) * [5, 4, 3, 2, 1] @ basis.T + rng.normal(size=32)
    pca = fit_reducer("pca", x, 5)
    reduced = pca.transform(x)
    np.testing.assert_allclose(pdist(reduced), pdist(x), rtol=1e-6, atol=1e-8)  # every distance kept
    np.testing.assert_allclose(pca.inverse_transform(reduced), x, atol=1e-8)
    new = rng.normal(size=(10, 5)) @ basis.T + pca.mean_
    np.testing.assert_allclose(pca.inverse_transform(pca.transform(new)), new, atol=1e-8)


def test_reducer_errors():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="cannot reduce 16-dim vectors to 32 dims"):
        fit_reducer("pca", rng.normal(size=(50, 16)), 32)
    with pytest.raises(ValueError, match="pca: 8 components need at least 8 corpus sentences, got 5"):
        fit_reducer("pca", rng.normal(size=(5, 16)), 8)
    with pytest.raises(ValueError, match="isomap: 4 components with 5 neighbours need more than 5 corpus"):
        fit_reducer("isomap", rng.normal(size=(5, 16)), 4)
    with pytest.raises(ValueError, match="unknown reducer 'tsne'"):
        fit_reducer("tsne", rng.normal(size=(50, 16)), 4)
    with pytest.raises(ValueError, match="target dim must be a positive integer"):
        fit_reducer("lle", rng.normal(size=(50, 16)), 0)
    with pytest.raises(ValueError, match="no sentences"):
        corpus_sample(["", "  "])
    assert corpus_sample(["a", "b", "a", "c"], samples=2) == ["a", "b"]


def sts_dir(root):
    rows = ["sentence1\tsentence2\tscore"]
    rng = np.random.default_rng(2)
    for a, b in zip(sentences(12, 3), sentences(12, 4), strict=True):
        rows.append(f"{a}\t{b}\t{rng.uniform(0, 5):.1f}")
    (root / "sts" / "raw").mkdir(parents=True)
    (root / "sts" / "raw" / "stsb_test.tsv").write_text("\n".join(rows) + "\n")
    return root


@pytest.mark.parametrize("name", REDUCERS)
def test_reduced_cells_in_the_sts_grid(name, tiny_dir, tmp_path):
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    cells = ReducedCells(encoder, name, sentences(60), layers=[2, 4], dims=[4, 8], samples=50)
    assert cells.cells() == [(2, 4), (2, 8), (4, 4), (4, 8)]
    out = cells.embed(["a red cat", "dogs run"])
    assert {k: v.shape for k, v in out.items()} == {c: (2, c[1]) for c in cells.cells()}
    result = evaluate_sts(cells, sts_dir(tmp_path), datasets=["stsb"], log=lambda _: None)
    assert sorted((r["layer"], r["dim"]) for r in result.scores) == cells.cells()
    info = result.model
    assert info["reducer"] == name and info["reducer_corpus_sentences"] == 50 and info["model"].endswith(name)


def test_cli_eval_sts_with_a_reducer(tiny_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences(40)) + "\n")
    data = sts_dir(tmp_path / "data")
    out = tmp_path / "out"
    args = ["eval", "sts", "--model", str(tiny_dir), "--pooling", "mean", "--data-dir", str(data), "--quiet"]
    args += ["--datasets", "stsb", "--layers", "4", "--dims", "8,4", "--output", str(out)]
    assert main([*args, "--reducer", "pca", "--reducer-corpus", str(corpus)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["dims"] == [4, 8] and result["model"]["reducer"] == "pca"
    assert result["model"]["reducer_corpus"] == str(corpus)
    assert "| layer \\ dim | 4 | 8 |" in (out / "results.md").read_text()
    # Without --reducer-corpus the shared NLI sentences are used; here the data folder has none.
    assert main([*args, "--reducer", "lle"]) == 2
    assert "train_triplets.tsv: no such file" in capsys.readouterr().err
    assert main([*args, "--reducer", "isomap", "--reducer-corpus", str(corpus), "--dims", "64"]) == 2
    assert "out of range" in capsys.readouterr().err
