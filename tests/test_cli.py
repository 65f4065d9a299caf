"""The command line: info, encode, models, demo; errors come back as one line and exit code 2."""

import numpy as np

from matryoshka2d.cli import main


def test_info(tiny_dir, capsys):
    assert main(["info", str(tiny_dir), "--pooling", "cls"]) == 0
    out = capsys.readouterr().out
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert (fields["layers"], fields["hidden_size"], fields["pooling"]) == ("4", "32", "cls")


def test_encode_writes_npy(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("first sentence\nsecond one\n\nfirst sentence\n", encoding="utf-8")
    out = tmp_path / "sub" / "out.npy"
    args = ["encode", "--model", str(tiny_dir), "--pooling", "mean", "--layer", "2", "--dim", "16"]
    assert main([*args, "--input", str(src), "--output", str(out), "--normalize"]) == 0
    arr = np.load(out)
    assert arr.shape == (4, 16) and arr.dtype == np.float32
    np.testing.assert_array_equal(arr[0], arr[3])
    assert "layer 2/4, dim 16/32" in capsys.readouterr().err


def test_encode_missing_input(tiny_dir, tmp_path, capsys):
    args = ["encode", "--model", str(tiny_dir), "--pooling", "mean", "--input", str(tmp_path / "nope.txt")]
    assert main([*args, "--output", str(tmp_path / "o.npy")]) == 2
    assert "nope.txt does not exist" in capsys.readouterr().err


def test_encode_layer_out_of_range(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("x\n")
    args = ["encode", "--model", str(tiny_dir), "--pooling", "mean", "--layer", "9", "--input", str(src)]
    assert main([*args, "--output", str(tmp_path / "o.npy")]) == 2
    assert "layer 9 is out of range" in capsys.readouterr().err


def test_encode_non_utf8_input(tiny_dir, tmp_path, capsys):
    src = tmp_path / "latin1.txt"
    src.write_bytes("caf\xe9\n".encode("latin-1"))
    args = ["encode", "--model", str(tiny_dir), "--pooling", "mean", "--input", str(src)]
    assert main([*args, "--output", str(tmp_path / "o.npy")]) == 2
    assert "latin1.txt: line 1 is not UTF-8" in capsys.readouterr().err


def test_unknown_model_exit_code(capsys):
    assert main(["info", "no-such-model"]) == 2
    assert "Unknown model 'no-such-model'" in capsys.readouterr().err


def test_models_list_and_prepare_unknown(capsys):
    assert main(["models", "list"]) == 0
    assert "mpnet-base" in capsys.readouterr().out
    assert main(["models", "prepare", "bert-tiny"]) == 2
    assert "Nothing to prepare for 'bert-tiny'" in capsys.readouterr().err


def test_demo_on_tiny_model(tiny_dir, capsys):
    assert main(["demo", "--cells", "--model", str(tiny_dir), "--pooling", "mean"]) == 0
    out = capsys.readouterr().out
    assert "ms/sentence" in out
    assert [
        line.split()[0] for line in out.splitlines() if line.strip().startswith("(") and "," in line.split()[0]
    ] == [
        "(4,32)",
        "(3,24)",
        "(2,16)",
        "(1,8)",
    ]


def test_every_option_shows_its_default_once():
    """Issue 61: serve's help printed "(default: X) (default: None)": argparse's ArgumentDefaultsHelpFormatter
    appended a default to helps that said theirs already, and None where there is none. One formatter
    (cli/help.py) now formats every command: an option with a default shows it once, in its own words or appended,
    and no option shows None."""
    import argparse
    import re

    from helpers.cli import every_command
    from matryoshka2d.cli import build_parser

    with_default = 0
    for path, parser in every_command(build_parser()):
        assert "(default: None)" not in parser.format_help(), " ".join(path)
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            invocation = formatter._format_action_invocation(action)
            shown = " ".join(formatter._format_action(action).split()).removeprefix(invocation)  # the help
            said = len(re.findall(r"\bdefault", shown.lower()))
            assert said <= 1, f"{' '.join(path)} {invocation}: {shown}"
            if action.default not in (None, False, argparse.SUPPRESS):
                assert said == 1, f"{' '.join(path)} {invocation}: {shown} (its default {action.default!r}, not shown)"
                with_default += 1
    assert with_default > 50  # every command's options with a default were looked at


def test_a_list_default_is_shown_as_it_is_typed(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "STS sets for the grid (default: stsb sts16)" in out and "fine-tuning steps (default: 60)" in out


def test_an_install_hint_installs_the_extra_from_this_checkout(tmp_path):
    """Issue 61: `pip install 'matryoshka2d[onnx]'` fails, the package being on no index. The hint installs the
    extra from the checkout the package runs from, with the interpreter that runs it: pip accepts it as is (a dry
    run, offline)."""
    import shlex
    import subprocess

    from matryoshka2d.extras import CHECKOUT, install_line

    line = install_line("onnx")
    assert line.endswith(f"-m pip install -e {shlex.quote(f'{CHECKOUT}[onnx]')}"), line
    offline = ["--dry-run", "--no-deps", "--no-build-isolation", "--no-index"]
    run = subprocess.run([*shlex.split(line), *offline], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "Would install matryoshka2d" in run.stdout, run.stderr


def test_every_missing_extra_is_named_with_a_line_that_installs_it(monkeypatch):
    """qdrant, Ray and ONNX missing: each message gives the line that installs its extra from this checkout, and no
    message in src/ tells a user to install the package from an index."""
    import re
    import sys
    from pathlib import Path

    import pytest

    from matryoshka2d.export.onnx_graphs import ExportError, require_onnx
    from matryoshka2d.extras import install_line
    from matryoshka2d.retrieval.qdrant_store import require_qdrant
    from matryoshka2d.retrieval.ray_engine import require_ray
    from matryoshka2d.retrieval.shards import IndexBuildError

    for module in ("qdrant_client", "ray", "onnxruntime"):
        monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(IndexBuildError) as qdrant:
        require_qdrant()
    with pytest.raises(IndexBuildError) as ray:
        require_ray()
    with pytest.raises(ExportError) as onnx:
        require_onnx()
    for raised, extra in ((qdrant, "qdrant"), (ray, "ray"), (onnx, "onnx")):
        assert str(raised.value).endswith(install_line(extra))
    source = Path(__file__).resolve().parents[1] / "src"
    from_an_index = [
        f"{path.relative_to(source)}:{number}"
        for path in source.rglob("*.py")
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if re.search(r"pip install [^\n]*matryoshka2d\[", text)
    ]
    assert from_an_index == []


def test_cells_are_read_where_they_are_parsed_in_both_notations():
    """Issue 59: every command reads a cell through matryoshka2d.cells (3x128 or 3:128), as argparse types of
    cli/args.py, so a bad cell stops the command at parse time naming its option."""
    from matryoshka2d.cells import Cell
    from matryoshka2d.cli import build_parser

    parse = build_parser().parse_args
    search = parse(["search", "--index", "i", "--query", "q", "--cell", "3x8", "--cascade", "2:16,4x32"])
    assert search.cell == Cell(3, 8) and search.cascade == (Cell(2, 16), Cell(4, 32))
    assert parse(["index", "build", "--corpus", "c", "--output", "o", "--cells", "0:8 2x16"]).cells == [(0, 8), (2, 16)]
    retrieval = parse(["eval", "retrieval", "--output", "o", "--cascade", "1x8,4x32"])
    assert retrieval.cascade == (Cell(1, 8), Cell(4, 32))
    train = parse(["train", "--eval-cell", "1x16,2:32", "--sizes", "1:8,4:32"])
    assert train.eval_cell == [(1, 16), (2, 32)] and train.sizes == [(1, 8), (4, 32)]
    assert parse(["heads", "fit", "--data", "d", "--output", "o", "--layers", "1-3", "2,5"]).layers == [1, 2, 3, 5]
    assert parse(["report", "compression", "--output", "o", "--dims", "8", "32"]).dims == [8, 32]


def test_a_bad_cell_stops_at_parse_time_naming_its_option(capsys):
    import pytest

    from helpers.cli import error_line
    from matryoshka2d.cli import build_parser

    cases = [
        (["search", "--index", "i", "--query", "q", "--cascade", "1:8"], "argument --cascade: '1:8': give exactly two"),
        (["search", "--index", "i", "--query", "q", "--cell", "3y8"], "argument --cell: '3y8' is not a cell"),
        (["index", "build", "--corpus", "c", "--output", "o", "--cells", "2:x"], "argument --cells: cannot read cell"),
        (["index", "build", "--corpus", "c", "--output", "o", "--cells", "2:0"], "argument --cells: cell 2x0: a width"),
        (["train", "--eval-cell", "0:16"], "argument --eval-cell: cell 0x16: a layer and a width are at least 1"),
        (["eval", "retrieval", "--output", "o", "--layers", "0-1000000"], "holds 1,000,001 numbers"),
    ]
    for argv, said in cases:
        with pytest.raises(SystemExit) as stopped:
            build_parser().parse_args(argv)
        assert stopped.value.code == 2 and said in error_line(capsys), argv
