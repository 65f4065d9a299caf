"""Issue 41, rules 2, 4 and 6 (docs/reliability.md, section 11):

- rule 2, no output overlaps an input: `main` checks every writing command's output against all of its inputs,
  through links, before anything is deleted or written (cli.args.check_outputs -> files.check_apart); training
  runs check their final options again (training.rundir.RunDir.check), so a --config file cannot slip past;
- rule 4, every option is checked where it is parsed: typed converters in cli/args.py, and options that would do
  nothing in the combination given are refused;
- rule 6, result files are read by one reader (result_files.read_result_record), which names the file and the field.
"""

import argparse
import json
import os
import shutil

import pytest

from matryoshka2d.cli import build_parser, main
from matryoshka2d.cli.args import check_outputs, named_folder
from test_sts_overlap import write_sts


def exit_code(args) -> int:
    """main's exit code, whether the command returned it or argparse exited with it (paths may be given)."""
    try:
        return main([str(a) for a in args])
    except SystemExit as exc:
        return exc.code


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def model(tiny_dir, tmp_path):
    """A copy of the tiny model: a folder the commands below must never change."""
    return shutil.copytree(tiny_dir, tmp_path / "model")


# ---- rule 2: no output overlaps an input ------------------------------------------------------------------------


def test_distill_never_replaces_its_teacher_directly_or_through_a_link(model, text_file, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)
    before = snapshot(model)
    base = ["distill", "--pooling", "mean", "--data", str(text_file), "--steps", "1", "--quiet", "--overwrite"]
    base += ["--no-exclude-sts-test"]
    cases = [
        (model, model, "is"),
        (model, link, "is"),  # --output a link to the teacher
        (link, model, "is"),  # --teacher through a link
        (model, model / "student", "is inside"),
        (model, tmp_path, "holds"),
    ]
    for teacher, output, how in cases:
        assert main([*base, "--teacher", str(teacher), "--output", str(output)]) == 2
        line = error_line(capsys)
        assert f"--output {output}" in line and f" {how} --teacher {teacher}" in line, line
        assert "nothing was written" in line
    assert snapshot(model) == before
    assert not (model / "student").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--model", "{model}", "--data", "{text}", "--output", "{model}", "--overwrite"],
        ["train", "--model", "{model}", "--data", "{text}", "--output", "{model}/run"],
        ["train", "--model", "{model}", "--data", "{text}", "--output", "{text_dir}", "--overwrite"],
        ["merge", "--models", "{model}", "{model}", "--output", "{model}", "--overwrite"],
        ["heads", "fit", "--model", "{model}", "--data", "{text}", "--output", "{model}", "--overwrite"],
        ["export", "--model", "{model}", "--layer", "1", "--dim", "8", "--output", "{model}", "--overwrite"],
        ["index", "build", "--model", "{model}", "--corpus", "{text}", "--cells", "1:8", "--output", "{model}"],
        ["index", "build", "--model", "{model}", "--corpus", "{text}", "--cells", "1:8", "--output", "{text_dir}"],
        ["pretrain", "--model", "{model}", "--data", "{text}", "--output", "{model}", "--overwrite"],
        ["two-step", "--model", "{model}", "--data", "{text}", "--target-dim", "8", "--output", "{model}"],
        ["eval", "sts", "--model", "{model}", "--reducer", "pca", "--reducer-corpus", "{out}/results.csv"],
        ["eval", "mteb", "--model", "{model}", "--task-dir", "{out}/results.csv"],  # an STS file as a task
        ["search", "--index", "{model}", "--queries", "{text}", "--output", "{text}"],
        ["search", "--index", "{model}", "--queries", "{text}", "--output", "{out}/hard-link.txt"],
        ["index", "build", "--model", "{model}", "--corpus", "{text}", "--backend", "qdrant", "--path", "{model}"],
        ["eval", "retrieval", "--model", "{model}", "--cascade", "1:8,4:32", "--doc-cache", "{model}"],
        ["encode", "--model", "{model}", "--input", "{text}", "--output", "{text}"],
        ["pick", "--results", "{out}/pick.json"],  # pick writes pick.json beside its results
        ["report", "{out}/report.md", "{out}/report.md", "--output", "{out}"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_every_writing_command_refuses_an_output_over_an_input(model, tmp_path, capsys, command):
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    text = text_dir / "texts.txt"
    text.write_text("red cat\nblue dog\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.csv", "pick.json", "report.md"):
        (out / name).write_text("what the command reads\n")
    os.link(text, out / "hard-link.txt")  # the queries under another name
    args = [a.format(model=model, text=text, text_dir=text_dir, out=out) for a in command]
    if args[0] == "eval":
        args += ["--pooling", "mean", "--output", str(out)]
    if args[:2] == ["index", "build"] and "--output" not in args:
        args += ["--cells", "1:8", "--output", str(out / "idx")]
    before = snapshot(tmp_path)
    assert exit_code(args) == 2
    line = error_line(capsys)
    assert "nothing was written" in line, line
    assert snapshot(tmp_path) == before


def test_an_empty_output_is_not_the_current_folder(model, text_file, capsys):
    assert main(["heads", "fit", "--model", str(model), "--data", str(text_file), "--output", ""]) == 2
    assert "--output is empty" in error_line(capsys)


def test_a_config_file_cannot_name_an_output_over_an_input(model, text_file, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {model}\ndata: [{text_file}]\noutput: {model}\n")
    before = snapshot(model)
    assert main(["train", "--config", str(config), "--pooling", "mean", "--steps", "1", "--overwrite"]) == 2
    assert f"--output {model} is --model {model}" in error_line(capsys)
    assert snapshot(model) == before


def test_results_may_be_written_inside_the_model_folder_they_describe(model, tmp_path):
    """`eval --output RUN/sts` is the documented layout (the model card reads it there); it neither is nor holds
    an input, so it is allowed; the model folder itself, or a folder holding it, is not (issue 52)."""
    parser = build_parser()
    check_outputs(parser.parse_args(["eval", "sts", "--model", str(model), "--output", str(model / "sts")]))
    check_outputs(parser.parse_args(["pick", "--results", str(model / "sts"), "--output", str(model / "sts")]))
    with pytest.raises(ValueError, match="is --model"):  # into the model folder itself: its files are inputs
        check_outputs(parser.parse_args(["eval", "sts", "--model", str(model), "--output", str(model)]))
    (model / "no-heads").mkdir()
    with pytest.raises(ValueError, match="no-heads is --model"):  # --compare-heads writes OUTPUT/no-heads
        check_outputs(parser.parse_args(["eval", "sts", "--model", str(model / "no-heads"), "--output", str(model)]))


def every_command(parser, path=()):
    """(words, parser) of every command and subcommand under `parser`, e.g. (("index", "build"), its parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_command(sub, (*path, name))
    if path:
        yield path, parser


def test_every_command_with_an_output_says_what_it_reads():
    """A new command with --output cannot skip rule 2: each declares its inputs (cli.args.reads_and_writes)."""

    undeclared = [
        " ".join(path)
        for path, parser in every_command(build_parser())
        if any("--output" in a.option_strings for a in parser._actions) and not parser.get_default("reads")
    ]
    assert undeclared == []


# ---- rule 4: every option is checked where it is parsed ---------------------------------------------------------


def test_every_typed_option_of_every_command_goes_through_a_converter_of_cli_args():
    """Rule 4 in one place: a new option cannot take bare `int` or `float` (which accept 'nan', '-1', '1e3'
    without saying which option is wrong): each typed option uses a converter of matryoshka2d.cli.args, whose
    errors argparse prints with the option's name before anything loads."""
    from matryoshka2d.cli import args as converters

    bare = [
        f"{' '.join(path)} {action.option_strings[0]}: type={action.type.__name__}"
        for path, parser in every_command(build_parser())
        for action in parser._actions
        if action.type is not None
        and action.option_strings
        and getattr(action.type, "__module__", None) != converters.__name__
        and action.type is not str
    ]
    assert bare == []


@pytest.mark.parametrize("value", ["abc", "16,,32", "1e3", "", "16,0"])
def test_widths_are_refused_where_they_are_parsed(value, capsys):
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["distill", "--data", "x", "--output", "o", "--widths", value])
    assert stopped.value.code == 2
    assert "argument --widths:" in error_line(capsys)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["distill", "--data", "x", "--output", "o", "--engine", "ray", "--workers", "0"], "--workers"),  # Ray hung
        (["pick", "--results", "r", "--batch", "0"], "--batch"),
        (["index", "build", "--corpus", "c", "--cells", "1:8", "--output", "o", "--workers", "0"], "--workers"),
        (["search", "--index", "i", "--query", "q", "--top-k", "0"], "--top-k"),
        (["eval", "sts", "--output", "o", "--batch-size", "-1"], "--batch-size"),
        (["export", "--layer", "-1", "--dim", "8", "--output", "o"], "--layer"),  # 0 is the static cell
        (["train", "--data", "x", "--output", "o", "--eval-cell", "3:x"], "--eval-cell"),
        (["train", "--data", "x", "--output", "o", "--lora-dropout", "1.5"], "--lora-dropout"),
        (["distill", "--data", "x", "--output", "o", "--max-texts", "0"], "--max-texts"),
        (["serve", "--target-ms", "0"], "--target-ms"),
        (["serve", "--max-queue-ms", "nan"], "--max-queue-ms"),
        (["serve", "--drain-seconds", "-1"], "--drain-seconds"),
    ],
    ids=lambda a: a if isinstance(a, str) else a[0],
)
def test_bad_numbers_stop_at_parse_time_naming_the_option(args, flag, capsys):
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(args)
    assert stopped.value.code == 2
    assert f"argument {flag}:" in error_line(capsys)


def test_a_query_model_splits_at_the_first_equals_sign_after_a_plain_name(tiny_dir, tmp_path, capsys):
    assert named_folder("q=/runs/a=b/q") == ("q", "/runs/a=b/q")
    assert named_folder("/runs/a=b/q") == ("", "/runs/a=b/q")
    assert named_folder("runs/a=b") == ("", "runs/a=b")
    folder = tmp_path / "a=b" / "q"
    args = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0", "--query-model", f"q={folder}"]
    assert main(args) == 2
    assert f"--query-model {folder}: not a query encoder" in error_line(capsys)  # the whole folder, not 'b/q'


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["--mode", "query", "--layer", "2", "--eval-cell", "3:16"],
            "--eval-cell 3:16: the query encoder of --layer 2",
        ),
        (["--temperature", "0.1"], "--temperature is the softmax temperature of --loss relational; --loss cos"),
        (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
    ],
)
def test_distill_options_that_would_do_nothing_are_refused(teacher_dir, text_file, tmp_path, capsys, extra, needle):
    out = tmp_path / "student"
    base = ["distill", "--teacher", str(teacher_dir), "--pooling", "mean", "--data", str(text_file), "--steps", "1"]
    base += ["--batch-size", "8", "--no-exclude-sts-test", "--quiet", "--output", str(out)]
    assert main([*base, *extra]) == 2
    assert needle in error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "--distill-weight", "0.5"], "--distill-weight would do nothing without --distill-from"),
        (["train", "--lora-alpha", "8", "--lora-dropout", "0.1"], "--lora-alpha and --lora-dropout would do nothing"),
        (["eval", "sts", "--reducer-corpus", "{text}"], "--reducer-corpus and --reducer-samples set how --reducer"),
        (["eval", "sts", "--reducer-samples", "10"], "they need --reducer"),
        (["eval", "retrieval", "--doc-cache", "{tmp}/cache"], "--doc-cache keeps the documents' pooled states"),
        (["heads", "fit", "--data", "{text}", "--select", "mse", "--ridge", "1"], "--select mse chooses the ridge"),
    ],
    ids=lambda a: a if isinstance(a, str) else " ".join(a[:2]),
)
def test_other_options_that_would_do_nothing_are_refused(model, text_file, tmp_path, capsys, args, needle):
    out = tmp_path / "out"
    args = [a.format(text=text_file, tmp=tmp_path) for a in args]
    args += ["--model", str(model), "--pooling", "mean", "--output", str(out)]
    if args[0] == "train":
        args += ["--data", str(text_file), "--steps", "1"]
    assert main(args) == 2
    assert needle in error_line(capsys)
    assert not out.exists()


def test_train_refuses_resume_with_overwrite(tiny_dir, triplets, sts_dev, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "train_log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # a run the flags would continue or delete
    before = snapshot(out)
    base = ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--steps", "1"]
    assert main([*base, "--eval-file", str(sts_dev), "--output", str(out), "--resume", "--overwrite"]) == 2
    assert "--resume and --overwrite exclude each other" in error_line(capsys)
    assert snapshot(out) == before


def test_search_refuses_another_pooling_for_a_query_model(tmp_path, capsys):
    args = ["search", "--index", str(tmp_path / "idx"), "--query", "red cat", "--query-model", str(tmp_path / "q")]
    assert main([*args, "--pooling", "cls"]) == 2
    assert "--pooling cls with --query-model" in error_line(capsys)


def test_eval_refuses_a_reducer_on_the_onnx_backend(model, tmp_path, capsys):
    args = ["eval", "sts", "--model", str(model), "--pooling", "mean", "--backend", "onnx", "--reducer", "pca"]
    assert main([*args, "--output", str(tmp_path / "o")]) == 2
    assert "--reducer pca reduces the vectors torch computes; it does not run on --backend onnx" in error_line(capsys)
    assert not (model / "onnx-serve").exists() and not (tmp_path / "o").exists()


def test_eval_refuses_an_empty_item_in_dims(model, tmp_path, capsys):
    args = ["eval", "sts", "--model", str(model), "--pooling", "mean", "--dims", "16,,32"]
    assert main([*args, "--output", str(tmp_path / "o")]) == 2
    assert "--dims: '16,,32' holds an empty item" in error_line(capsys)


def test_a_file_of_only_sts_test_sentences_says_they_were_left_out(teacher_dir, sts_dev, tmp_path, monkeypatch, capsys):
    write_sts(tmp_path / "data", {"stsb": [("red cat sleeps", "blue dog runs")]})
    monkeypatch.setenv("MATRYOSHKA2D_DATA", str(tmp_path / "data"))
    data = tmp_path / "only-test.txt"
    data.write_text("Red cat sleeps.\nblue dog runs\n")
    args = ["distill", "--teacher", str(teacher_dir), "--pooling", "mean", "--data", str(data), "--steps", "1"]
    assert main([*args, "--eval-file", str(sts_dev), "--quiet", "--output", str(tmp_path / "s")]) == 2
    line = error_line(capsys)
    assert "all 2 of its texts are sentences of the STS test sets" in line and "--no-exclude-sts-test" in line
    triplets = tmp_path / "only-test.tsv"
    triplets.write_text("anchor\tpositive\tnegative\nred cat sleeps\tgreen bird\tsad fish\n")
    args = ["train", "--model", str(teacher_dir), "--pooling", "mean", "--data", str(triplets), "--steps", "1"]
    assert main([*args, "--exclude-sts-test", "--eval-file", str(sts_dev), "--output", str(tmp_path / "t")]) == 2
    line = error_line(capsys)
    assert "all 1 rows hold a sentence of the STS test sets (--exclude-sts-test); leave that flag out" in line


# ---- rule 6: result files are read by one reader ----------------------------------------------------------------


def grid(**changes):
    scores = [
        {"dataset": ds, "layer": n, "dim": d, "spearman": 40.0 + n + d / 8 + (1 if ds == "a" else -1)}
        for ds in ("a", "b")
        for n in (1, 2)
        for d in (8, 32)
    ]
    average = [{"layer": n, "dim": d, "spearman": 40.0 + n + d / 8} for n in (1, 2) for d in (8, 32)]
    model = {"model": "tiny", "layers": 2, "hidden_size": 32, "pooling": "mean"}
    record = {"task": "sts", "metric": "spearman", "metrics": ["spearman"], "datasets": ["a", "b"]}
    record.update(layers=[1, 2], dims=[8, 32], scores=scores, average=average, model=model)
    record.update(changes)
    return record


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
