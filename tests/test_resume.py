"""Resuming never damages what is there: a finished model is never replaced by --resume, --resume and
--overwrite exclude each other, a resumed index build refuses a corpus edited in place, and a run that meets a
non-finite loss stops with its last good checkpoint kept."""

import pytest

from helpers.cli import error_line, folder_bytes, train_args
from helpers.data import UNTITLED_DOCS, write_corpus
from matryoshka2d.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_resume_never_replaces_a_finished_model(tiny_dir, files, tmp_path, capsys):
    """A finished run whose checkpoints were removed: --resume (with another --lr even) refuses, names what is
    there and --overwrite, and changes no file; --overwrite then trains afresh."""
    run = tmp_path / "run"
    assert main(train_args(tiny_dir, files, run, "--save-steps", "0", steps=2)) == 0
    assert not (run / "checkpoints").exists()
    before = folder_bytes(run)
    capsys.readouterr()
    assert main(train_args(tiny_dir, files, run, "--resume", "--lr", "0.5", steps=2)) == 2
    error_line(capsys, "--resume", "a finished model (2 steps, method plain", "no checkpoint", "--overwrite")
    assert folder_bytes(run) == before
    # Any model folder counts, not only our runs.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert main(train_args(tiny_dir, files, plain, "--resume", steps=2)) == 2
    error_line(capsys, "a saved model (config.json)")
    assert (
        main(train_args(tiny_dir, files, run, "--overwrite", "--lr", "0.5", steps=2)) == 0
    )  # not with --resume: rule 4
    assert folder_bytes(run) != before


def test_train_refuses_resume_with_overwrite(tiny_dir, triplets, sts_dev, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "train_log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # a run the flags would continue or delete
    before = folder_bytes(out)
    base = ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--steps", "1"]
    assert main([*base, "--eval-file", str(sts_dev), "--output", str(out), "--resume", "--overwrite"]) == 2
    assert "--resume and --overwrite exclude each other" in error_line(capsys)
    assert folder_bytes(out) == before


def test_a_run_stops_at_the_first_non_finite_loss_and_keeps_the_last_good_checkpoint(
    tiny_dir, triplets, sts_dev, tmp_path, monkeypatch
):
    from helpers.models import tiny_run
    from matryoshka2d.training.trainer import Trainer

    trainer = Trainer(tiny_run(tiny_dir, triplets, sts_dev, tmp_path / "run", steps=6, save_steps=2, log_every=1))
    original = trainer.objective

    def poisoned(plan, per_column, labels):
        loss, parts = original(plan, per_column, labels)
        return (loss * float("nan") if trainer.step == 2 else loss), parts  # the third step's loss

    monkeypatch.setattr(trainer, "objective", poisoned)
    with pytest.raises(ValueError, match=r"step 3: the loss is nan .*last checkpoint \(step-0000002\) is kept"):
        trainer.run(progress=False)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-0000002"]
    assert not (tmp_path / "run" / "matryoshka2d.json").exists()  # no NaN model saved


def test_a_resumed_build_refuses_a_corpus_edited_in_place(tiny_bert, tmp_path, monkeypatch, capsys):
    """Killed after two shards; one document of the first shard is edited at the same size: the resume is
    refused (it would have joined old vectors to the new text), and so is re-running a finished build."""
    from matryoshka2d.retrieval.index import IndexBuildError, build_index

    corpus = write_corpus(tmp_path / "corpus.jsonl", UNTITLED_DOCS)
    original = tiny_bert.pooled_states
    calls = []

    def dies_on_third(texts, layers, *a, **k):
        calls.append(len(texts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(texts, layers, *a, **k)

    monkeypatch.setattr(tiny_bert, "pooled_states", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)
    monkeypatch.undo()
    text = corpus.read_text()
    edited = text.replace("number 3 talks about guitars", "number 3 talks about violins")
    assert len(edited) == len(text) and edited != text
    corpus.write_text(edited)
    before = folder_bytes(tmp_path / "idx")
    with pytest.raises(IndexBuildError, match=r"changed since this build encoded it: documents 1\.\.8 \(shard 1\)"):
        build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)
    assert folder_bytes(tmp_path / "idx") == before
    corpus.write_text(text)  # restored: the build resumes and finishes
    manifest = build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)
    assert manifest["complete"] and manifest["documents"] == len(UNTITLED_DOCS)
    corpus.write_text(edited)
    with pytest.raises(IndexBuildError, match="documents 1..8"):
        build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)


def test_resume_takes_the_same_data_file_however_it_is_spelled_and_refuses_another(
    tiny_dir, files, tmp_path, monkeypatch, capsys
):
    """--resume compared the data files as written: the same file given relative, through a link or a hard link was
    "another run" and refused. They are compared by what they name (resolved, device and inode, or the bytes); a
    file of other rows is still refused, by name."""
    import os
    import shutil

    data = tmp_path / "data" / "triplets.tsv"
    data.parent.mkdir()
    shutil.copy(files / "triplets.tsv", data)
    (tmp_path / "link.tsv").symlink_to(data)
    os.link(data, tmp_path / "hard.tsv")
    run = tmp_path / "run"

    def train(spelled, *extra):
        args = train_args(tiny_dir, files, run, "--save-steps", "1", *extra, steps=2)
        return main([spelled if a == str(files / "triplets.tsv") else a for a in args])

    assert train(str(data)) == 0
    monkeypatch.chdir(tmp_path)
    for spelled in ("data/triplets.tsv", "./data/../data/triplets.tsv", "link.tsv", "hard.tsv"):
        assert train(spelled, "--resume") == 0, capsys.readouterr().err
    other = tmp_path / "other.tsv"
    other.write_text(data.read_text().replace("red", "sad"))
    capsys.readouterr()
    assert train(str(other), "--resume") == 2
    error_line(capsys, "cannot resume from", "data (checkpoint", "other.tsv")
