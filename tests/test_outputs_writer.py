"""The one writer (matryoshka2d.outputs) and the files commands write through it: every file is written under a
temporary name and moved into place; a link in a file's place is replaced, never written through, and refused
when it reaches a file the command reads; a hard link to an input is refused; an export replaces its folder
whole. An audit hook (helpers/audit.py) fails a test on any other write."""

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from helpers.audit import opened_for_writing, recording
from helpers.cli import error_line, exit_code, folder_bytes
from helpers.data import WORDS, beir, grid, result_file, sts_tree
from matryoshka2d.cli import main
from matryoshka2d.outputs import TEMPORARY_MARK, is_writer_temporary

# ---- the writer itself -----------------------------------------------------------------------------------------------


def test_the_writer_replaces_a_link_in_its_place_and_never_writes_through_it(tmp_path):
    from matryoshka2d.outputs import write_text

    victim = tmp_path / "config.json"
    victim.write_text("{}")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    hard = tmp_path / "hard.json"
    os.link(victim, hard)
    write_text(link, "new")
    write_text(hard, "new")
    assert victim.read_text() == "{}" and not link.is_symlink() and link.read_text() == "new"
    assert hard.stat().st_ino != victim.stat().st_ino


def test_folders_the_command_owns_are_never_followed_through_a_link(tmp_path):
    from matryoshka2d.outputs import OutputError, command_scope, make_folder, remove_tree, write_text

    other = tmp_path / "other-run" / "checkpoints"
    other.mkdir(parents=True)
    (other / "step-1").write_text("the other run's")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(other, target_is_directory=True)
    with command_scope("--output", [], output=run):
        for act in (
            lambda: remove_tree(run / "checkpoints"),
            lambda: make_folder(run / "checkpoints", own=True),
            lambda: write_text(run / "checkpoints" / "step-2", "x"),
        ):
            with pytest.raises(OutputError, match="symbolic link"):
                act()
    assert (other / "step-1").read_text() == "the other run's" and sorted(os.listdir(other)) == ["step-1"]


# ---- encode, search, eval --cascade, report compression and the demo -------------------------------------------------


@contextlib.contextmanager
def plain_writes_under(root: Path):
    """Yields a list that, once the block ends, holds every file under `root` opened for writing that was not a
    temporary file of the one writer (which renames its files into place); tests/helpers/audit.py's hook."""
    found: list[str] = []
    with recording() as events:
        yield found
    root = root.resolve()
    written = opened_for_writing(events)
    found += [str(p) for p in written if p.resolve().is_relative_to(root) and not is_writer_temporary(p)]


def test_encode_streams_its_array_through_the_one_writer(tiny_dir, texts, tmp_path):
    """Was: the rows streamed into OUTPUT's `.partial` file with plain open(), left behind by an error."""
    out = tmp_path / "out"
    victim = tmp_path / "victim.npy"
    victim.write_bytes(b"another array")
    out.mkdir()
    (out / "vectors.npy").symlink_to(victim)  # replaced, never written through
    argv = ["encode", "--model", tiny_dir, "--pooling", "mean", "--input", texts, "--output", out / "vectors"]
    with plain_writes_under(tmp_path) as plain:
        assert exit_code(argv) == 0
    assert plain == []
    assert victim.read_bytes() == b"another array"
    assert not (out / "vectors.npy").is_symlink() and np.load(out / "vectors.npy").shape == (3, 32)
    assert sorted(os.listdir(out)) == ["vectors.npy"]


@pytest.fixture
def toy_beir(tmp_path):
    pairs = zip(WORDS[:12], WORDS[3:15], strict=True)
    corpus = [{"_id": f"d{k}", "title": "", "text": f"{w} {v} text"} for k, (w, v) in enumerate(pairs)]
    queries = [{"_id": f"q{k}", "text": f"{w} text"} for k, w in enumerate(WORDS[:6])]
    return beir(tmp_path / "beir", corpus, queries, [(f"q{k}", f"d{k}", 1) for k in range(6)])


def test_search_writes_its_rows_through_the_one_writer_and_never_through_a_link(tiny_dir, toy_beir, texts, tmp_path):
    """Was: open(--output, "w"), which wrote through a link in its place into the file it pointed at."""
    index = tmp_path / "index"
    build = ["index", "build", "--model", tiny_dir, "--pooling", "mean", "--corpus", toy_beir / "corpus.jsonl"]
    assert exit_code([*build, "--cells", "4:32", "--output", index]) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's notes\n")
    hits = tmp_path / "out" / "hits.jsonl"
    hits.parent.mkdir()
    hits.symlink_to(victim)
    with plain_writes_under(tmp_path) as plain:
        assert exit_code(["search", "--index", index, "--queries", texts, "--top-k", "2", "--output", hits]) == 0
    assert plain == []
    assert victim.read_text() == "someone's notes\n"
    rows = [json.loads(line) for line in hits.read_text().splitlines()]
    assert not hits.is_symlink() and [r["query"] for r in rows] == ["red cat", "blue dog", "old fish swims"]


def test_eval_cascade_writes_its_files_through_the_one_writer(tiny_dir, toy_beir, tmp_path):
    """Was: Path.write_text, through a link in cascade.json's place."""
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.json"
    victim.write_text("{}\n")
    (out / "cascade.json").symlink_to(victim)
    argv = ["eval", "retrieval", "--model", tiny_dir, "--pooling", "mean", "--dataset-dir", toy_beir, "--quiet"]
    with plain_writes_under(tmp_path) as plain:
        assert exit_code([*argv, "--cascade", "2:16,4:32", "--shortlist", "10", "--output", out]) == 0
    assert plain == []
    assert victim.read_text() == "{}\n"
    assert not (out / "cascade.json").is_symlink() and "rows" in json.loads((out / "cascade.json").read_text())
    assert (out / "cascade.md").is_file()


@pytest.fixture
def stsb_data(tmp_path):
    """A data folder with an STS-B test file of 30 pairs (what report compression reads)."""
    root = tmp_path / "data"
    (root / "sts" / "raw").mkdir(parents=True)
    rng = np.random.default_rng(2)
    rows = ["sentence1\tsentence2\tscore"]
    rows += [f"{' '.join(rng.choice(WORDS, 4))}\t{' '.join(rng.choice(WORDS, 3))}\t{i % 6}" for i in range(30)]
    (root / "sts" / "raw" / "stsb_test.tsv").write_text("\n".join(rows) + "\n")
    return root


def test_report_compression_writes_through_the_one_writer(tiny_dir, stsb_data, tmp_path, capsys, monkeypatch):
    """Was: mkdir and Path.write_text (through a link in compression.md's place); and an earlier report in --output
    was refused only after every model was loaded and every t-SNE computed."""
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.md"
    victim.write_text("notes\n")
    (out / "compression.md").symlink_to(victim)
    argv = ["report", "compression", "--model", tiny_dir, "--pooling", "mean", "--data-dir", stsb_data, "--quiet"]
    argv += ["--device", "cpu", "--dims", "8", "32", "--sentences", "20", "--output", out]
    with plain_writes_under(tmp_path) as plain:
        assert exit_code([*argv, "--overwrite"]) == 0
    assert plain == []
    assert victim.read_text() == "notes\n" and not (out / "compression.md").is_symlink()
    assert sorted(os.listdir(out)) == ["compression.json", "compression.md", "compression.png"]
    capsys.readouterr()
    from matryoshka2d.cli import args as cli_args

    monkeypatch.setattr(cli_args, "load_encoder", lambda *a, **k: pytest.fail("a model was loaded"))
    assert exit_code(argv) == 2
    assert "already holds compression.json; pass --overwrite" in error_line(capsys)


def test_the_demo_writes_its_small_corpus_through_the_one_writer(toy_beir, tmp_path):
    from matryoshka2d.cli.demo import small_scifact

    out = tmp_path / "demo" / "scifact-small"
    with plain_writes_under(tmp_path) as plain:
        _, keep, split = small_scifact(toy_beir, out, 3, 8)
    assert plain == []
    assert split == "test" and len(keep) == 8
    assert len((out / "corpus.jsonl").read_text().splitlines()) == 8


# ---- result files, picks, reports and exports: a link in a file's place ----------------------------------------------


def loads(folder) -> bool:
    """Whether the folder still loads as a model (its config.json intact)."""
    from matryoshka2d.models.encoder import ElasticEncoder

    return ElasticEncoder(str(folder), pooling="mean", device="cpu").num_layers == 4


def eval_sts(model, data, out, *more):
    args = ["eval", "sts", "--model", str(model), "--pooling", "mean", "--data-dir", str(data)]
    return main([*args, "--layers", "1,4", "--dims", "8", "32", "--output", str(out), "--quiet", *more])


def test_eval_refuses_a_results_file_linked_into_the_model_it_reads(model, tmp_path, capsys):
    data = sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").symlink_to(model / "config.json")
    before = folder_bytes(model)
    assert eval_sts(model, data, out) == 2
    line = error_line(capsys)
    assert f"--output {out / 'results.json'}" in line and "--model" in line, line
    assert folder_bytes(model) == before and loads(model)
    assert (out / "results.json").is_symlink()


def test_eval_replaces_a_results_file_link_to_a_file_it_does_not_read(model, tmp_path, capsys):
    data = sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "notes.md"
    elsewhere.write_text("the user's notes\n")
    (out / "results.md").symlink_to(elsewhere)
    assert eval_sts(model, data, out) == 0
    assert elsewhere.read_text() == "the user's notes\n"  # never written through
    assert not (out / "results.md").is_symlink() and "| layer \\ dim |" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["layers"] == [1, 4]
    assert not [p for p in out.iterdir() if ".m2d-tmp-" in p.name]  # no temporary file left beside the results


def test_eval_refuses_a_results_csv_hard_linked_to_its_data(model, tmp_path, capsys):
    data = sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    stsb = data / "sts" / "raw" / "stsb_test.tsv"
    os.link(stsb, out / "results.csv")
    before = folder_bytes(data)
    assert eval_sts(model, data, out) == 2
    line = error_line(capsys)
    assert f"--output {out / 'results.csv'}" in line and "hard link" in line and "--data-dir" in line, line
    assert folder_bytes(data) == before  # the data file is not truncated
    assert not (out / "results.json").exists()  # refused before the work


def test_pick_replaces_its_files_linked_into_the_timed_model_and_the_model_still_loads(model, tmp_path, quick_timing):
    """The model pick times is named by the results (not an input option): links to its files are replaced, never
    written through."""
    results = result_file(tmp_path / "sts", model)
    (results / "pick.json").symlink_to(model / "config.json")
    (results / "pick.md").symlink_to(model / "tokenizer_config.json")
    (results / "pick.png").symlink_to(model / "vocab.txt")
    before = folder_bytes(model)
    assert main(["pick", "--results", str(results), "--max-bytes", "64"]) == 0
    assert folder_bytes(model) == before and loads(model)
    for name in ("pick.json", "pick.md", "pick.png"):
        assert not (results / name).is_symlink(), name
    assert json.loads((results / "pick.json").read_text())["recommended"]["dim"] == 8
    assert (results / "pick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pick_refuses_its_output_linked_into_the_model_named_by_model(model, tmp_path, quick_timing, capsys):
    results = result_file(tmp_path / "sts", model)
    (results / "pick.json").symlink_to(model / "config.json")
    before = folder_bytes(model)
    assert main(["pick", "--results", str(results), "--model", str(model), "--max-bytes", "64"]) == 2
    assert "--output" in error_line(capsys)
    assert folder_bytes(model) == before and loads(model)


@pytest.fixture(scope="module")
def stsb_dir(tmp_path_factory):
    """STS-B test pairs for `report compression` (30 pairs, 11+ distinct sentences)."""
    root = tmp_path_factory.mktemp("stsb-data")
    words = ["red", "blue", "cat", "dog", "runs", "sleeps", "under", "over", "a", "the", "big", "small"]
    rows = ["sentence1\tsentence2\tscore"]
    rows += [f"{words[i % 12]} {words[(i * 5) % 12]} {i}\t{words[(i * 7) % 12]} {i}\t{i % 6}" for i in range(30)]
    (root / "sts" / "raw").mkdir(parents=True)
    (root / "sts" / "raw" / "stsb_test.tsv").write_text("\n".join(rows) + "\n")
    return root


def report_compression(model, data, out, *more):
    args = ["report", "compression", "--model", str(model), "--data-dir", str(data), "--output", str(out)]
    args += ["--quiet", "--device", "cpu", "--pooling", "mean", "--perplexity", "3", "--sentences", "12"]
    return main([*args, "--dims", "8", "32", *more])


def test_report_compression_never_writes_through_a_link(model, stsb_dir, tmp_path, monkeypatch, capsys):
    from matryoshka2d.evaluate import compression

    # The plane from the vectors' first two numbers: t-SNE's seconds buy nothing here, where the files are checked.
    monkeypatch.setattr(compression, "_tsne", lambda vectors, seed, perplexity: vectors[:, :2].astype(float))
    out = tmp_path / "rep"
    out.mkdir()
    (out / "compression.json").symlink_to(model / "config.json")
    before = folder_bytes(model)
    assert report_compression(model, stsb_dir, out, "--overwrite") == 2  # reaches --model: refused
    assert "--output" in error_line(capsys)
    assert folder_bytes(model) == before and loads(model)
    (out / "compression.json").unlink()
    elsewhere = tmp_path / "other.md"
    elsewhere.write_text("kept\n")
    (out / "compression.md").symlink_to(elsewhere)
    assert report_compression(model, stsb_dir, out, "--overwrite") == 0  # a link elsewhere: replaced
    assert elsewhere.read_text() == "kept\n" and not (out / "compression.md").is_symlink()
    assert "| width | " in (out / "compression.md").read_text()


def test_report_replaces_a_linked_report_and_refuses_one_hard_linked_to_a_result(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(grid()))
    out = tmp_path / "rep"
    out.mkdir()
    os.link(tmp_path / "a" / "results.json", out / "report.md")
    before = folder_bytes(tmp_path / "a")
    args = ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(out)]
    assert main(args) == 2
    assert f"--output {out / 'report.md'}" in error_line(capsys)
    assert folder_bytes(tmp_path / "a") == before
    (out / "report.md").unlink()
    elsewhere = tmp_path / "notes.md"
    elsewhere.write_text("kept\n")
    (out / "report.md").symlink_to(elsewhere)
    heatmap = tmp_path / "picture.png"
    heatmap.write_bytes(b"a picture of the user's")
    (out / "diff_b_minus_a.png").symlink_to(heatmap)  # both results are of `tiny`: named by their folders
    assert main(args) == 0
    assert elsewhere.read_text() == "kept\n" and heatmap.read_bytes() == b"a picture of the user's"
    assert not (out / "report.md").is_symlink() and (out / "report.md").read_text().startswith("#")
    assert not (out / "diff_b_minus_a.png").is_symlink()
    assert (out / "diff_b_minus_a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_refuses_an_output_that_is_a_link_before_any_work(model, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept\n")
    link = tmp_path / "cell"
    link.symlink_to(elsewhere, target_is_directory=True)
    args = ["export", "--model", str(model), "--pooling", "mean", "--layer", "2", "--dim", "8", "--output", str(link)]
    assert main([*args, "--overwrite"]) == 2
    line = error_line(capsys)
    assert f"--output {link} is a symbolic link" in line, line
    assert (elsewhere / "keep.txt").read_text() == "kept\n" and link.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing built beside it


def test_export_beside_its_model_replaces_an_earlier_export_whole(model, tmp_path):
    """The usual layout, the model and its cell side by side: built in a hidden folder beside the output and moved
    into place; an earlier export (with --overwrite) is replaced, not merged."""
    out = tmp_path / "cell"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export\n")
    args = ["export", "--model", str(model), "--pooling", "mean", "--layer", "2", "--dim", "8", "--output", str(out)]
    assert main([*args, "--overwrite"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert json.loads((out / "matryoshka2d.json").read_text())["exported_cell"]["dim"] == 8
    assert not [p for p in tmp_path.iterdir() if ".m2d-tmp-" in p.name]


# ---- a folder seen under a second name -------------------------------------------------------------------------------


def second_name(monkeypatch, alias: Path, real: Path) -> None:
    """Make every path under `alias` report the identity (device, inode) of the same path under `real`, as a bind
    mount does: the paths stay apart (no link anywhere), so only the identity can tell they are one folder."""
    from matryoshka2d import outputs
    from matryoshka2d.outputs import disk, scope

    true_identity = disk.identity

    def identity(path):
        path = Path(path).absolute()
        return true_identity(real / path.relative_to(alias) if path.is_relative_to(alias) else path)

    for module in (disk, scope, outputs):
        monkeypatch.setattr(module, "identity", identity)


def test_a_folder_under_a_second_name_is_compared_by_identity_along_the_whole_chain(tmp_path, monkeypatch):
    """Was: only resolved paths (and files' inodes) were compared, so an output through a second name of the model's
    folder or of a folder above it passed, and `export --overwrite` deleted the model."""
    from matryoshka2d.outputs import OutputError, command_scope, make_folder, remove_tree

    runs = tmp_path / "runs"
    model = runs / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    alias = tmp_path / "alias"
    (alias / "model").mkdir(parents=True)
    second_name(monkeypatch, alias, runs)
    with command_scope("--output", [("--model", model)]):
        for output, how in ((alias / "model", " is "), (alias, " holds "), (alias / "model" / "cell", " is inside ")):
            with pytest.raises(OutputError, match="another name") as refused:
                make_folder(output, "--output")
            assert how in str(refused.value) and f"--output {output}" in str(refused.value)
        out = tmp_path / "out"
        (out / "mounted").mkdir(parents=True)
        second_name(monkeypatch, out / "mounted", model)  # the model bound inside an output being replaced
        with pytest.raises(OutputError, match="under another name"):
            remove_tree(out)
    assert (model / "config.json").read_text() == "{}" and (out / "mounted").is_dir()


def test_export_overwrite_through_a_bind_mount_never_deletes_the_model(model, tmp_path, capsys):
    """The case of the issue, with a real bind mount: the model's parent and the model itself under a second name,
    and a bind of the model inside an export being replaced."""
    import shutil

    from helpers.mounts import bind_mount

    model = Path(shutil.copytree(model, tmp_path / "runs" / "model"))
    before = folder_bytes(model)
    export = ["export", "--model", str(model), "--pooling", "mean", "--layer", "2", "--dim", "8", "--overwrite"]
    with bind_mount(model.parent, tmp_path / "alias") as alias:
        for output in (alias / model.name, alias):
            assert main([*export, "--output", str(output)]) == 2
            assert f"--output {output}" in error_line(capsys, "another name")
    cell = tmp_path / "cell"
    with bind_mount(model, cell / "inside"):
        assert main([*export, "--output", str(cell)]) == 2
        assert "mount point" in error_line(capsys, f"--output {cell}")
    assert folder_bytes(model) == before and loads(model)


# ---- outputs that are no file or folder, or that the storage refuses -------------------------------------------------


def test_the_writer_never_replaces_a_device_a_pipe_or_standard_output(tmp_path):
    """Was: a FIFO, a character device or a link to /dev/stdout given as a destination was replaced by a regular
    file (and `/dev/stdout`, a link in /dev, would be replaced system-wide)."""
    from matryoshka2d.outputs import OutputError, make_folder, write_text

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    stdout = tmp_path / "stdout"
    stdout.symlink_to("/dev/stdout")
    cases = {fifo: "a pipe (FIFO)", null: "a character device", stdout: "standard output", Path("/dev/fd/1"): "(1"}
    for path, what in cases.items():
        for act in (lambda p=path: write_text(p, "x"), lambda p=path: make_folder(p)):
            with pytest.raises(OutputError, match="not a file or folder") as refused:
                act()
            assert str(path) in str(refused.value) and what in str(refused.value)
    assert fifo.is_fifo() and os.readlink(null) == "/dev/null" and os.readlink(stdout) == "/dev/stdout"
    assert sorted(os.listdir(tmp_path)) == ["fifo", "null", "stdout"]


def test_a_full_disk_while_writing_names_the_destination_and_leaves_what_was_there(tmp_path):
    """Was: `[Errno 28] No space left on device` naming no file (or the writer's temporary name). The write fails
    as one OutputError naming the destination as given; the earlier file is whole and no temporary file remains,
    inside a staging folder too (named by what it stands for)."""
    from helpers.mounts import small_file_system
    from matryoshka2d.outputs import OutputError, command_scope, remove_tree, temporary_folder, write_bytes

    with small_file_system(tmp_path / "disk", "256k") as disk:
        (disk / "vectors.npy").write_bytes(b"the earlier vectors")
        with pytest.raises(OutputError, match="No space left on device") as refused:
            write_bytes(disk / "vectors.npy", bytes(1 << 20), "--output")
        assert f"--output {disk / 'vectors.npy'}: writing failed" in str(refused.value)
        assert TEMPORARY_MARK not in str(refused.value)
        assert (disk / "vectors.npy").read_bytes() == b"the earlier vectors"
        with command_scope("--output", [], output=disk / "cell"):
            staging = temporary_folder(disk, "cell")
            try:
                with pytest.raises(OutputError, match="No space left on device") as refused:
                    write_bytes(staging / "model.safetensors", bytes(1 << 20))
            finally:
                remove_tree(staging)
        assert f"--output {disk / 'cell' / 'model.safetensors'}" in str(refused.value)
        assert TEMPORARY_MARK not in str(refused.value)
        assert sorted(os.listdir(disk)) == ["vectors.npy"]


def test_export_to_a_disk_too_small_is_one_line_naming_the_output_and_leaves_the_old_export(model, tmp_path, capsys):
    """Was: a traceback ending in safetensors' `SafetensorError: ... No space left on device (os error 28)`. Now one
    line naming --output as given; the staging folder is gone and the earlier export is whole."""
    from helpers.mounts import small_file_system

    export = ["export", "--model", str(model), "--pooling", "mean", "--layer", "2", "--dim", "8"]
    with small_file_system(tmp_path / "disk", "1m") as disk:
        (disk / "cell").mkdir()
        (disk / "cell" / "earlier.txt").write_text("the earlier export\n")
        for output, more in ((disk / "new", []), (disk / "cell", ["--overwrite"])):
            assert main([*export, *more, "--output", str(output)]) == 2
            line = error_line(capsys, f"--output {output}: writing failed (No space left on device)")
            assert TEMPORARY_MARK not in line and "Safetensor" not in line, line
            assert sorted(os.listdir(disk)) == ["cell"], os.listdir(disk)
        assert (disk / "cell" / "earlier.txt").read_text() == "the earlier export\n"


def test_a_command_failing_after_part_of_its_result_set_puts_the_set_back(model, tmp_path, capsys, monkeypatch):
    """Was: the disk filling at eval's heatmap left new results.json, .md and .csv beside the earlier heatmap (or,
    in a new folder, a set without its heatmap). Now the set is as it was: the earlier files, or nothing."""
    import errno

    from matplotlib.figure import Figure

    data = sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    assert eval_sts(model, data, out) == 0
    earlier = folder_bytes(out)

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", disk_full)
    for output in (out, tmp_path / "new"):
        assert eval_sts(model, data, output, "--dims", "16") == 2
        line = error_line(capsys, f"--output {output / 'heatmap.png'}: writing failed (No space left on device)")
        assert TEMPORARY_MARK not in line
    assert folder_bytes(out) == earlier and sorted(os.listdir(out)) == sorted(earlier)
    assert not (tmp_path / "new").exists()


# ---- staging folders: the user's path in messages, and what a killed command left ------------------------------------


def test_a_refusal_inside_a_staging_folder_names_the_users_path(tmp_path):
    """Was: a check failing on a file being built named the hidden staging folder (`.cell.m2d-tmp-XXXX/...`)."""
    from matryoshka2d.outputs import (
        OutputError,
        command_scope,
        failure_message,
        remove_tree,
        temporary_folder,
        write_text,
    )

    data = tmp_path / "data.tsv"
    data.write_text("rows\n")
    with command_scope("--output", [("--data", data)], output=tmp_path / "cell") as scope:
        staging = temporary_folder(tmp_path, "cell")
        try:
            os.link(data, staging / "config.json")  # a file in the build that is an input under another name
            with pytest.raises(OutputError) as refused:
                write_text(staging / "config.json", "{}")
            raised = OSError(5, "Input/output error", str(staging / "tokenizer.json"))
        finally:
            remove_tree(staging)
    message = str(refused.value)
    assert f"--output {tmp_path / 'cell' / 'config.json'}" in message and TEMPORARY_MARK not in message
    said = failure_message(raised, scope)  # an error a library raised while writing into the staging folder
    assert str(tmp_path / "cell" / "tokenizer.json") in said and TEMPORARY_MARK not in said
    assert data.read_text() == "rows\n"


def test_a_staging_folder_left_by_a_killed_command_is_removed_by_the_next_and_nothing_else_is(model, tmp_path):
    """Was: a killed export left its hidden staging folder (a whole model) beside the output, and every re-run left
    it too. A staging folder has an owner file naming its process; the next staging in the same place removes those
    whose process is gone, never a folder without one, nor a living process's."""
    import signal

    from matryoshka2d.outputs import temporary_folder

    child = os.fork()
    if child == 0:  # a command killed while building: its staging folder and owner file stay behind
        killed = temporary_folder(tmp_path, "cell")
        (killed / "model.safetensors").write_bytes(b"a whole model")
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(child, 0)
    left = [p for p in tmp_path.iterdir() if TEMPORARY_MARK in p.name and p.is_dir()]
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file()
    look_alike = tmp_path / f".cell{TEMPORARY_MARK}users"  # the writer's name, but no owner file: not the writer's
    look_alike.mkdir()
    alive = temporary_folder(tmp_path, "other")  # this process's, still building
    args = ["export", "--model", str(model), "--pooling", "mean", "--layer", "2", "--dim", "8"]
    assert main([*args, "--output", str(tmp_path / "cell")]) == 0
    assert not left[0].exists() and look_alike.is_dir() and alive.is_dir()
    hidden = sorted(p.name for p in tmp_path.iterdir() if TEMPORARY_MARK in p.name)
    assert hidden == sorted([look_alike.name, alive.name, alive.name + ".owner"])
