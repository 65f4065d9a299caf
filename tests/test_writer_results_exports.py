"""Issue 52, item 1 for results, exports and picks: every file `eval`, `report`, `report compression`, `pick` and
`export` write goes through the one writer (outputs.py), and result files are read with the file and field named.

- A result file that is a symbolic link is never written through: refused when it reaches a file the command reads
  (a model's config.json), else replaced by the new file (what it pointed at stays as it was).
- A result file hard-linked to a data file the command reads is refused (exit 2 naming --output), not truncated.
- `export --output LINK` is refused before any work (the export replaces its folder as a whole, never through a link).
- A number longer than Python converts, in a results file or the timing cache, is named with its file and field
  (or re-measured, for the cache), not Python's raw "Exceeds the limit" message.
"""

import json
import os
import shutil

import pytest

from matryoshka2d.cli import main
from test_eval_sts import sts_tree
from test_pick import result_file
from test_rules_outputs_options_results import error_line, grid, snapshot

HUGE = "1" + "0" * 5000  # past Python's int-string limit (4300 digits)


@pytest.fixture
def quick_timing(tmp_path, monkeypatch):
    """pick's timings from a fixed table (ms = the layer), in a cache of the test's own: what these tests check is
    where pick writes, not how it measures (test_pick measures for real)."""
    from matryoshka2d.deploy import cost

    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost, "measure_latency", lambda backend, layers, repeats=3: {n: float(n) for n in layers})


@pytest.fixture
def model(tiny_dir, tmp_path):
    """A copy of the tiny model: a folder the commands below must never change."""
    return shutil.copytree(tiny_dir, tmp_path / "model")


def loads(folder) -> bool:
    """Whether the folder still loads as a model (its config.json intact)."""
    from matryoshka2d.models.encoder import ElasticEncoder

    return ElasticEncoder(str(folder), pooling="mean", device="cpu").num_layers == 4


def eval_sts(model, data, out, *more):
    args = ["eval", "sts", "--model", str(model), "--pooling", "mean", "--data-dir", str(data)]
    return main([*args, "--layers", "1,4", "--dims", "8", "32", "--output", str(out), "--quiet", *more])


# ---- a result file that is a link: refused when it reaches an input, else replaced -----------------------------


def test_eval_refuses_a_results_file_linked_into_the_model_it_reads(model, tmp_path, capsys):
    data = sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").symlink_to(model / "config.json")
    before = snapshot(model)
    assert eval_sts(model, data, out) == 2
    line = error_line(capsys)
    assert f"--output {out / 'results.json'}" in line and "--model" in line, line
    assert snapshot(model) == before and loads(model)
    assert (out / "results.json").is_symlink()


def test_eval_replaces_a_results_file_link_to_a_file_it_does_not_read(model, tmp_path, capsys):
    data = sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "notes.md"
    elsewhere.write_text("the user's notes\n")
    (out / "results.md").symlink_to(elsewhere)
    assert eval_sts(model, data, out) == 0
    assert elsewhere.read_text() == "the user's notes\n"  # never written through
    assert not (out / "results.md").is_symlink() and "| layer \\ dim |" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["layers"] == [1, 4]
    assert not [p for p in out.iterdir() if ".m2d-tmp-" in p.name]  # no temporary file left beside the results


def test_eval_refuses_a_results_csv_hard_linked_to_its_data(model, tmp_path, capsys):
    data = sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    stsb = data / "sts" / "raw" / "stsb_test.tsv"
    os.link(stsb, out / "results.csv")
    before = snapshot(data)
    assert eval_sts(model, data, out) == 2
    line = error_line(capsys)
    assert f"--output {out / 'results.csv'}" in line and "hard link" in line and "--data-dir" in line, line
    assert snapshot(data) == before  # the data file is not truncated
    assert not (out / "results.json").exists()  # refused before the work


def test_pick_replaces_its_files_linked_into_the_timed_model_and_the_model_still_loads(model, tmp_path, quick_timing):
    """The model pick times is named by the results (not an input option): links to its files are replaced, never
    written through."""
    results = result_file(tmp_path / "sts", model)
    (results / "pick.json").symlink_to(model / "config.json")
    (results / "pick.md").symlink_to(model / "tokenizer_config.json")
    (results / "pick.png").symlink_to(model / "vocab.txt")
    before = snapshot(model)
    assert main(["pick", "--results", str(results), "--max-bytes", "64"]) == 0
    assert snapshot(model) == before and loads(model)
    for name in ("pick.json", "pick.md", "pick.png"):
        assert not (results / name).is_symlink(), name
    assert json.loads((results / "pick.json").read_text())["recommended"]["dim"] == 8
    assert (results / "pick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pick_refuses_its_output_linked_into_the_model_named_by_model(model, tmp_path, quick_timing, capsys):
    results = result_file(tmp_path / "sts", model)
    (results / "pick.json").symlink_to(model / "config.json")
    before = snapshot(model)
    assert main(["pick", "--results", str(results), "--model", str(model), "--max-bytes", "64"]) == 2
    assert "--output" in error_line(capsys)
    assert snapshot(model) == before and loads(model)


@pytest.fixture(scope="module")
def stsb_dir(tmp_path_factory):
    """STS-B test pairs for `report compression` (30 pairs, 11+ distinct sentences)."""
    root = tmp_path_factory.mktemp("stsb-data")
    words = ["red", "blue", "cat", "dog", "runs", "sleeps", "under", "over", "a", "the", "big", "small"]
    rows = ["sentence1\tsentence2\tscore"]
    rows += [f"{words[i % 12]} {words[(i * 5) % 12]} {i}\t{words[(i * 7) % 12]} {i}\t{i % 6}" for i in range(30)]
    (root / "sts" / "raw").mkdir(parents=True)
    (root / "sts" / "raw" / "stsb_test.tsv").write_text("\n".join(rows) + "\n")
    return root


def report_compression(model, data, out, *more):
    args = ["report", "compression", "--model", str(model), "--data-dir", str(data), "--output", str(out)]
    args += ["--quiet", "--device", "cpu", "--pooling", "mean", "--perplexity", "3", "--sentences", "12"]
    return main([*args, "--dims", "8", "32", *more])


def test_report_compression_never_writes_through_a_link(model, stsb_dir, tmp_path, monkeypatch, capsys):
    from matryoshka2d.evaluate import compression

    # The plane from the vectors' first two numbers: t-SNE's seconds buy nothing here, where the files are checked.
    monkeypatch.setattr(compression, "_tsne", lambda vectors, seed, perplexity: vectors[:, :2].astype(float))
    out = tmp_path / "rep"
    out.mkdir()
    (out / "compression.json").symlink_to(model / "config.json")
    before = snapshot(model)
    assert report_compression(model, stsb_dir, out, "--overwrite") == 2  # reaches --model: refused
    assert "--output" in error_line(capsys)
    assert snapshot(model) == before and loads(model)
    (out / "compression.json").unlink()
    elsewhere = tmp_path / "other.md"
    elsewhere.write_text("kept\n")
    (out / "compression.md").symlink_to(elsewhere)
    assert report_compression(model, stsb_dir, out, "--overwrite") == 0  # a link elsewhere: replaced
    assert elsewhere.read_text() == "kept\n" and not (out / "compression.md").is_symlink()
    assert "| width | " in (out / "compression.md").read_text()


def test_report_replaces_a_linked_report_and_refuses_one_hard_linked_to_a_result(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(grid()))
    out = tmp_path / "rep"
    out.mkdir()
    os.link(tmp_path / "a" / "results.json", out / "report.md")
    before = snapshot(tmp_path / "a")
    args = ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(out)]
    assert main(args) == 2
    assert f"--output {out / 'report.md'}" in error_line(capsys)
    assert snapshot(tmp_path / "a") == before
    (out / "report.md").unlink()
    elsewhere = tmp_path / "notes.md"
    elsewhere.write_text("kept\n")
    (out / "report.md").symlink_to(elsewhere)
    heatmap = tmp_path / "picture.png"
    heatmap.write_bytes(b"a picture of the user's")
    (out / "diff_b_minus_a.png").symlink_to(heatmap)  # both results are of `tiny`: named by their folders
    assert main(args) == 0
    assert elsewhere.read_text() == "kept\n" and heatmap.read_bytes() == b"a picture of the user's"
    assert not (out / "report.md").is_symlink() and (out / "report.md").read_text().startswith("#")
    assert not (out / "diff_b_minus_a.png").is_symlink()
    assert (out / "diff_b_minus_a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- export: the output folder replaced as a whole, never through a link -----------------------------------------


def test_export_refuses_an_output_that_is_a_link_before_any_work(model, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept\n")
    link = tmp_path / "cell"
    link.symlink_to(elsewhere, target_is_directory=True)
    args = ["export", "--model", str(model), "--pooling", "mean", "--layer", "2", "--dim", "8", "--output", str(link)]
    assert main([*args, "--overwrite"]) == 2
    line = error_line(capsys)
    assert f"--output {link} is a symbolic link" in line, line
    assert (elsewhere / "keep.txt").read_text() == "kept\n" and link.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing built beside it


def test_export_beside_its_model_replaces_an_earlier_export_whole(model, tmp_path):
    """The usual layout, the model and its cell side by side: built in a hidden folder beside the output and moved
    into place; an earlier export (with --overwrite) is replaced, not merged."""
    out = tmp_path / "cell"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export\n")
    args = ["export", "--model", str(model), "--pooling", "mean", "--layer", "2", "--dim", "8", "--output", str(out)]
    assert main([*args, "--overwrite"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert json.loads((out / "matryoshka2d.json").read_text())["exported_cell"]["dim"] == 8
    assert not [p for p in tmp_path.iterdir() if ".m2d-tmp-" in p.name]


# ---- a number longer than Python reads: the file and the field named --------------------------------------------


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
    from matryoshka2d.deploy.cost import cost_key
    from matryoshka2d.models.encoder import ElasticEncoder

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
