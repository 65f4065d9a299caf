"""`matryoshka2d report`: two results side by side, differences per cell, and refusals that say why."""

import json

import pytest

from matryoshka2d.cli import main
from matryoshka2d.evaluate.report import write_report
from matryoshka2d.evaluate.results import grid_result, load_result, write_outputs


def fake_result(model, base, task="sts", metric="spearman", layers=(1, 2), dims=(8, 16)):
    """A finished result whose score is base + layer + dim / 8 on dataset a and that minus 2 on dataset b."""
    scores = [
        {"dataset": ds, "layer": n, "dim": d, metric: base + n + d / 8 - shift}
        for ds, shift in (("a", 0.0), ("b", 2.0))
        for n in layers
        for d in dims
    ]
    cells = [(n, d) for n in layers for d in dims]
    model_info = {"model": model, "layers": max(layers), "hidden_size": max(dims)}
    return grid_result(
        task, [metric], ["a", "b"], scores, cells, model_info, {}, {"total": 1.0}, {"date": "2025-01-01 00:00 UTC"}
    )


def test_results_json_keeps_its_keys_and_reads_back_as_written(tmp_path):
    result = fake_result("m", 50.0, layers=(1, 3), dims=(8,))
    write_outputs(result, tmp_path)
    written = json.loads((tmp_path / "results.json").read_text())
    assert list(written) == [
        *("task", "metric", "metrics", "datasets", "layers", "dims", "scores", "model", "settings", "seconds"),
        *("provenance", "average", "summary"),
    ]
    # Cell (3, 8): a scores 50 + 3 + 1 = 54 and b 52; the summary's shallow average is layer 1's, (52 + 50) / 2.
    assert written["average"][-1] == {"layer": 3, "dim": 8, "spearman": 53.0}
    assert written["summary"] == {
        "metric": "spearman",
        "cell": [3, 8],
        "average": 53.0,
        "shallow_layers": [1],
        "shallow_average": 51.0,
    }
    assert list(written["provenance"]) == ["date", "load_average_at_end"]
    assert load_result(tmp_path).to_dict() == written == result.to_dict()


def test_two_results_side_by_side_with_difference(tmp_path):
    write_outputs(fake_result("raw-model", 50.0), tmp_path / "raw")
    write_outputs(fake_result("trained", 53.5, layers=(1, 2, 3)), tmp_path / "ese")
    paths = write_report([tmp_path / "raw", tmp_path / "ese" / "results.json"], tmp_path / "rep", ["RAW", "ESE"])
    assert [p.name for p in paths] == ["report.md", "diff_ESE_minus_RAW.png"]
    assert paths[1].read_bytes()[:4] == b"\x89PNG"
    text = paths[0].read_text()
    # Cell (2, 16): averages of a and b are 50 + 2 + 2 - 1 = 53 and 56.5; the difference is +3.50.
    assert "| 2 | 16 | 53.00 | 56.50 | +3.50 |" in text
    assert "| 3 |" not in text.split("## Per cell")[1].split("##")[0]  # only cells both results have
    assert "## Per dataset at layer 2, dim 16" in text and "| b | 52.00 | 55.50 | +3.50 |" in text
    assert "## ESE - RAW (rows: layer, columns: dim)" in text and "| 1 | 3.50 | 3.50 |" in text


def test_default_names_use_directories_when_models_match(tmp_path, capsys):
    write_outputs(fake_result("m", 50.0), tmp_path / "run1")
    write_outputs(fake_result("m", 49.0), tmp_path / "run2")
    assert main(["report", str(tmp_path / "run1"), str(tmp_path / "run2"), "--output", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "diff_run2_minus_run1.png").is_file()
    assert "| 1 | 8 | 51.00 | 50.00 | -1.00 |" in (tmp_path / "rep" / "report.md").read_text()
    assert "report.md" in capsys.readouterr().out


def test_refusals(tmp_path, capsys):
    write_outputs(fake_result("m", 50.0), tmp_path / "sts")
    write_outputs(fake_result("m", 90.0, task="classification", metric="accuracy"), tmp_path / "cls")
    with pytest.raises(ValueError, match=r"a classification result \(accuracy\) cannot be compared with .*sts"):
        write_report([tmp_path / "sts", tmp_path / "cls"], tmp_path / "rep")
    with pytest.raises(ValueError, match="--names has 1 names for 2 results"):
        write_report([tmp_path / "sts", tmp_path / "sts"], tmp_path / "rep", ["x"])
    with pytest.raises(ValueError, match="at least two results"):
        write_report([tmp_path / "sts"], tmp_path / "rep")
    write_outputs(fake_result("m", 50.0, layers=(3,), dims=(32,)), tmp_path / "other")
    with pytest.raises(ValueError, match=r"share no \(layer, dim\) cell"):
        write_report([tmp_path / "sts", tmp_path / "other"], tmp_path / "rep")
    assert main(["report", str(tmp_path / "nope"), str(tmp_path / "sts"), "--output", str(tmp_path / "r")]) == 2
    assert "nope: no results.json" in capsys.readouterr().err


def test_load_result_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text('{\n  "task": "sts",\n  oops\n}')
    with pytest.raises(ValueError, match=r"results.json line 3: not valid JSON"):
        load_result(bad)
    bad.write_text(json.dumps({"task": "sts"}))
    with pytest.raises(ValueError, match=r"not a matryoshka2d result \(missing metric, average, layers, dims\)"):
        load_result(tmp_path)
