"""Training data readers: kinds from headers, several files, and malformed rows named by file and line."""

import json

import pytest

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
