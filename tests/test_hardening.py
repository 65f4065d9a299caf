"""User mistakes get a one-line error (exit 2) before the first step, never a traceback or a silently wrong run;
the final save is atomic. The cases of issue 12, lists 2, 4, 5 and 6 (docs/reliability.md)."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import WORDS
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training import checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def train_args(tiny_dir, files, out, *extra):
    args = ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(files / "triplets.tsv")]
    args += ["--eval-file", str(files / "dev.tsv"), "--batch-size", "8", "--steps", "1", "--output", str(out)]
    return [*args, *extra]


def exit_code(args) -> int:
    """main's exit code, whether the command returned it or argparse exited with it (an option refused where it
    is parsed)."""
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


def one_line_error(capsys, *needles) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- before the first step ----------------------------------------------------------------------------------


def test_a_bad_eval_file_fails_before_the_first_step(tiny_dir, files, tmp_path, capsys):
    out = tmp_path / "run"
    args = train_args(tiny_dir, files, out)
    args[args.index("--eval-file") + 1] = str(tmp_path / "typo.tsv")
    assert main(args) == 2
    one_line_error(capsys, "--eval-file", "typo.tsv")
    assert not out.exists()  # no step ran, nothing was written


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        # refused where they are parsed (rule 4): argparse's one line, exit 2
        (["--batch-size", "0"], ["--batch-size: must be at least 1, got 0"]),
        (["--steps", "0"], ["--steps: must be at least 1, got 0"]),
        (["--steps", "-1"], ["--steps: must be at least 1, got -1"]),
        (["--epochs", "0"], ["--epochs: must be greater than 0"]),
        (["--max-length", "-5"], ["--max-length: must be at least 1, got -5"]),
        (["--lr", "-1"], ["--lr: must be greater than 0"]),
        (["--warmup-ratio", "2"], ["--warmup-ratio: must be from 0 to 1"]),
        (["--device", "bogus"], ["--device bogus", "cpu"]),
        (["--eval-cell", "9:8"], ["layer 9 is out of range"]),
    ],
)
def test_bad_options_fail_before_the_first_step(tiny_dir, files, tmp_path, capsys, extra, needles):
    out = tmp_path / "run"
    assert exit_code(train_args(tiny_dir, files, out, *extra)) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_device_cuda_without_a_gpu(tiny_dir, files, tmp_path, capsys):
    assert main(train_args(tiny_dir, files, tmp_path / "run", "--device", "cuda")) == 2
    one_line_error(capsys, "--device cuda", "no CUDA GPU", "--device cpu")


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("steps: [1, 2\nlr: 0.1\n", ["line", "not valid YAML"]),
        ('method: ese\nmethod_options: "k=3"\n', ["method_options must be a mapping", "k=3"]),
        ("- steps\n- 3\n", ["expected a mapping"]),
        ("steps: 0\n", ["--steps must be at least 1"]),
    ],
)
def test_bad_config_files(tiny_dir, files, tmp_path, capsys, text, needles):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    args = ["train", "--config", str(cfg), "--model", str(tiny_dir), "--pooling", "mean"]
    args += [
        "--data",
        str(files / "triplets.tsv"),
        "--eval-file",
        str(files / "dev.tsv"),
        "--output",
        str(tmp_path / "o"),
    ]
    assert main(args) == 2
    one_line_error(capsys, *needles)


def test_an_output_that_is_a_file_or_taken_is_refused_before_the_model_loads(
    tiny_dir, files, tmp_path, capsys, monkeypatch
):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --output was checked")

    monkeypatch.setattr("matryoshka2d.training.trainer.ElasticEncoder", no_model)
    out = tmp_path / "file"
    out.write_text("x")
    assert main(train_args(tiny_dir, files, out)) == 2
    one_line_error(capsys, "is a file")
    taken = tmp_path / "run"
    taken.mkdir()
    (taken / "train_log.jsonl").write_text("")
    assert main(train_args(tiny_dir, files, taken)) == 2
    one_line_error(capsys, "already holds a model or a run")
    pretrain = ["pretrain", "--model", str(tiny_dir), "--data", str(files / "triplets.tsv"), "--output", str(taken)]
    assert main(pretrain) == 2
    one_line_error(capsys, "already holds a model or a run")


# ---- the atomic final save ----------------------------------------------------------------------------------


class Killed(Exception):
    pass


def snapshot(folder: Path) -> dict:
    """Contents of the model files (what a loader reads), ignoring hidden temporary folders."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


def loads(folder: Path) -> bool:
    """Either loader takes the folder (sentence-transformers is asked only when ours refuses: the answer is the
    same, any of the two, and a load takes a while)."""
    from sentence_transformers import SentenceTransformer

    try:
        ElasticEncoder(str(folder), device="cpu")
        return True
    except Exception:
        pass
    try:
        SentenceTransformer(str(folder), device="cpu")
        return True
    except Exception:
        return False


def test_a_killed_final_save_leaves_the_old_model_no_model_or_the_new_one(tiny_dir, tmp_path, monkeypatch):
    """Kill the save at every file operation in turn: whatever loads is exactly the old or the new model."""
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    old.add_pooler(8, seed=1)  # the old model has a pooler head, the new one none: a stale head must not survive
    old.save(old_dir, metadata={"which": "old"})
    new = ElasticEncoder(str(tiny_dir), pooling="cls", device="cpu")
    with torch.no_grad():
        new.model.embeddings.word_embeddings.weight.mul_(2)
    new.tokenizer.model_max_length = 77  # and another tokenizer config
    new.save(new_dir, metadata={"which": "new"})
    expected_old, expected_new = snapshot(old_dir), snapshot(new_dir)
    assert expected_old != expected_new

    def save(folder):
        new.save(folder, metadata={"which": "new"})

    real_replace, real_unlink, real_rmtree = os.replace, Path.unlink, shutil.rmtree
    outcomes = []
    for kill_at in range(40):
        out = tmp_path / f"out-{kill_at}"
        shutil.copytree(old_dir, out)
        (out / "train_log.jsonl").write_text('{"step": 1}\n')
        calls = [0]

        def counted(real, kill_at=kill_at, out=out, calls=calls):
            def wrapper(path, *args, **kwargs):
                target = args[0] if real is real_replace else path  # os.replace(src, dst): the destination
                inside = str(target).startswith(str(out)) and ".saving-model" not in Path(target).relative_to(out).parts
                if inside or str(target) == str(out / ".saving-model"):
                    if calls[0] == kill_at:
                        raise Killed
                    calls[0] += 1
                return real(path, *args, **kwargs)

            return wrapper

        monkeypatch.setattr(os, "replace", counted(real_replace))
        monkeypatch.setattr(Path, "unlink", counted(real_unlink))
        monkeypatch.setattr(shutil, "rmtree", counted(real_rmtree))
        try:
            checkpoints.save_model_atomically(save, out)
            finished = True
        except Killed:
            finished = False
        finally:
            monkeypatch.undo()
        state = snapshot(out)
        state.pop("train_log.jsonl")
        if loads(out):
            assert state in (expected_old, expected_new), f"killed at operation {kill_at}: a mixed model loads"
            outcomes.append("old" if state == expected_old else "new")
        else:
            outcomes.append("none")
        assert (out / "train_log.jsonl").is_file()
        if finished:
            assert state == expected_new and not (out / ".saving-model").exists()
            break
    assert outcomes[0] == "old" and outcomes[-1] == "new" and "none" in outcomes


# ---- encode: lines, names, streaming --------------------------------------------------------------------------


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

    from matryoshka2d.cli import encode as cli

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
    one_line_error(capsys, "--batch-size: must be at least 1")


def test_encode_names_the_non_utf8_line(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_bytes(b"fine\n" * 5000 + "caf\xe9\n".encode("latin-1"))
    assert main(encode_args(tiny_dir, src, tmp_path / "v.npy")) == 2
    one_line_error(capsys, "in.txt: line 5001 is not UTF-8", "0xe9")
    assert not (tmp_path / "v.npy").exists()


# ---- readers: BOM, non-UTF-8, huge fields, score ranges ---------------------------------------------------------


BOM = "\ufeff"


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    from matryoshka2d.evaluate.sts import load_pairs
    from matryoshka2d.training.data import read_sentences, read_training_data

    tsv = tmp_path / "t.tsv"
    tsv.write_text(BOM + "sentence1\tsentence2\tscore\nred cat\tblue dog\t1\nbig bird\tbig bird\t5\n", encoding="utf-8")
    assert read_training_data([str(tsv)]).kind == "scored"
    assert read_sentences(tsv) == ["red cat", "blue dog", "big bird"]  # the pretrain / simcse reader
    assert load_pairs(tsv).sentences1 == ["red cat", "big bird"]
    txt = tmp_path / "s.txt"
    txt.write_text(BOM + "first\nsecond\n", encoding="utf-8")
    assert read_sentences(txt) == ["first", "second"]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(BOM + '{"anchor": "a", "positive": "b", "negative": "c"}\n', encoding="utf-8")
    assert read_training_data([str(jsonl)]).kind == "triplets"


def test_readers_name_the_non_utf8_line(tmp_path):
    from matryoshka2d.training.data import DataError, read_sentences, read_training_data

    tsv = tmp_path / "t.tsv"
    tsv.write_bytes(b"anchor\tpositive\tnegative\n" + b"a\tb\tc\n" * 3000 + "caf\xe9\tb\tc\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"t.tsv:3002: not UTF-8 text \(byte 0xe9"):
        read_training_data([str(tsv)])
    with pytest.raises(DataError, match=r"t.tsv:3002: not UTF-8"):
        read_sentences(tsv)
    from matryoshka2d.evaluate.sts import load_pairs

    sts = tmp_path / "dev.tsv"
    sts.write_bytes(b"sentence1\tsentence2\tscore\na\tb\t1\n" + "caf\xe9\tb\t2\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"dev.tsv:3: not UTF-8"):
        load_pairs(sts)


def test_sts_training_scores_outside_0_to_5_are_refused(tiny_dir, files, tmp_path, capsys):
    tsv = tmp_path / "scored.tsv"
    tsv.write_text("sentence1\tsentence2\tscore\nred cat\tblue dog\t1\nbig bird\tbig bird\t50\n")
    args = train_args(tiny_dir, files, tmp_path / "run")
    args[args.index("--data") + 1] = str(tsv)
    assert main(args) == 2
    one_line_error(capsys, "scored.tsv:3", "score 50 is outside 0..5")


@pytest.fixture
def huge_field(tmp_path):
    path = tmp_path / "huge.tsv"
    path.write_text("anchor\tpositive\tnegative\nred cat\tred cats\tblue dog\n" + "x" * 1_000_000 + "\tb\tc\n")
    return path


def test_a_one_megabyte_field_is_a_clear_error_in_train_pretrain_and_two_step(tiny_dir, files, huge_field, capsys):
    out = huge_field.parent
    args = train_args(tiny_dir, files, out / "run")
    args[args.index("--data") + 1] = str(huge_field)
    pretrain = ["pretrain", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(huge_field)]
    pretrain += ["--steps", "1", "--sizes", "1:16", "--output", str(out / "smae"), "--quiet"]
    two_step = ["two-step", "--model", str(tiny_dir), "--pooling", "mean", "--target-dim", "8", "--candidate-dims"]
    two_step += ["8", "--data", str(huge_field), "--loss", "simcse", "--steps", "1", "--output", str(out / "two")]
    two_step += ["--validation-file", str(files / "dev.tsv"), "--report-file", str(files / "dev.tsv"), "--quiet"]
    commands = [args, pretrain, two_step]
    for command in commands:
        assert main(command) == 2, command[0]
        one_line_error(capsys, "huge.tsv:3", "csv field limit")


def test_eval_max_length_must_be_positive(tiny_dir, tmp_path, capsys):
    args = ["eval", "sts", "--model", str(tiny_dir), "--pooling", "mean", "--max-length", "-5"]
    assert exit_code([*args, "--output", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--max-length: must be at least 1", "-5")


def test_classification_warns_about_test_labels_absent_from_train(tmp_path):
    from matryoshka2d.evaluate.classification import load_dataset, unseen_labels

    rows = "sentence\tlabel\n" + "".join(f"text {i}\t{'pos' if i % 2 else 'neg'}\n" for i in range(6))
    (tmp_path / "x_train.tsv").write_text(rows)
    (tmp_path / "x_test.tsv").write_text("sentence\tlabel\na\tPos\nb\tneg\nc\tother\n")
    ds = load_dataset("x", {"train": tmp_path / "x_train.tsv", "test": tmp_path / "x_test.tsv"})
    warning = unseen_labels(ds)
    assert "2 of 3 rows" in warning and "'Pos'" in warning and "'other'" in warning
    assert "differ only in case: 'Pos' vs train 'pos'" in warning
    (tmp_path / "x_test.tsv").write_text("sentence\tlabel\na\tpos\nb\tneg\n")
    assert (
        unseen_labels(load_dataset("x", {"train": tmp_path / "x_train.tsv", "test": tmp_path / "x_test.tsv"})) is None
    )


def test_encode_device_errors(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a\n")
    assert main(encode_args(tiny_dir, src, tmp_path / "v.npy", "--device", "bogus")) == 2
    one_line_error(capsys, "--device bogus")
