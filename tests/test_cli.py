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
