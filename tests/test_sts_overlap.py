"""STS test sentences kept out of fits and training: the shared NLI triplets hold some (SICK-R test shares
sentences with SICK train), so `heads fit` leaves them out by default and `train --exclude-sts-test` drops their
rows."""

import json

import numpy as np
import pytest

from helpers.cli import error_line
from helpers.data import write_sts
from helpers.models import tiny_run
from matryoshka2d.cli import main
from matryoshka2d.evaluate.sts import sentence_key, sts_test_sentence_keys
from matryoshka2d.files import DataFormatError
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training.data import DataError, read_training_data, without_rows_holding
from matryoshka2d.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_sentence_and_its_tokenised_copy_meet():
    assert sentence_key("A man's dog, running.") == sentence_key("a man 's dog , running .") == "a man s dog running"
    assert sentence_key("A man is playing guitar") != sentence_key("A man is playing a guitar")


def test_keys_come_from_every_test_set_raw_and_tokenised(tmp_path):
    root = write_sts(tmp_path / "a", {"sickr": [("There is no man riding.", "A dog runs")]})
    write_sts(root, {"sts12": [("Only tokenised here .", "x y")]}, variant="senteval_tok")
    keys = sts_test_sentence_keys(root)
    assert {"there is no man riding", "a dog runs", "only tokenised here", "sts16 left"} <= keys
    partial = write_sts(tmp_path / "b", {})
    (partial / "sts" / "raw" / "stsb_test.tsv").unlink()  # without a raw set nothing can be checked
    with pytest.raises(DataFormatError, match="stsb_test.tsv: file not found"):
        sts_test_sentence_keys(partial)


def test_rows_holding_a_key_are_dropped_with_their_labels(tmp_path):
    path = tmp_path / "n.tsv"
    path.write_text(
        "premise\thypothesis\tlabel\nA cat sat.\tx y\tentailment\np q\tr s\tneutral\nt u\ta CAT sat\tcontradiction\n"
    )
    data = read_training_data([str(path)])
    kept, dropped = without_rows_holding(data, frozenset({"a cat sat"}), sentence_key)
    assert dropped == 2 and kept.columns == [["p q"], ["r s"]] and kept.labels.tolist() == [1]
    assert without_rows_holding(data, frozenset({"nothing"}), sentence_key) == (data, 0)
    with pytest.raises(DataError, match="every row holds an excluded sentence"):
        without_rows_holding(data, frozenset({"a cat sat", "p q"}), sentence_key)


@pytest.fixture()
def leaky(tmp_path, triplets, monkeypatch):
    """Triplets of which three rows hold an STS test sentence, and a data folder with those test sets."""
    lines = triplets.read_text().splitlines()
    rows = [line.split("\t") for line in lines[1:]]
    test_pairs = [(rows[0][0].upper() + ".", "unrelated words"), (rows[5][1], rows[9][2])]
    write_sts(tmp_path / "data", {"sickr": test_pairs})
    monkeypatch.setenv("MATRYOSHKA2D_DATA", str(tmp_path / "data"))
    return triplets, {0, 5, 9}


def test_training_with_exclude_sts_test_never_sees_a_test_sentence(tiny_dir, sts_dev, leaky, tmp_path, capsys):
    data, leaked_rows = leaky
    cfg = tiny_run(tiny_dir, data, sts_dev, tmp_path / "run", steps=2, exclude_sts_test=True)
    trainer = Trainer(cfg)
    everything = read_training_data([str(data)])
    assert len(trainer.data) == len(everything) - len(leaked_rows)
    kept = {tuple(row) for row in zip(*trainer.data.columns, strict=True)}
    assert kept == {row for i, row in enumerate(zip(*everything.columns, strict=True)) if i not in leaked_rows}
    assert "exclude_sts_test: 3 rows hold an STS test sentence and are left out; 21 remain" in capsys.readouterr().out
    assert len(Trainer(tiny_run(tiny_dir, data, sts_dev, tmp_path / "all", steps=2)).data) == len(everything)


def test_training_with_exclude_sts_test_and_no_sts_data_says_what_is_missing(
    tiny_dir, triplets, sts_dev, tmp_path, monkeypatch
):
    monkeypatch.setenv("MATRYOSHKA2D_DATA", str(tmp_path))  # a folder without sts/
    cfg = tiny_run(tiny_dir, triplets, sts_dev, tmp_path / "run", steps=2, exclude_sts_test=True)
    with pytest.raises(FileNotFoundError, match="exclude_sts_test: cannot read the STS test sets to exclude"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_heads_fit_leaves_test_sentences_out_by_default(tiny_dir, leaky, tmp_path, capsys):
    data, _ = leaky
    args = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(data), "--select", "mse"]
    assert main([*args, "--output", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr()
    assert "3 sentences of the STS test sets were in --data and were left out" in printed.err
    distinct = len(dict.fromkeys(t for line in data.read_text().splitlines()[1:] for t in line.split("\t")))
    assert f"on {distinct - 3} sentences" in printed.out
    record = json.loads((tmp_path / "out" / "matryoshka2d.json").read_text())["exit_heads"]["made"]
    assert record["sts_test_sentences_left_out"] == 3
    assert main([*args, "--no-exclude-sts-test", "--output", str(tmp_path / "all"), "--quiet"]) == 0
    assert f"on {distinct} sentences" in capsys.readouterr().out
    kept = ElasticEncoder(str(tmp_path / "all"), device="cpu").exit_heads.record
    assert kept["sts_test_sentences_left_out"] is None


def test_heads_fit_asked_to_exclude_without_sts_data_refuses_and_writes_nothing(
    tiny_dir, triplets, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("MATRYOSHKA2D_DATA", str(tmp_path))
    args = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--select", "mse"]
    assert main([*args, "--exclude-sts-test", "--output", str(tmp_path / "h")]) == 2
    assert "--exclude-sts-test: cannot read the STS test sets" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
    assert main([*args, "--output", str(tmp_path / "d"), "--quiet"]) == 0  # the default goes on, and says so
    assert "STS test sentences are not left out" in capsys.readouterr().err
    assert np.isfinite(ElasticEncoder(str(tmp_path / "d"), device="cpu").encode(["a b c"], layer=1)).all()


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
