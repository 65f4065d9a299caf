"""`encode`: lines split on newlines only, the name it writes, streaming in chunks (a file or standard input),
the line that is not UTF-8, bad devices, and Ctrl-C in the middle."""

import os

import numpy as np
import pytest

from helpers.cli import error_line, exit_code
from helpers.data import WORDS
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder

pytestmark = pytest.mark.usefixtures("one_thread")


def encode_args(tiny_dir, src, out, *extra):
    return ["encode", "--model", str(tiny_dir), "--pooling", "mean", "--input", str(src), "--output", str(out), *extra]


def test_encode_splits_lines_on_newlines_only(tiny_dir, tmp_path, capsys):
    texts = ["one\u2028still one", "two\x85still two", "three\x0cstill three", "four\rstill four"]
    src = tmp_path / "in.txt"
    src.write_bytes(("\n".join(texts) + "\r\n").encode("utf-8"))
    assert main(encode_args(tiny_dir, src, tmp_path / "v.npy")) == 0
    got = np.load(tmp_path / "v.npy")
    expected = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu").encode(texts)
    assert got.shape == (4, 32)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_encode_prints_the_name_it_writes(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n")
    assert main(encode_args(tiny_dir, src, tmp_path / "out")) == 0
    assert (tmp_path / "out.npy").is_file() and not (tmp_path / "out").exists()
    assert f"-> {tmp_path / 'out.npy'} (2, 32)" in capsys.readouterr().err


def test_encode_streams_in_chunks_with_the_same_result(tiny_dir, tmp_path, monkeypatch, capsys):
    import io
    import sys

    from matryoshka2d.models import encode_file as cli  # the command's streaming (models/encode_file.py)

    texts = [f"{w} number {i}" for i, w in enumerate(WORDS * 2)] + ["", "red"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    expected = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu").encode(texts, layer=2, dim=8)
    monkeypatch.setattr(cli, "ENCODE_CHUNK", 5)
    monkeypatch.setattr(cli, "TOKEN_BUDGET", 12)  # long texts in smaller batches than --batch-size
    assert main(encode_args(tiny_dir, src, tmp_path / "v.npy", "--layer", "2", "--dim", "8")) == 0
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), expected, atol=1e-6)
    # Standard input, with a byte-order mark: the same vectors.
    stdin = io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbf" + src.read_bytes()), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(encode_args(tiny_dir, "-", tmp_path / "s.npy", "--layer", "2", "--dim", "8")) == 0
    np.testing.assert_allclose(np.load(tmp_path / "s.npy"), expected, atol=1e-6)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(encode_args(tiny_dir, empty, tmp_path / "e.npy")) == 0
    assert np.load(tmp_path / "e.npy").shape == (0, 32)
    assert exit_code(encode_args(tiny_dir, src, tmp_path / "b.npy", "--batch-size", "0")) == 2
    error_line(capsys, "--batch-size: must be at least 1")


def test_encode_names_the_non_utf8_line(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_bytes(b"fine\n" * 5000 + "caf\xe9\n".encode("latin-1"))
    assert main(encode_args(tiny_dir, src, tmp_path / "v.npy")) == 2
    error_line(capsys, "in.txt: line 5001 is not UTF-8", "0xe9")
    assert not (tmp_path / "v.npy").exists()


def test_encode_device_errors(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a\n")
    assert main(encode_args(tiny_dir, src, tmp_path / "v.npy", "--device", "bogus")) == 2
    error_line(capsys, "--device bogus")


def test_ctrl_c_during_encode_is_one_line_and_leaves_no_half_file(tiny_dir, texts, tmp_path, capsys, monkeypatch):
    """Was: a KeyboardInterrupt traceback, and OUTPUT's `.partial` file left behind."""
    from matryoshka2d.models import encode_file as encode  # the command's streaming

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(encode, "encode_chunk", interrupted)
    out = tmp_path / "out"
    argv = ["encode", "--model", tiny_dir, "--pooling", "mean", "--input", texts, "--output", out / "v.npy"]
    assert exit_code(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    said = [line for line in err.splitlines() if line.startswith("matryoshka2d")]
    assert len(said) == 1 and said[0].startswith("matryoshka2d encode: interrupted (Ctrl-C)"), err
    assert not out.exists() or os.listdir(out) == []


# ---- an input that changes while it is read ------------------------------------------------------------------------


def cut(src):
    os.truncate(src, src.stat().st_size // 2)  # inside a line: fewer lines than counted


def grown(src):
    with src.open("a", encoding="utf-8") as f:
        f.write("one more line\n")


def rewritten(src):
    data, before = src.read_bytes(), src.stat()
    src.write_bytes(data.replace(b" ", b"\n", 1))  # the same size, a line more
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))  # within one tick of the file system's clock


def edited(src):
    data, before = src.read_bytes(), src.stat()
    src.write_bytes(data.replace(b"number", b"NUMBER", 1))  # the same size and lines, another text
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # a second later, as a clock of any tick says


def replaced(src):
    other = src.with_name("other.txt")
    other.write_bytes(src.read_bytes())  # the same text, in another file put in its place
    os.replace(other, src)


def cut_inside_a_character(src):
    data = src.read_bytes()
    os.truncate(src, data.index("é".encode()) + 1)  # the first byte of a two-byte character is the last


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (cut, ["its size went from"]),
        (grown, ["its size went from"]),
        (rewritten, ["40 lines when counted, 41 when encoded"]),
        (edited, ["it was written to (its modification time changed)"]),
        (replaced, ["another file was put in its place"]),
        (cut_inside_a_character, ["its size went from"]),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_an_input_changed_while_encode_reads_it_is_named_and_nothing_is_written(
    tiny_dir, tmp_path, monkeypatch, capsys, change, said
):
    """Was: the lines were counted for the .npy header, then encoded in a second pass; a file cut between them gave
    a short array renamed into place under the full header (np.load then fails), a grown one rows the header hid.
    The change is made where the command loads its model, between the two passes."""
    from matryoshka2d.cli import encode as command

    src = tmp_path / "in" / "texts.txt"
    src.parent.mkdir()
    src.write_text("".join(f"text number {k} about a café\n" for k in range(40)), encoding="utf-8")
    load = command._encoder

    def changing_then_loading(args):
        change(src)
        return load(args)

    monkeypatch.setattr(command, "_encoder", changing_then_loading)
    out = tmp_path / "out"
    out.mkdir()
    assert main(encode_args(tiny_dir, src, out / "v.npy")) == 2
    line = error_line(capsys, f"--input {src} changed while it was read", "no .npy was written")
    assert any(what in line for what in said), line
    assert os.listdir(out) == []
