"""`matryoshka2d demo`: the whole loop (fine-tune, STS grid, pick, export, cascade search) on a tiny model and
tiny data laid out like the shared data; a second run reuses the cached fine-tune."""

import json

from sentence_transformers import SentenceTransformer

from helpers.data import data_root
from matryoshka2d.cli import main


def test_demo_runs_the_whole_loop_and_reuses_the_fine_tune(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    root = data_root(tmp_path / "data")
    args = ["demo", "--model", str(tiny_dir), "--pooling", "mean", "--data-dir", str(root), "--steps", "2"]
    args += ["--batch-size", "4", "--sts", "stsb", "--queries", "5", "--docs", "20", "--quiet"]
    assert main([*args, "--output", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    for heading in (
        "[1/5] fine-tune",
        "[2/5] STS grid",
        "[3/5] pick a cell and a backend",
        "[4/5] export",
        "[5/5] cascade search",
    ):
        assert heading in out
    assert "recommended cell (" in out and "x faster encoding" in out and "bytes/vector" in out
    assert (
        "affine exit heads at layers 1,2,3" in out and "without heads (torch only) the same budget would give (" in out
    )
    # the full model as served in int8 is scored, timed and on the one frontier, and the demo says what it is worth
    assert "as served in int8 (ONNX graphs" in out and "the full model in int8 (" in out
    picked = json.loads((tmp_path / "run" / "pick" / "pick.json").read_text())
    assert picked["backends"] == ["torch", "onnx-int8"]
    assert any(p["backend"] == "onnx-int8" and (p["layer"], p["dim"]) == (4, 32) for p in picked["points"])
    assert picked["recommended"]["backend"] in ("torch", "onnx-int8") and picked["recommended"]["deploy"]
    # layer 0, the static cell, in the grid and its own point on the one frontier's time axis
    assert "static cell (layer 0): model2vec's table of" in out and "layer 0, the static cell: (0," in out
    zero = [p for p in picked["points"] if p["layer"] == 0]
    assert [p["dim"] for p in zero] == [32] and all(p["backend"] == "torch" for p in zero)
    assert picked["timing"]["ms_per_query"]["0"] < picked["timing"]["ms_per_query"]["4"]
    assert "(ridge strength: STS-B dev Spearman)" in out  # chosen as `heads fit` chooses it
    assert "exclude_sts_test: 1 rows hold an STS test sentence and are left out; 15 remain" in out
    assert (tmp_path / "run" / "sts-no-heads" / "results.json").is_file()
    chosen = json.loads((tmp_path / "run" / "pick" / "pick.json").read_text())["recommended"]
    export = tmp_path / "run" / f"export-{chosen['layer']}x{chosen['dim']}"
    exported = json.loads((export / "matryoshka2d.json").read_text())["exported_cell"]
    assert (exported["layer"], exported["dim"]) == (chosen["layer"], chosen["dim"])
    assert json.loads((export / "config.json").read_text())["num_hidden_layers"] == chosen["layer"]
    assert SentenceTransformer(str(export), device="cpu").encode(["a b"]).shape == (1, chosen["dim"])
    assert (export / "onnx" / "cell_int8.onnx").is_file() == (chosen["backend"] == "onnx-int8")
    assert (tmp_path / "run" / "index" / "manifest.json").is_file()
    assert main([*args, "--output", str(tmp_path / "again")]) == 0
    again = capsys.readouterr().out
    assert "reusing the cached fine-tune" in again and "reusing the cached heads" in again
    assert "reusing the cached static cell" in again


def test_demo_cells_is_the_quick_timing_demo(tiny_dir, capsys):
    assert main(["demo", "--cells", "--model", str(tiny_dir), "--pooling", "mean"]) == 0
    assert "ms/sentence" in capsys.readouterr().out
