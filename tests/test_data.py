"""Training data readers: kinds from headers, several files, and malformed rows named by file and line."""

import json

import pytest

from helpers.cli import error_line, train_args
from matryoshka2d.cli import main
from matryoshka2d.training.data import DataError, read_sentences, read_training_data


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_triplets_nli_and_scored(tmp_path):
    t = read_training_data([write(tmp_path, "t.tsv", "anchor\tpositive\tnegative\na\tb\tc\nd\te\tf\n")])
    assert t.kind == "triplets" and t.columns == [["a", "d"], ["b", "e"], ["c", "f"]] and t.labels is None
    n = read_training_data(
        [write(tmp_path, "n.tsv", "premise\thypothesis\tlabel\np\th\tentailment\nq\tr\tContradiction\n")]
    )
    assert n.kind == "nli" and n.labels.tolist() == [0, 2]
    s = read_training_data([write(tmp_path, "s.tsv", "sentence1\tsentence2\tscore\tgenre\nx\ty\t4.5\tnews\n")])
    assert s.kind == "scored" and s.labels.tolist() == [4.5]


def test_anchor_positive_pairs_are_a_kind_of_their_own(tmp_path):
    t = read_training_data([write(tmp_path, "p.tsv", "anchor\tpositive\nq1\td1\nq2\td2\n")])
    assert t.kind == "pairs" and t.columns == [["q1", "q2"], ["d1", "d2"]] and t.labels is None
    j = read_training_data([write(tmp_path, "p.jsonl", json.dumps({"anchor": "q", "positive": "d"}) + "\n")])
    assert j.kind == "pairs" and j.columns == [["q"], ["d"]]
    with pytest.raises(DataError, match="p.tsv:3: empty 'positive'"):
        read_training_data([write(tmp_path, "p.tsv", "anchor\tpositive\nq1\td1\nq2\t \n")])


def test_several_files_are_concatenated(tmp_path):
    a = write(tmp_path, "a.tsv", "anchor\tpositive\tnegative\na\tb\tc\n")
    b = write(tmp_path, "b.jsonl", json.dumps({"anchor": "d", "positive": "e", "negative": "f"}) + "\n")
    data = read_training_data([a, b])
    assert len(data) == 2 and data.sources == [a, b]
    cols, labels = data.rows([1])
    assert cols == [["d"], ["e"], ["f"]] and labels is None


def test_mixed_kinds_are_refused(tmp_path):
    a = write(tmp_path, "a.tsv", "anchor\tpositive\tnegative\na\tb\tc\n")
    b = write(tmp_path, "b.tsv", "sentence1\tsentence2\tscore\nx\ty\t1\n")
    with pytest.raises(DataError, match="holds scored data but .*a.tsv holds triplets"):
        read_training_data([a, b])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("anchor\tpositive\tnegative\na\tb\n", r"bad.tsv:2: 2 tab-separated columns, the header has 3"),
        ("anchor\tpositive\tnegative\na\tb\tc\nd\t\tf\n", r"bad.tsv:3: empty 'positive'"),
        ("sentence1\tsentence2\tscore\nx\ty\thigh\n", r"bad.tsv:2: score 'high' is not a number"),
        ("premise\thypothesis\tlabel\nx\ty\tmaybe\n", r"bad.tsv:2: label 'maybe' is not one of"),
        ("text\tlabel\nx\t1\n", r"bad.tsv:1: cannot tell the kind of data"),
        ("", r"bad.tsv: empty file"),
        ("anchor\tpositive\tnegative\n", r"bad.tsv: no rows after the header"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, text, message):
    with pytest.raises(DataError, match=message):
        read_training_data([write(tmp_path, "bad.tsv", text)])


def test_malformed_jsonl(tmp_path):
    path = write(tmp_path, "bad.jsonl", '{"anchor": "a", "positive": "b", "negative": "c"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_training_data([path])


def test_missing_file_and_no_data(tmp_path):
    with pytest.raises(DataError, match="nope.tsv: no such file"):
        read_training_data([str(tmp_path / "nope.tsv")])
    with pytest.raises(DataError, match="no training data given"):
        read_training_data([])


def test_read_sentences(tmp_path):
    assert read_sentences(write(tmp_path, "s.txt", "one\n\n two \n")) == ["one", "two"]
    pairs = write(tmp_path, "p.tsv", "premise\thypothesis\tlabel\na\tb\tneutral\na\tc\tentailment\n")
    assert read_sentences(pairs) == ["a", "b", "c"]
    with pytest.raises(DataError, match="no sentences"):
        read_sentences(write(tmp_path, "e.txt", "\n\n"))


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
    error_line(capsys, "scored.tsv:3", "score 50 is outside 0..5")


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
        error_line(capsys, "huge.tsv:3", "csv field limit")
