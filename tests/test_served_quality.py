"""Quality as served (issue 35): `eval ... --backend onnx [--quantize int8]` scores the graphs `serve --backend onnx`
runs, and the results say which backend, precision and graphs made them."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.data import LETTER_CORPUS, beir, sts_tree
from helpers.models import distill_config
from matryoshka2d.cli import main

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def model_and_data(tiny_dir, tmp_path_factory):
    """A writable copy of the tiny model (its graphs are cached inside it) and a tiny STS tree."""
    root = tmp_path_factory.mktemp("served")
    model = root / "model"
    shutil.copytree(tiny_dir, model)
    sts_tree(root / "data")
    return model, root / "data"


def eval_sts(model, data, out, *extra):
    args = ["eval", "sts", "--model", str(model), "--pooling", "mean", "--data-dir", str(data), "--quiet"]
    return main([*args, "--layers", "1,3", "--dims", "8", "32", "--output", str(out), *extra])


def test_onnx_fp32_scores_equal_torch_and_record_their_graphs(model_and_data, tmp_path):
    model, data = model_and_data
    assert eval_sts(model, data, tmp_path / "torch") == 0
    assert eval_sts(model, data, tmp_path / "onnx", "--backend", "onnx") == 0
    torch_result = json.loads((tmp_path / "torch" / "results.json").read_text())
    onnx_result = json.loads((tmp_path / "onnx" / "results.json").read_text())
    assert torch_result["model"]["backend"] == "torch" and torch_result["model"]["precision"] == "float32"
    recorded = onnx_result["model"]
    assert recorded["backend"] == "onnx" and recorded["precision"] == "fp32"
    assert sorted(recorded["graphs_sha256"]) == ["1", "3"]  # only the evaluated layers' graphs are built
    manifest = json.loads((Path(recorded["graphs"]) / "manifest.json").read_text())
    assert Path(recorded["graphs"]).parent == model / "onnx-serve"
    assert recorded["graphs_sha256"]["3"] == manifest["graphs"]["layer-3.onnx"]["sha256"]
    assert recorded["weights_sha256"] == torch_result["model"]["weights_sha256"]  # one model, two backends
    scores = {r["dataset"] + str((r["layer"], r["dim"])): r["spearman"] for r in torch_result["scores"]}
    for row in onnx_result["scores"]:  # fp32 graphs reproduce torch within rounding
        assert row["spearman"] == pytest.approx(scores[row["dataset"] + str((row["layer"], row["dim"]))], abs=0.2)


def test_int8_scores_are_measured_on_int8_graphs(model_and_data, tmp_path):
    model, data = model_and_data
    assert eval_sts(model, data, tmp_path / "int8", "--backend", "onnx", "--quantize", "int8") == 0
    recorded = json.loads((tmp_path / "int8" / "results.json").read_text())["model"]
    assert recorded["precision"] == "int8"
    manifest = json.loads((Path(recorded["graphs"]) / "manifest.json").read_text())
    assert recorded["graphs_sha256"]["1"] == manifest["graphs"]["layer-1.int8.onnx"]["sha256"]
    scores = [r["spearman"] for r in json.loads((tmp_path / "int8" / "results.json").read_text())["scores"]]
    assert all(np.isfinite(scores))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--quantize", "int8"], "--quantize int8 applies to --backend onnx"),
        (["--backend", "onnx", "--compare-heads"], "drop it with --backend onnx"),
        (["--backend", "onnx", "--device", "cuda"], "runs on the CPU"),
    ],
)
def test_backend_options_that_do_not_go_together(model_and_data, tmp_path, capsys, extra, message):
    model, data = model_and_data
    assert eval_sts(model, data, tmp_path / "x", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cascade_modes_stay_on_torch(tiny_dir, tmp_path, capsys):
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--dataset-dir", str(tmp_path), "--split", "test"]
    assert main([*args, "--query-layer", "2", "--backend", "onnx", "--output", str(tmp_path / "o")]) == 2
    assert "--cascade, --query-layer, --query-model and --storage run on torch" in capsys.readouterr().err


# ---- pick over (cell, backend): cost as served, one frontier, refusals --------------------------------------------


@pytest.fixture(scope="module")
def scored(model_and_data, tmp_path_factory):
    """The same grid scored by torch and by the int8 graphs."""
    model, data = model_and_data
    root = tmp_path_factory.mktemp("scored")
    assert eval_sts(model, data, root / "torch") == 0
    assert eval_sts(model, data, root / "int8", "--backend", "onnx", "--quantize", "int8") == 0
    return model, root / "torch", root / "int8"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_pick_times_each_backend_and_puts_both_on_one_frontier(scored, cache, tmp_path, capsys):
    model, torch_dir, int8_dir = scored
    out = tmp_path / "pick"
    args = ["pick", "--results", str(torch_dir), str(int8_dir), "--output", str(out), "--max-latency-ratio", "1"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "with the torch backend" in err and "with the onnx-int8 backend" in err
    assert "budget: 1 x the full model on torch" in err
    picked = json.loads((out / "pick.json").read_text())
    assert picked["backends"] == ["torch", "onnx-int8"]
    assert {(p["layer"], p["dim"], p["backend"]) for p in picked["points"]} == {
        (n, d, b) for n in (1, 3) for d in (8, 32) for b in ("torch", "onnx-int8")
    }
    ms = {(p["layer"], p["backend"]): p["latency_ms"] for p in picked["points"]}
    assert ms[(3, "torch")] != ms[(3, "onnx-int8")]  # each backend is timed on its own graphs
    chosen = picked["recommended"]
    flags = " --backend onnx --quantize int8" if chosen["backend"] == "onnx-int8" else ""
    assert chosen["deploy"][0].startswith(f"serve: `matryoshka2d serve --model {model}{flags}")
    assert "below the best option" in chosen["reason"] or "the best score of all" in chosen["reason"]
    cached = json.loads((cache / "layer_latency.json").read_text())
    assert any(key.endswith("| backend onnx-int8") for key in cached)  # cached per backend
    assert main([*args, "--backend", "onnx-int8"]) == 2  # the torch file is not timed: refused
    assert "scored with the torch backend, but pick times onnx-int8" in capsys.readouterr().err


def test_pick_refuses_a_backend_without_results_and_results_of_another_backend(scored, cache, tmp_path, capsys):
    _, torch_dir, int8_dir = scored
    args = ["pick", "--results", str(torch_dir), "--backend", "torch", "onnx-int8", "--output", str(tmp_path / "a")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "pick --backend onnx-int8: no result file was scored with it" in err and "--quantize int8" in err
    assert main(["pick", "--results", str(int8_dir), "--backend", "torch", "--output", str(tmp_path / "b")]) == 2
    assert "scored with the onnx-int8 backend, but pick times torch" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_pick_reads_cascade_and_query_encoder_results_and_says_which_keep_the_index(
    teacher_dir,
    text_file,
    sts_dev,
    cache,
    tmp_path,
    capsys,
):
    """`pick --results` on `eval retrieval --cascade ... --query-layer ... --query-model ...` (issue 35: it said
    "no results.json"): every row is an option, and the index a row keeps or re-encodes is said."""
    from matryoshka2d.training.distill import DistillTrainer

    student = DistillTrainer(
        distill_config(teacher_dir, text_file, tmp_path / "q2", sts_dev, method_options={"mode": "query", "layer": 2})
    ).run(progress=False)
    queries = [{"_id": f"q{i}", "text": f"about {w}"} for i, w in enumerate("abcdefghijkl")]
    root = beir(tmp_path / "toy", LETTER_CORPUS, queries, [(f"q{i}", f"d{i}", 1) for i in range(12)], split="train")
    args = ["eval", "retrieval", "--model", str(teacher_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    options = ["--cascade", "1:8,4:32", "--shortlist", "16", "--query-layer", "2", "--query-model", str(student)]
    options += ["--storage", "float16", "binary"]
    assert main([*args, *options, "--output", str(tmp_path / "ev"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["pick", "--results", str(tmp_path / "ev"), "--min-score", "0"]) == 0
    picked = json.loads((tmp_path / "ev" / "pick.json").read_text())
    kinds = {(p["kind"], p["layer"], p["dim"]) for p in picked["points"]}
    assert kinds == {
        ("cell", 4, 32),
        ("cascade", 4, 32),
        ("query-layer", 2, 32),
        ("cell", 2, 32),
        ("query-encoder", 2, 32),
        ("storage", 4, 32),
    }
    stored = {p["storage"]: p for p in picked["points"] if p["kind"] == "storage"}
    assert stored["float16"]["bytes"] == 32 * 2 and stored["binary"]["bytes"] == 32 // 8  # measured, not assumed
    modes = [r["mode"] for r in json.loads((tmp_path / "ev" / "cascade.json").read_text())["rows"]]
    assert "flat (4,32) stored as binary (Hamming shortlist 16, float16 rescoring)" in modes
    cascade = next(p for p in picked["points"] if p["kind"] == "cascade")
    assert cascade["bytes"] == (8 + 32) * 4  # both cells are stored
    encoder = next(p for p in picked["points"] if p["kind"] == "query-encoder")
    assert encoder["query_model"] == str(student) and encoder["latency_ms"] > 0  # the student itself is timed
    every = (tmp_path / "ev" / "pick.md").read_text().split("## Every option")[1]
    assert "| keeps |" in every and "| re-encodes |" in every and "| rebuilds (same vectors) |" in every
    assert every.count("| keeps |") == 3  # the full cell, queries at layer 2, the query encoder
    chosen = picked["recommended"]
    assert chosen["kind"] == "query-encoder" or min(p["latency_ms"] for p in picked["points"]) < encoder["latency_ms"]
    said = " ".join(chosen["deploy"])
    assert ("stays valid" in said) or ("re-encodes the corpus" in said)
