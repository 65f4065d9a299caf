"""Every option is checked where it is parsed (docs/reliability.md, rule 4): typed converters of cli/args.py
refuse a bad number, list, range or --max-length with the option's name, exit 2, before anything loads."""

import argparse

import pytest

from helpers.cli import error_line, every_command, exit_code
from matryoshka2d.cli import build_parser, main
from matryoshka2d.cli.args import named_folder


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


def test_eval_refuses_an_empty_item_in_dims(model, tmp_path, capsys):
    args = ["eval", "sts", "--model", str(model), "--pooling", "mean", "--dims", "16,,32"]
    assert exit_code([*args, "--output", tmp_path / "o"]) == 2  # refused where it is parsed
    assert "argument --dims: '16,,32' holds an empty item" in error_line(capsys)


def test_eval_max_length_must_be_positive(tiny_dir, tmp_path, capsys):
    args = ["eval", "sts", "--model", str(tiny_dir), "--pooling", "mean", "--max-length", "-5"]
    assert exit_code([*args, "--output", str(tmp_path / "o")]) == 2
    error_line(capsys, "--max-length: must be at least 1", "-5")


# ---- --max-length and ranges -----------------------------------------------------------------------------------------


def max_length_options():
    return [
        (" ".join(words), action)
        for words, parser in every_command(build_parser())
        for action in parser._actions
        if "--max-length" in action.option_strings
    ]


def test_every_max_length_leaves_room_for_a_token_of_text():
    """Every --max-length of every command: 2 leaves only [CLS] and [SEP] (every text the same vector), and 1 is
    ignored by the tokenizer (texts go in whole); both are refused where they are parsed."""
    options = max_length_options()
    assert len(options) >= 7  # eval x3, train, two-step, pretrain, distill, index build, serve
    accepted = []
    for command, action in options:
        for value in ("1", "2"):
            try:
                action.type(value)
                accepted.append(f"{command} --max-length {value}")
            except argparse.ArgumentTypeError as refused:
                assert "must be at least 3" in str(refused) and "[CLS] and [SEP]" in str(refused), command
        assert action.type("3") == 3, command
    assert not accepted, f"give these --max-length options type=matryoshka2d.cli.args.token_length: {accepted}"


def test_a_max_length_of_2_stops_at_parse_time_naming_the_option(tiny_dir, capsys):
    assert exit_code(["eval", "sts", "--model", tiny_dir, "--max-length", "2", "--output", "o"]) == 2
    line = error_line(capsys)
    assert "argument --max-length: must be at least 3, got 2" in line and "no token of text" in line
    assert exit_code(["eval", "sts", "--max-length", "-5", "--output", "o"]) == 2
    assert "argument --max-length: must be at least 1, got -5" in error_line(capsys)  # as before


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["eval", "sts", "--output", "o", "--layers", "3-1"], "--layers", "3-1"),
        (["eval", "classification", "--output", "o", "--layers", "1", "4-2"], "--layers", "4-2"),
        (["eval", "retrieval", "--output", "o", "--dims", "8,32-16"], "--dims", "32-16"),
        (["eval", "retrieval", "--output", "o", "--query-layer", "3-1"], "--query-layer", "3-1"),
        (["heads", "fit", "--data", "d", "--output", "o", "--layers", "3-1"], "--layers", "3-1"),
        (["report", "compression", "--output", "o", "--dims", "32-8", "64"], "--dims", "32-8"),
    ],
    ids=lambda a: a if isinstance(a, str) else " ".join(a[:2]),
)
def test_a_reversed_range_stops_at_parse_time(capsys, argv, flag, value):
    """A range LOW-HIGH with LOW > HIGH held no number: the option fell back to its default, silently."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2
    line = error_line(capsys)
    low, high = value.split("-")
    assert f"argument {flag}: '{value}' is a reversed range" in line and f"write {high}-{low}" in line, line


def test_a_malformed_layer_list_stops_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "sts", "--output", "o", "--layers", "a"])
    assert "argument --layers: 'a' is not a whole number or a range like 1-6" in error_line(capsys)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "sts", "--output", "o", "--layers", "-1"])
    assert "argument --layers: '-1': layers start at 0, got -1" in error_line(capsys)


def test_ranges_still_read_as_before():
    """The same inputs as before, now read into numbers where they are parsed (cli.args.layer_list and width_list,
    matryoshka2d.cells.parse_numbers): the command gets one list."""
    args = build_parser().parse_args(["eval", "sts", "--output", "o", "--layers", "1,3-4", "6", "--dims", "8-8"])
    assert args.layers == [1, 3, 4, 6] and args.dims == [8]
    args = build_parser().parse_args(["eval", "retrieval", "--output", "o", "--query-layer", "0", "2"])
    assert args.query_layer == [0, 2]  # 0: the static cell's queries


# ---- --query-model NAME=FOLDER ---------------------------------------------------------------------------------------


def test_a_query_model_splits_at_the_first_equals_sign_after_a_plain_name(tiny_dir, tmp_path, capsys):
    assert named_folder("q=/runs/a=b/q") == ("q", "/runs/a=b/q")
    assert named_folder("/runs/a=b/q") == ("", "/runs/a=b/q")
    assert named_folder("runs/a=b") == ("", "runs/a=b")
    folder = tmp_path / "a=b" / "q"
    args = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0", "--query-model", f"q={folder}"]
    assert main(args) == 2
    assert f"--query-model {folder}: not a query encoder" in error_line(capsys)  # the whole folder, not 'b/q'


def test_a_query_model_written_the_wrong_way_round_names_the_real_cause(tiny_dir, capsys):
    """--query-model DIR/tiny=q (the name after the folder) and =q (no name) were read as folders named so and
    refused as "not a query encoder"; a path holding '=' still reads whole (see the test above)."""
    from matryoshka2d.cli.args import named_folder

    with pytest.raises(argparse.ArgumentTypeError, match=f"the name goes before the folder: write q={tiny_dir}"):
        named_folder(f"{tiny_dir}=q")
    with pytest.raises(argparse.ArgumentTypeError, match="no name before '='"):
        named_folder("=q")
    serve = ["serve", "--model", tiny_dir, "--pooling", "mean", "--port", "0", "--query-model"]
    assert exit_code([*serve, f"{tiny_dir}=q"]) == 2
    line = error_line(capsys)
    assert f"--query-model '{tiny_dir}=q': no folder of that name; the name goes before the folder" in line, line
    assert exit_code([*serve, "=q"]) == 2
    assert "--query-model '=q': no name before '='" in error_line(capsys)


def test_a_folder_whose_name_holds_an_equals_sign_is_still_a_folder(tmp_path, monkeypatch):
    from matryoshka2d.cli.args import named_folder

    (tmp_path / "=q").mkdir()
    (tmp_path / "runs" / "tiny=q").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert named_folder("=q") == ("", "=q")
    assert named_folder("runs/tiny=q") == ("", "runs/tiny=q")
