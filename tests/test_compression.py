"""`matryoshka2d report compression` (ESE's Figure 7): its distances on toys whose answer is known, the report it
writes from a tiny model, and the refusals that say what was wrong."""

import json

import numpy as np
import pytest

from helpers.data import WORDS
from matryoshka2d.cli import main
from matryoshka2d.evaluate import compression

pytestmark = pytest.mark.usefixtures("one_thread")


def vectors(n: int, d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d))


def test_paired_distance_of_a_known_displacement():
    points = vectors(30, 2)
    assert compression.paired_distance(points, points) == 0.0
    assert compression.paired_distance(points, points + np.array([3.0, 4.0])) == pytest.approx(5.0)
    moved = points.copy()
    moved[:10] += [0.0, 6.0]  # a third of the points 6 away, the rest in place
    assert compression.paired_distance(points, moved) == pytest.approx(2.0)


def test_a_cut_that_keeps_everything_is_at_distance_zero():
    """A model whose numbers past K are all zero loses nothing by the cut: every distance is 0, the t-SNE one too
    (each sentence's two points coincide)."""
    first = vectors(40, 8)
    whole = np.hstack([first, np.zeros((40, 24))])
    assert compression.cosine_distance(whole, first) == pytest.approx(0.0, abs=1e-12)
    assert compression.neighbour_loss(whole, first) == 0.0
    panel = compression.compare("toy", "width", {(2, 32): whole, (2, 8): first}, (2, 32), (2, 8), perplexity=5)
    assert panel.tsne_distance == pytest.approx(0.0, abs=1e-6)
    assert (panel.full, panel.cut, panel.sentences) == ((2, 32), (2, 8), 40)


def test_separate_layouts_of_the_same_neighbourhoods_coincide():
    """--layout separate: a t-SNE per set, the cut's turned onto the whole's. A cut that keeps everything lands on
    the whole's points; so does a turned copy of the same neighbourhoods (the turn is undone)."""
    first = vectors(40, 8)
    whole = np.hstack([first, np.zeros((40, 24))])
    points, cut_points = compression.tsne_pairs(whole, first, perplexity=5, layout="separate")
    assert compression.paired_distance(points, cut_points) == pytest.approx(0.0, abs=1e-3)
    assert compression.paired_distance(points, cut_points @ np.array([[0.0, -1.0], [1.0, 0.0]])) > 1
    with pytest.raises(ValueError, match="--layout flat: choose one of joint, separate"):
        compression.tsne_pairs(whole, first, layout="flat")


def test_known_cosine_and_neighbour_distances():
    # The first number of (1, 1) keeps cos 45 degrees of it; of (1, 0) all of it.
    whole = np.array([[1.0, 1.0], [1.0, 0.0]])
    assert compression.cosine_distance(whole, whole[:, :1]) == pytest.approx((1 - np.sqrt(0.5)) / 2)
    x = vectors(24, 4, seed=1)
    assert compression.neighbour_loss(x, x, k=3) == 0.0
    # Two tight groups of four under the whole vector, {0,1,2,3} and {4,5,6,7}; the cut groups them {0,1,4,5} and
    # {2,3,6,7}: each sentence keeps one of its three nearest neighbours.
    noise = 0.01 * vectors(8, 2, seed=3)
    axes = np.eye(2)
    whole = axes[[0, 0, 0, 0, 1, 1, 1, 1]] + noise
    cut = axes[[0, 0, 1, 1, 0, 0, 1, 1]] + noise
    assert compression.neighbour_loss(whole, cut, k=3) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="5 sentences: the neighbour loss at 10 neighbours needs more than 10"):
        compression.neighbour_loss(x[:5], x[:5])


def test_check_views_names_each_wrong_option():
    check = compression.check_views
    check(4, [8, 32], 2, 4, 32, "m")  # in range: no error
    with pytest.raises(ValueError, match=r"--dims 64 32: K must be at least 1 and smaller than FULL \(32\)"):
        check(4, [64, 32], None, 4, 32, "m")
    with pytest.raises(ValueError, match=r"--dims 8 64: FULL 64 is wider than m's embeddings \(32 numbers\)"):
        check(4, [8, 64], None, 4, 32, "m")
    with pytest.raises(ValueError, match="--dims takes two numbers, K and FULL"):
        check(4, [8], None, 4, 32, "m")
    with pytest.raises(ValueError, match=r"--layer 7: m has layers 1..4"):
        check(7, [8, 32], None, 4, 32, "m")
    with pytest.raises(ValueError, match=r"--exit 4: the exit must be a layer below --layer 4 \(1..3\)"):
        check(4, None, 4, 4, 32, "m")


@pytest.fixture(scope="module")
def stsb_dir(tmp_path_factory):
    """A data folder with an STS-B test file of 30 pairs of WORDS sentences (sts/raw/stsb_test.tsv)."""
    root = tmp_path_factory.mktemp("stsb-data")
    (root / "sts" / "raw").mkdir(parents=True)
    rng = np.random.default_rng(2)
    rows = ["sentence1\tsentence2\tscore"]
    rows += [f"{' '.join(rng.choice(WORDS, 4))}\t{' '.join(rng.choice(WORDS, 3))}\t{i % 6}" for i in range(30)]
    (root / "sts" / "raw" / "stsb_test.tsv").write_text("\n".join(rows) + "\n")
    return root


def report(tiny_dir, stsb_dir, out, *options):
    return main(
        [
            "report",
            "compression",
            "--model",
            str(tiny_dir),
            "--data-dir",
            str(stsb_dir),
            "--output",
            str(out),
            "--quiet",
            "--device",
            "cpu",
            "--pooling",
            "mean",
            "--perplexity",
            "5",
            *map(str, options),
        ]
    )


def test_report_of_a_tiny_model(tiny_dir, stsb_dir, tmp_path, capsys):
    out = tmp_path / "rep"
    assert report(tiny_dir, stsb_dir, out, "--dims", "8", "32", "--exit", "2", "--layer", "4") == 0
    record = json.loads((out / "compression.json").read_text())
    assert (out / "compression.png").stat().st_size > 0
    assert [(p["view"], p["full"], p["cut"]) for p in record["panels"]] == [
        ("width", [4, 32], [4, 8]),
        ("depth", [4, 32], [2, 32]),
    ]
    lines = (stsb_dir / "sts" / "raw" / "stsb_test.tsv").read_text().splitlines()[1:]
    distinct = {s for line in lines for s in line.split("\t")[:2]}
    assert all(p["sentences"] == record["settings"]["sentences"] == len(distinct) for p in record["panels"])
    assert all(p["tsne_distance"] > 0 and 0 < p["cosine_distance"] < 2 for p in record["panels"])
    assert "| width | " in (out / "compression.md").read_text()
    assert "report compression ->" in capsys.readouterr().out
    # Never over an earlier report without --overwrite.
    assert report(tiny_dir, stsb_dir, out, "--dims", "8", "32") == 2
    assert "already holds compression.json; pass --overwrite" in capsys.readouterr().err
    assert report(tiny_dir, stsb_dir, out, "--dims", "8", "32", "--layout", "separate", "--overwrite") == 0
    record = json.loads((out / "compression.json").read_text())
    assert record["settings"]["layout"] == "separate" and [p["view"] for p in record["panels"]] == ["width"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--dims", "64", "32"], "--dims 64 32: K must be at least 1 and smaller than FULL (32)"),
        (["--dims", "8", "32", "--layer", "9"], "--layer 9: --model "),
        (["--exit", "2", "--layer", "2"], "--exit 2: the exit must be a layer below --layer 2"),
        ([], "give --dims K FULL (the width view), --exit N (the depth view), or both"),
        (["--dims", "8", "32", "--sentences", "5"], "--sentences 5: give more than 10"),
    ],
)
def test_cli_refusals(tiny_dir, stsb_dir, tmp_path, capsys, options, message):
    assert report(tiny_dir, stsb_dir, tmp_path / "rep", *options) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


def test_a_layer_below_1_is_refused_where_it_is_parsed(tiny_dir, stsb_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        report(tiny_dir, stsb_dir, tmp_path / "rep", "--dims", "8", "32", "--layer", "0")
    assert stopped.value.code == 2 and "argument --layer: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


def test_cli_refusals_without_a_model(stsb_dir, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert report(missing, stsb_dir, tmp_path / "rep", "--dims", "8", "32") == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["report", "compression", "--dims", "8", "32", "--output", str(tmp_path / "r")]) == 2
    assert "`report compression` needs at least one --model" in capsys.readouterr().err
    assert main(["report", "a", "b", "--layer", "3", "--output", str(tmp_path / "r")]) == 2
    assert "--layer belongs to `report compression`" in capsys.readouterr().err
