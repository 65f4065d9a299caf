"""Quality as served (issue 35): `eval ... --backend onnx [--quantize int8]` scores the graphs `serve --backend onnx`
runs, and the results say which backend, precision and graphs made them."""

import json
import shutil

import numpy as np
import pytest

from matryoshka2d.cli import main
from test_eval_sts import sts_tree

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
    manifest = json.loads((model / "onnx-serve" / "manifest.json").read_text())
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
    manifest = json.loads((model / "onnx-serve" / "manifest.json").read_text())
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
    assert "--cascade, --query-layer and --query-model run on torch" in capsys.readouterr().err
