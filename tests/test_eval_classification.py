"""Classification: SentEval protocols on separable toys, pair features, discovery, and bad files."""

import json
import zlib

import numpy as np
import pytest

from helpers.models import tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.evaluate.classification import (
    SEED,
    default_cells,
    discover,
    evaluate_classification,
    features,
    fit_path,
    load_split,
)
from matryoshka2d.files import DataFormatError


class HashEmbedder:
    """A CellEmbedder that reads the class off the text: 'pos ...' -> +1 in the first number, 'neg ...' -> -1.

    Layer 1 carries that signal; layer 2 is pure noise. Other numbers are small noise seeded by the text.
    """

    def __init__(self, dims=(1, 4), signal=None):
        self.dims = list(dims)
        self.signal = signal or {"pos": 1.0, "neg": -1.0}
        self.seen = []

    def cells(self):
        return [(n, d) for n in (1, 2) for d in self.dims]

    def vector(self, text, layer):
        rng = np.random.default_rng(zlib.crc32(f"{layer}:{text}".encode()))
        v = rng.normal(scale=0.1, size=max(self.dims)).astype(np.float32)
        if layer == 1:
            v[0] = self.signal[text.split()[0]]
        return v

    def embed(self, texts):
        self.seen.append(list(texts))
        full = {n: np.stack([self.vector(t, n) for t in texts]) for n in (1, 2)}
        return {(n, d): full[n][:, :d] for n, d in self.cells()}

    def info(self):
        return {"model": "hash", "layers": 2, "hidden_size": max(self.dims)}


def write_tsv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join("\t".join(map(str, r)) for r in [header, *rows]) + "\n", encoding="utf-8")


def labelled(n, offset=0):
    return [(f"{'pos' if i % 2 else 'neg'} sentence {i + offset}", i % 2) for i in range(n)]


def quiet(_message):
    return None


def test_separable_classes_give_100_with_dev_kfold_and_all_protocols(tmp_path):
    write_tsv(tmp_path / "split_train.tsv", ["sentence", "label"], labelled(40))
    write_tsv(tmp_path / "split_dev.tsv", ["sentence", "label"], labelled(10, 100))
    write_tsv(tmp_path / "split_test.tsv", ["sentence", "label"], labelled(12, 200))
    write_tsv(tmp_path / "kf_train.tsv", ["sentence", "label"], labelled(30, 300))
    write_tsv(tmp_path / "kf_test.tsv", ["sentence", "label"], labelled(10, 400))
    write_tsv(tmp_path / "cv_all.tsv", ["sentence", "label"], labelled(36, 500))
    result = evaluate_classification(HashEmbedder(), tmp_path, folds=3, log=quiet)
    assert result.datasets == ["cv", "kf", "split"]
    rows = {(r["dataset"], r["layer"], r["dim"]): r for r in result.scores}
    for name in ("cv", "kf", "split"):
        assert rows[(name, 1, 1)]["accuracy"] == 100.0
        assert rows[(name, 1, 4)]["accuracy"] == 100.0
        assert "f1" not in rows[(name, 1, 1)]  # single sentences: accuracy only, as SentEval
    assert rows[("split", 1, 1)]["C"] == 0.25  # first of SentEval's 2^-2..2^3 reaching the best dev score
    protocols = {k: v["protocol"] for k, v in result.settings["datasets"].items()}
    assert protocols["cv"].startswith("3-fold cross-validation") and "dev" in protocols["split"]
    assert result.summary["cell"] == [2, 4]


def test_pair_features_are_senteval_mrpc_features():
    cells = np.array([[1.0, -2.0], [3.0, 0.5], [0.0, 1.0]], dtype=np.float32)
    got = features(cells, np.array([0, 2]), np.array([1, 1]))
    u, v = cells[[0, 2]], cells[[1, 1]]
    np.testing.assert_array_equal(got, np.c_[np.abs(u - v), u * v])
    np.testing.assert_array_equal(features(cells, np.array([1]), None), cells[[1]])


def test_centring_keeps_the_optimum_of_plain_logistic_regression():
    """Features far from the origin (as anisotropic embeddings are) give the same classifier centred or not."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(300, 8)) + 5.0).astype(np.float32)
    y = (x[:, 0] + 0.5 * rng.normal(size=300) > 5.0).astype(int)
    probes = fit_path(x, y, [0.5, 4.0])
    for probe, c in zip(probes, [0.5, 4.0], strict=True):
        plain = LogisticRegression(C=c, tol=1e-10, max_iter=10000, random_state=SEED).fit(x, y)
        np.testing.assert_allclose(probe.clf.coef_, plain.coef_, rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(probe.predict(x), plain.predict(x))
        assert probe.reg == c


def test_pair_dataset_reports_accuracy_and_f1(tmp_path):
    # A paraphrase is the same sentence twice (|u - v| = 0); a non-paraphrase pairs 'pos' with 'neg'.
    def pairs(n, offset):
        return [
            (f"pos a{i + offset}", f"pos a{i + offset}", 1, i, i) if i % 2 else (f"pos b{i}", f"neg c{i}", 0, i, i)
            for i in range(n)
        ]

    header = ["sentence1", "sentence2", "label", "id1", "id2"]
    write_tsv(tmp_path / "para_train.tsv", header, pairs(30, 0))
    write_tsv(tmp_path / "para_test.tsv", header, pairs(10, 100))
    embedder = HashEmbedder(dims=[1])
    result = evaluate_classification(embedder, tmp_path, folds=3, log=quiet)
    row = next(r for r in result.scores if r["layer"] == 1)
    assert row["accuracy"] == 100.0 and row["f1"] == 100.0
    assert result.settings["datasets"]["para"]["pair"] is True
    assert len(embedder.seen) == 1  # every split's texts embedded in one call, for all cells


def test_multiclass_string_labels_and_label_column(tmp_path):
    signal = {"num": 1.0, "loc": -1.0, "hum": 0.0}
    rows = [(f"{c} question {i}", c.upper(), f"{c.upper()}:x") for i in range(30) for c in signal]
    write_tsv(tmp_path / "trec_train.tsv", ["sentence", "label", "fine_label"], rows)
    write_tsv(tmp_path / "trec_test.tsv", ["sentence", "label", "fine_label"], rows[:9])
    result = evaluate_classification(HashEmbedder(dims=[1], signal=signal), tmp_path, folds=3, log=quiet)
    assert next(r for r in result.scores if r["layer"] == 1)["accuracy"] == 100.0
    assert result.settings["datasets"]["trec"]["classes"] == ["HUM", "LOC", "NUM"]
    fine = evaluate_classification(
        HashEmbedder(dims=[1], signal=signal), tmp_path, label_column="fine_label", folds=3, log=quiet
    )
    assert fine.settings["datasets"]["trec"]["classes"] == ["HUM:x", "LOC:x", "NUM:x"]


def test_discovery_picks_up_new_sets_and_checks_splits(tmp_path):
    write_tsv(tmp_path / "newset_train.tsv", ["sentence", "label"], labelled(4))
    write_tsv(tmp_path / "newset_test.tsv", ["sentence", "label"], labelled(4))
    (tmp_path / "notes.tsv").write_text("ignored\n")
    assert list(discover(tmp_path)) == ["newset"]
    with pytest.raises(DataFormatError, match=r"no files for dataset\(s\) sst2 \(found: newset\)"):
        discover(tmp_path, ["sst2"])
    write_tsv(tmp_path / "lonely_train.tsv", ["sentence", "label"], labelled(4))
    with pytest.raises(DataFormatError, match=r"lonely needs _train and _test files, or one _all file"):
        discover(tmp_path)
    write_tsv(tmp_path / "lonely_all.tsv", ["sentence", "label"], labelled(4))
    with pytest.raises(DataFormatError, match=r"lonely has both an _all file and split files"):
        discover(tmp_path)
    with pytest.raises(DataFormatError, match=r"classification directory not found"):
        discover(tmp_path / "missing")


@pytest.mark.parametrize(
    ("content", "label_column", "message"),
    [
        ("sentence\tlabel\na\t1\nb\n", "label", r"x_train.tsv line 3: 1 tab-separated columns, the header has 2"),
        ("sentence\tlabel\na\t1\n", "fine_label", r"x_train.tsv line 1: no column 'fine_label'"),
        ("text\tlabel\na\t1\n", "label", r"x_train.tsv line 1: expected a 'sentence' column or 'sentence1'"),
        ("sentence\tlabel\na\t1\nb\t \n", "label", r"x_train.tsv line 3: empty label"),
        ("", "label", r"x_train.tsv: empty file"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, content, label_column, message):
    path = tmp_path / "x_train.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataFormatError, match=message):
        load_split(path, label_column)


def test_dataset_level_errors(tmp_path):
    write_tsv(tmp_path / "one_train.tsv", ["sentence", "label"], [("pos a", 1), ("pos b", 1)])
    write_tsv(tmp_path / "one_test.tsv", ["sentence", "label"], [("pos c", 1)])
    with pytest.raises(DataFormatError, match=r"one_train.tsv: only one label \('1'\)"):
        evaluate_classification(HashEmbedder(), tmp_path, log=quiet)
    write_tsv(tmp_path / "few_train.tsv", ["sentence", "label"], labelled(6))
    write_tsv(tmp_path / "few_test.tsv", ["sentence", "label"], labelled(4))
    with pytest.raises(DataFormatError, match=r"few_train.tsv: the rarest label has 3 rows, fewer than the 10 folds"):
        evaluate_classification(HashEmbedder(), tmp_path, datasets=["few"], log=quiet)
    write_tsv(tmp_path / "mix_train.tsv", ["sentence", "label"], labelled(6))
    write_tsv(tmp_path / "mix_test.tsv", ["sentence1", "sentence2", "label"], [("a", "b", 1)])
    with pytest.raises(DataFormatError, match=r"mix: some files have sentence pairs and some single sentences"):
        evaluate_classification(HashEmbedder(), tmp_path, datasets=["mix"], log=quiet)


def test_default_cells():
    assert default_cells(6, 384) == ([2, 3, 4, 6], [32, 128, 384])
    assert default_cells(12, 768) == ([3, 6, 9, 12], [32, 128, 768])
    assert default_cells(4, 32) == ([1, 2, 3, 4], [32])


def test_cli_on_tiny_model(tmp_path, tokenizer, capsys):
    model_dir = tmp_path / "model"
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "data" / "classification"
    write_tsv(data / "toy_train.tsv", ["sentence", "label"], labelled(20))
    write_tsv(data / "toy_test.tsv", ["sentence", "label"], labelled(6, 50))
    out = tmp_path / "out"
    args = ["eval", "classification", "--model", str(model_dir), "--pooling", "mean", "--folds", "2", "--quiet"]
    assert main([*args, "--data-dir", str(tmp_path / "data"), "--output", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["layers"] == [1, 2, 3, 4] and result["dims"] == [32]  # the documented default cells
    assert all(0 <= r["accuracy"] <= 100 for r in result["scores"])
    assert (out / "heatmap.png").is_file() and "accuracy" in (out / "results.md").read_text()
    assert main([*args, "--data-dir", str(tmp_path / "data"), "--datasets", "sst2", "--output", str(out)]) == 2
    assert "no files for dataset(s) sst2" in capsys.readouterr().err


def test_c_search_stops_after_the_peak_and_chooses_the_same_c(monkeypatch):
    from matryoshka2d.evaluate import classification as cl

    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 60)).astype(np.float32)  # few rows, many noise features: large C overfits
    y = (x[:, 0] + 0.5 * rng.normal(size=80) > 0).astype(int)
    regs = [2.0**t for t in range(-6, 9)]
    every, every_score = cl.choose_by_kfold(x, y, regs, 5, patience=0)
    calls = []
    original = cl._fit
    monkeypatch.setattr(cl, "_fit", lambda clf, c, *a: (calls.append(c), original(clf, c, *a))[1])
    early, early_score = cl.choose_by_kfold(x, y, regs, 5, patience=2)
    assert early.reg == every.reg and early_score == every_score
    assert len(set(calls)) < len(regs)  # the large C values after the peak were never fitted
    best, scores = cl._search([1, 2, 3, 4, 5], lambda i, c: [50, 60, 55, 70, 40][i], patience=2)
    assert best == 3 and len(scores) == 5  # one dip is not the end: 55 < 60 then 70 beats it
    best, scores = cl._search([1, 2, 3, 4, 5], lambda i, c: [50, 60, 55, 54, 90][i], patience=2)
    assert best == 1 and len(scores) == 4


def test_classification_warns_about_test_labels_absent_from_train(tmp_path):
    from matryoshka2d.evaluate.classification import load_dataset, unseen_labels

    rows = "sentence\tlabel\n" + "".join(f"text {i}\t{'pos' if i % 2 else 'neg'}\n" for i in range(6))
    (tmp_path / "x_train.tsv").write_text(rows)
    (tmp_path / "x_test.tsv").write_text("sentence\tlabel\na\tPos\nb\tneg\nc\tother\n")
    ds = load_dataset("x", {"train": tmp_path / "x_train.tsv", "test": tmp_path / "x_test.tsv"})
    warning = unseen_labels(ds)
    assert "2 of 3 rows" in warning and "'Pos'" in warning and "'other'" in warning
    assert "differ only in case: 'Pos' vs train 'pos'" in warning
    (tmp_path / "x_test.tsv").write_text("sentence\tlabel\na\tpos\nb\tneg\n")
    assert (
        unseen_labels(load_dataset("x", {"train": tmp_path / "x_train.tsv", "test": tmp_path / "x_test.tsv"})) is None
    )
