"""Run folders, checkpoints and indexes: the one writer and the one confined reader on them (issue 52, items 1-3).

Writes: every file a run or an index build leaves was written under a temporary name of the writer and renamed
(checked with an audit hook on `open`); a `checkpoints/` or `shards/` that is a link to another run's or build's is
refused, that folder byte for byte intact; a link in a file's place is replaced, never written through. Reads: a
run, checkpoint or index folder holding a link that leaves it is refused before anything in it is opened.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers.audit import opened_for_writing, opened_under, recording
from helpers.cli import folder_entries, sole_line
from helpers.data import write_corpus
from matryoshka2d.cli import main
from matryoshka2d.confined import OutsideFolderError
from matryoshka2d.outputs import TEMPORARY_MARK, OutputError, is_writer_temporary
from matryoshka2d.retrieval.index import IndexBuildError, build_index
from matryoshka2d.retrieval.search import CellIndex
from matryoshka2d.training import checkpoints
from matryoshka2d.training.rundir import RunDir

DOCS = [{"_id": f"d{i}", "text": f"document {i} about {w}"} for i, w in enumerate(["cats", "dogs", "rain"] * 4)]


# ---- run folders and checkpoints -------------------------------------------------------------------------------------


def other_run(tmp_path: Path) -> Path:
    """Another run's folder: a log and a checkpoint (bytes that must survive)."""
    other = tmp_path / "other-run"
    step = other / "checkpoints" / "step-0000003"
    step.mkdir(parents=True)
    for name in (checkpoints.TENSORS, checkpoints.STATE, checkpoints.CONFIG, checkpoints.MANIFEST):
        (step / name).write_bytes(f"the other run's {name}".encode())
    (other / "train_log.jsonl").write_text('{"step": 3, "loss": 0.5}\n')
    return other


def run_linked_to(tmp_path: Path, other: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
    return run


@pytest.mark.parametrize(
    ("command", "how"), [("train", "--overwrite"), ("train", "--resume"), ("pretrain", "--overwrite")]
)
def test_a_run_whose_checkpoints_link_to_another_runs_is_refused_and_that_run_kept(
    tiny_dir, files, tmp_path, capsys, command, how
):
    """Was: --overwrite deleted the other run's checkpoints through the link, --resume read and replaced them."""
    other = other_run(tmp_path)
    before = folder_entries(other)
    run = run_linked_to(tmp_path, other)
    args = [command, "--model", str(tiny_dir), "--pooling", "mean", "--data", str(files / "triplets.tsv")]
    args += ["--eval-file", str(files / "dev.tsv"), "--batch-size", "8", "--steps", "1", "--output", str(run), how]
    assert main(args) == 2
    err = sole_line(capsys)
    assert f"{run / 'checkpoints'} is a symbolic link" in err and "--output" in err
    assert folder_entries(other) == before
    assert (run / "checkpoints").is_symlink() and (run / "train_log.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def tiny_training_state():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return {"encoder": module}, optimizer, scheduler


def save(run: RunDir, step: int, keep: int = 2) -> Path:
    modules, optimizer, scheduler = tiny_training_state()
    return run.save_checkpoint(step, modules, optimizer, scheduler, [], {"step": step}, None, keep=keep)


def test_the_run_folder_library_refuses_a_linked_checkpoints_folder(tmp_path):
    """Without a command around it too: clear_run, save_checkpoint and load_latest never follow the link."""
    other = other_run(tmp_path)
    before = folder_entries(other)
    run = RunDir(run_linked_to(tmp_path, other))
    with pytest.raises(OutputError, match="symbolic link"):
        run.clear_run()
    with pytest.raises(OutputError, match="symbolic link"):
        save(run, 4)
    with pytest.raises(checkpoints.CheckpointError, match="symbolic link"):
        checkpoints.load_latest(run.checkpoints, "cpu")
    with pytest.raises(OutputError, match="symbolic link"):
        run.check(resume=True, overwrite=False)
    assert folder_entries(other) == before


def test_checkpoints_are_written_under_temporary_names_and_old_ones_pruned_without_following_links(tmp_path):
    """Every checkpoint file is written under the writer's temporary name and renamed (was: state.json and the
    manifest written in place in .tmp-step-N); pruning removes a link named like a checkpoint as a link."""
    other = other_run(tmp_path)
    before = folder_entries(other)
    run = RunDir(tmp_path / "run")
    (run.checkpoints).mkdir(parents=True)
    (run.checkpoints / "step-0000000").symlink_to(other / "checkpoints" / "step-0000003", target_is_directory=True)
    (run.checkpoints / ".step-0000001.m2d-tmp-left").mkdir()  # what a killed save left
    with recording() as opens:
        save(run, 1)
        save(run, 2)
    written = opened_for_writing(opens)
    assert written and all(is_writer_temporary(p) for p in written), written
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-0000001", "step-0000002"]
    assert folder_entries(other) == before
    folder, state = checkpoints.load_latest(run.checkpoints, "cpu")
    assert folder.name == "step-0000002" and state["step"] == 2


def test_a_checkpoint_holding_a_link_out_is_skipped_without_opening_the_link(tmp_path):
    run = RunDir(tmp_path / "run")
    save(run, 1)
    save(run, 2)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (run.checkpoints / "step-0000002" / "notes.txt").symlink_to(secret)
    with recording() as opens:
        folder, state = checkpoints.load_latest(run.checkpoints, "cpu")
    assert folder.name == "step-0000001" and state["step"] == 1  # the newest is refused as a whole
    assert not opened_under(opens, secret, run.checkpoints / "step-0000002")


def test_a_resume_of_a_run_whose_log_links_out_is_refused_before_it_is_read(tiny_dir, files, tmp_path, capsys):
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"step": 1, "loss": 1.0}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").symlink_to(secret)
    with pytest.raises(OutsideFolderError, match="leaves the run folder"):
        RunDir(run).trim_log(0)
    args = ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(files / "triplets.tsv")]
    args += ["--eval-file", str(files / "dev.tsv"), "--steps", "1", "--output", str(run), "--resume"]
    with recording() as opens:
        assert main(args) == 2
    assert "leaves the run folder" in sole_line(capsys)
    assert not opened_under(opens, secret) and secret.read_text() == '{"step": 1, "loss": 1.0}\n'


def test_the_final_save_replaces_links_in_the_output_and_never_writes_through_them(tiny_bert, tmp_path):
    """A config.json linked to another model's, and a 2_Dense folder linked to another model's (the new model has
    none): both links go, the other model's files stay; a save killed in an earlier version (.saving-model) goes."""
    other = tmp_path / "other-model"
    (other / "2_Dense").mkdir(parents=True)
    (other / "2_Dense" / "model.safetensors").write_bytes(b"the other model's head")
    (other / "config.json").write_text('{"the other": "model"}')
    before = folder_entries(other)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").symlink_to(other / "config.json")
    (out / "2_Dense").symlink_to(other / "2_Dense", target_is_directory=True)
    (out / ".saving-model").mkdir()
    (out / ".saving-model" / "config.json").write_text("{}")
    with recording() as opens:
        checkpoints.save_model_atomically(lambda folder: tiny_bert.save(folder, metadata={"new": True}), out)
    assert folder_entries(other) == before
    assert not (out / "config.json").is_symlink() and json.loads((out / "config.json").read_text()) != {
        "the other": "model"
    }
    assert not (out / "2_Dense").exists() and not (out / "2_Dense").is_symlink()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary folder left
    written = opened_for_writing(opens)
    assert written and all(is_writer_temporary(p) for p in written), written


# ---- indexes: what a build writes, what a search reads and where it writes -------------------------------------------


@pytest.fixture(scope="module")
def built(tiny_dir, tmp_path_factory):
    """An index of DOCS at cell 4:32, built by the command (the tiny model's folder as --model)."""
    root = tmp_path_factory.mktemp("built-index")
    corpus = write_corpus(root / "corpus.jsonl", DOCS)
    out = root / "idx"
    args = ["index", "build", "--model", str(tiny_dir), "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*args, "--cells", "4:32", "--output", str(out)]) == 0
    return out


def search_args(index: Path, tiny_dir, *extra) -> list[str]:
    return ["search", "--index", str(index), "--model", str(tiny_dir), "--query", "cats", "--cell", "4:32", *extra]


@pytest.mark.parametrize("how", ["inside", "symlink", "hardlink"])
def test_search_output_onto_a_file_of_its_index_is_refused_and_the_index_survives(
    built, tiny_dir, tmp_path, capsys, how
):
    """Was: `search --index IDX --output IDX/ids.txt` exited 0 and the index was gone."""
    index = tmp_path / "idx"
    shutil.copytree(built, index)
    before = folder_entries(index)
    if how == "inside":
        output = index / "ids.txt"
    elif how == "symlink":
        output = tmp_path / "results.jsonl"
        output.symlink_to(index / "manifest.json")
    else:
        output = tmp_path / "results.jsonl"
        os.link(index / "manifest.json", output)
    assert main(search_args(index, tiny_dir, "--output", str(output))) == 2
    err = sole_line(capsys)
    assert f"--output {output}" in err and "choose another --output" in err
    assert folder_entries(index) == before
    assert main(search_args(index, tiny_dir, "--output", str(tmp_path / "hits.jsonl"))) == 0  # still searchable
    rows = [json.loads(line) for line in (tmp_path / "hits.jsonl").read_text().splitlines()]
    assert rows[0]["query"] == "cats" and rows[0]["ids"]


def test_search_hits_replace_a_link_in_their_place_and_never_write_through_it(built, tiny_dir, tmp_path):
    kept = tmp_path / "kept.txt"
    kept.write_text("a file the link points at")
    dest = tmp_path / "hits.jsonl"
    dest.symlink_to(kept)
    with recording() as opens:
        assert main(search_args(built, tiny_dir, "--output", str(dest))) == 0
    assert kept.read_text() == "a file the link points at" and not dest.is_symlink()
    assert json.loads(dest.read_text())["query"] == "cats"
    written = opened_for_writing(opens)
    assert written and all(is_writer_temporary(p) for p in written), written


@pytest.mark.parametrize("name", ["ids.txt", "manifest.json", "notes.txt"])
def test_an_index_holding_a_link_out_is_refused_before_anything_in_it_is_opened(built, tmp_path, name):
    """The folder's links are checked first: not the manifest, not ids.txt, nothing in it is opened (was: the
    manifest was read, then each named file checked one by one as it came)."""
    index, outside = tmp_path / "idx", tmp_path / f"outside-{name}"
    shutil.copytree(built, index)
    if (index / name).exists():
        shutil.move(index / name, outside)
    else:
        outside.write_text("not the index's")
    (index / name).symlink_to(outside)
    with recording() as opens, pytest.raises(IndexBuildError, match="leaves the index folder"):
        CellIndex(index)
    assert not opened_under(opens, index, outside)


def test_index_build_never_writes_through_links_and_refuses_a_linked_shards_folder(tiny_bert, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl", DOCS)
    # Another build's shards, behind a shards/ link: refused, with --overwrite too (was: its .npz files deleted).
    other = tmp_path / "other"
    (other / "shards").mkdir(parents=True)
    (other / "shards" / "shard-00000.npz").write_bytes(b"the other build's shard")
    before = folder_entries(other)
    out = tmp_path / "linked"
    out.mkdir()
    (out / "shards").symlink_to(other / "shards", target_is_directory=True)
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="symbolic link"):
            build_index(tiny_bert, corpus, [(4, 32)], out, overwrite=overwrite, log=lambda m: None)
    assert folder_entries(other) == before
    # ids.txt and a faiss file that are links to files elsewhere: replaced by the build's own, never written into.
    out = tmp_path / "idx"
    out.mkdir()
    kept = {}
    for name in ("ids.txt", "cell-4x32.faiss"):
        kept[name] = tmp_path / f"kept-{name}"
        kept[name].write_text(f"kept {name}")
        (out / name).symlink_to(kept[name])
    with recording() as opens:
        manifest = build_index(tiny_bert, corpus, [(4, 32)], out, shard_size=5, log=lambda m: None)
    assert manifest["complete"] and manifest["documents"] == len(DOCS)
    for name, path in kept.items():
        assert path.read_text() == f"kept {name}" and not (out / name).is_symlink()
    written = opened_for_writing(opens)
    assert written and all(is_writer_temporary(p) for p in written), written
    assert not [p for p in out.rglob("*") if TEMPORARY_MARK in p.name]
    assert CellIndex(out).ids == [d["_id"] for d in DOCS]


def test_a_search_never_creates_a_qdrant_folder_where_it_is_pointed(tmp_path):
    """A local-mode path from --path or from an index's manifest is opened only if it holds a collection store
    (qdrant-client would otherwise create its files there)."""
    pytest.importorskip("qdrant_client")
    from matryoshka2d.retrieval.qdrant_store import QdrantIndex, QdrantTarget

    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (tmp_path / "nowhere", empty):
        with pytest.raises(IndexBuildError, match="not a local-mode Qdrant folder"):
            QdrantIndex(QdrantTarget(path=str(folder), collection="c"))
    assert not (tmp_path / "nowhere").exists() and not list(empty.iterdir())
