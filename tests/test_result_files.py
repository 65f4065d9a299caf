"""Result files are read by one reader (docs/reliability.md, rule 6: evaluate.results), which names the file
and the field of what is malformed, a number longer than Python reads included; cells without a finite score are
named and left out; and pick checks that the results and the model it times are one model."""

import json
import shutil

import numpy as np
import pytest

from helpers.cli import error_line
from helpers.data import grid, result_file, sts_tree
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder

# ---- malformed result files: the file and the field named ------------------------------------------------------------


def cascade(**row_changes):
    row = {"dataset": "scifact", "mode": "flat (2,32)", "ndcg@10": 50.0, **row_changes}
    row = {k: v for k, v in row.items() if v is not None}
    return {"task": "retrieval-cascade", "rows": [row], "model": {"model": "tiny", "layers": 2, "hidden_size": 32}}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def bad_average():
    record = grid()
    record["average"][1]["spearman"] = 99.0  # the per-dataset scores of (1,32) average 45.0
    return record


def nan_dataset_score():
    record = grid()
    record["scores"][0]["spearman"] = float("nan")  # the cell's average still says a number
    return record


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (nested(100_000), ["nested deeper than a JSON reader follows"]),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", ["not UTF-8 text", "not a JSON file"]),
        (grid(average=[{"dim": 8, "spearman": 41.0}]), ["average[0]: no 'layer'"]),
        (grid(scores=[], average=[{"layer": 1, "dim": 8, "spearman": "41.0"}]), ["average[0].spearman: '41.0'"]),
        (grid(scores=[], average=[{"layer": 1, "dim": 8, "spearman": True}]), ["average[0].spearman: True"]),
        (grid(layers=[1, "2"]), ["layers[1]: '2' is not a whole number"]),
        (bad_average(), ["average[1].spearman: 99.0 contradicts", "45.0"]),
        (nan_dataset_score(), ["average[0].spearman: 42.0 contradicts", "nan"]),
        (cascade(mode=None), ["rows[0]: no 'mode'"]),
        (cascade(**{"ndcg@10": "50"}), ["rows[0].ndcg@10: '50' is not a score"]),
        (grid(metric=7), ["field 'metric' must be a string"]),
    ],
    ids=[
        "deep",
        "binary",
        "no-layer",
        "string-score",
        "bool-score",
        "string-layer",
        "contradicting-average",
        "nan-dataset-score",
        "cascade-no-mode",
        "cascade-string-score",
        "metric",
    ],
)
def test_pick_and_report_name_the_file_and_field_of_a_malformed_result(tmp_path, capsys, content, needles):
    folder = tmp_path / "r"
    folder.mkdir()
    name = (
        "cascade.json" if isinstance(content, dict) and content.get("task") == "retrieval-cascade" else "results.json"
    )
    file = folder / name
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["pick", "--results", str(folder), "--output", str(tmp_path / "p")]) == 2
    line = error_line(capsys)
    assert str(file) in line and all(n in line for n in needles), line
    assert not (tmp_path / "p").exists()
    if name == "results.json":
        (tmp_path / "good").mkdir()
        (tmp_path / "good" / "results.json").write_text(json.dumps(grid()))
        assert main(["report", str(tmp_path / "good"), str(folder), "--output", str(tmp_path / "rep")]) == 2
        line = error_line(capsys)
        assert str(file) in line and all(n in line for n in needles), line


def test_a_well_formed_result_with_nan_scores_still_reads(tmp_path):
    """NaN is a score that could not be computed; pick names those cells and leaves them out (issue 32)."""
    from matryoshka2d.evaluate.results import load_result

    record = grid()
    for row in record["scores"]:
        if (row["layer"], row["dim"]) == (1, 8):
            row["spearman"] = float("nan")
    record["average"][0]["spearman"] = float("nan")
    (tmp_path / "results.json").write_text(json.dumps(record))
    assert load_result(tmp_path).average[1]["spearman"] == 45.0


def test_a_malformed_result_in_a_model_folder_is_left_off_its_card(tiny_bert, tmp_path, capsys):
    """The model card reads results.json files already in the folder through the same reader: a malformed one is
    named and left off, not a KeyError in the middle of a save."""
    out = tmp_path / "m"
    (out / "sts").mkdir(parents=True)
    (out / "sts" / "results.json").write_text(json.dumps(grid(average=[{"dim": 8, "spearman": 41.0}])))
    tiny_bert.save(out)
    assert "average[0]: no 'layer'" in capsys.readouterr().err
    assert (out / "README.md").is_file()


# ---- a number longer than Python reads -------------------------------------------------------------------------------


HUGE = "1" + "0" * 5000  # past Python's int-string limit (4300 digits)


def test_pick_and_report_name_the_field_of_a_5000_digit_number(tmp_path, capsys):
    text = json.dumps(grid()).replace('"layer": 2', f'"layer": {HUGE}', 1)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text(text)
    assert main(["pick", "--results", str(bad), "--output", str(tmp_path / "p")]) == 2
    line = error_line(capsys)
    assert str(bad / "results.json") in line and "scores[2].layer" in line and "5001 digits" in line, line
    assert "Exceeds the limit" not in line
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "results.json").write_text(json.dumps(grid()))
    assert main(["report", str(tmp_path / "good"), str(bad), "--output", str(tmp_path / "rep")]) == 2
    line = error_line(capsys)
    assert str(bad / "results.json") in line and "scores[2].layer" in line, line
    assert not (tmp_path / "p").exists() and not (tmp_path / "rep").exists()


def test_a_5000_digit_number_in_a_field_no_check_reads_is_named_too(tmp_path, capsys):
    record = grid()
    record["settings"] = {"batch_size": 1}
    bad = tmp_path / "r"
    bad.mkdir()
    (bad / "results.json").write_text(json.dumps(record).replace('"batch_size": 1', f'"batch_size": {HUGE}'))
    assert main(["pick", "--results", str(bad), "--output", str(tmp_path / "p")]) == 2
    line = error_line(capsys)
    assert str(bad / "results.json") in line and "settings.batch_size" in line, line


def test_a_cascade_mode_with_a_5000_digit_layer_is_named_with_its_file(tmp_path, capsys):
    record = {
        "task": "retrieval-cascade",
        "rows": [{"dataset": "scifact", "mode": f"flat ({HUGE},32)", "ndcg@10": 50.0}],
        "model": {"model": "tiny", "layers": 2, "hidden_size": 32},
    }
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "cascade.json").write_text(json.dumps(record))
    assert main(["pick", "--results", str(folder), "--output", str(tmp_path / "p")]) == 2
    line = error_line(capsys)
    assert f"{folder / 'cascade.json'}: a row's mode 'flat (1000" in line and "not one pick knows" in line, line
    assert len(line) < 400


def test_a_damaged_timing_cache_is_measured_again(tiny_dir, tmp_path, quick_timing, capsys):
    """The timing cache is pick's own file: a 5,000-digit number in it, or an entry without its date, is measured
    again (the cache is then rewritten whole), never Python's raw message or a KeyError."""
    from matryoshka2d.pick.cost import cost_key

    cache = tmp_path / "cache"
    cache.mkdir()
    results = result_file(tmp_path / "sts", tiny_dir)
    (cache / "layer_latency.json").write_text(f'{{"other": {HUGE}}}')
    assert main(["pick", "--results", str(results), "--max-bytes", "64"]) == 0
    assert "measuring encode time" in capsys.readouterr().err
    key = cost_key(ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu").info())
    table = json.loads((cache / "layer_latency.json").read_text())
    assert key in table
    table[key] = {"ms_per_query": table[key]["ms_per_query"]}  # no date: an entry of another version
    (cache / "layer_latency.json").write_text(json.dumps(table))
    assert main(["pick", "--results", str(results), "--max-bytes", "64"]) == 0
    assert "measuring encode time" in capsys.readouterr().err
    assert "date" in json.loads((cache / "layer_latency.json").read_text())[key]


# ---- NaN scores and the model pick times -----------------------------------------------------------------------------


def test_pick_names_cells_with_nan_scores_and_picks_among_the_others(tiny_dir, tmp_path, quick_timing, capsys):
    rows = [{"layer": n, "dim": d, "spearman": 40 + 5 * n + d / 8} for n in (1, 2, 4) for d in (8, 32)]
    rows[0]["spearman"] = rows[5]["spearman"] = float("nan")
    model = {"model": "tiny", "location": str(tiny_dir), "layers": 4, "hidden_size": 32, "pooling": "mean"}
    result = {"task": "sts", "metric": "spearman", "metrics": ["spearman"], "datasets": ["stsb"], "layers": [1, 2, 4]}
    result.update(dims=[8, 32], average=rows, model=model)
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "results.json").write_text(json.dumps(result))
    assert main(["pick", "--results", str(tmp_path / "sts")]) == 0
    out = capsys.readouterr()
    assert "2 cells have no finite score (NaN or inf) and are left out: (1,8) torch, (4,32) torch" in out.err
    chosen = json.loads((tmp_path / "sts" / "pick.json").read_text())["recommended"]
    assert (chosen["layer"], chosen["dim"]) != (4, 32) and np.isfinite(chosen["score"])


def test_pick_checks_that_results_and_the_timed_model_are_one_model(
    tiny_dir, other_weights_dir, tmp_path, quick_timing, capsys
):
    sts_tree(tmp_path / "data")
    common = ["--pooling", "mean", "--data-dir", str(tmp_path / "data"), "--layers", "1,4", "--dims", "8,32", "--quiet"]
    for name, model in (("a", tiny_dir), ("b", other_weights_dir)):
        assert main(["eval", "sts", "--model", str(model), *common, "--output", str(tmp_path / name)]) == 0
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert a["model"]["weights_sha256"] != b["model"]["weights_sha256"]
    capsys.readouterr()
    pick = ["pick", "--results", str(tmp_path / "a"), "--output", str(tmp_path / "pick")]
    assert main([*pick, "--model", str(other_weights_dir)]) == 2
    error_line(capsys, "are of", "but the model timed", "has other weights", "another's timings")
    assert not (tmp_path / "pick").exists()  # refused before timing anything or writing
    assert main(["pick", "--results", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    error_line(capsys, "the result files are of different models")
    assert main(pick) == 0  # the model named in the results: its own
    assert "warning" not in capsys.readouterr().err
    # A result file written before the checksum was recorded: a warning, not a refusal.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "a", old)
    del a["model"]["weights_sha256"]
    (old / "results.json").write_text(json.dumps(a))
    assert main(["pick", "--results", str(old), "--model", str(other_weights_dir)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "record no weights checksum" in err and "Traceback" not in err
