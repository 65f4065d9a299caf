"""An index and what meets it are one model: search uses the index's model and pooling and refuses other
weights, a deeper query layer or an exit head the documents were made without; a damaged index (its files
checked against the sizes and checksums the build recorded) and a bad corpus id are a one-line error, never a
traceback; an index records where its model is."""

import json

import numpy as np
import pytest

from helpers.cli import error_line
from helpers.data import UNTITLED_DOCS, write_corpus
from matryoshka2d.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- search: the index's own model, pooling and depth ----------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tiny_dir, tmp_path_factory):
    """A flat and an ivf index of the same corpus (UNTITLED_DOCS), cells 2:16 and 4:32, built from the command line."""
    root = tmp_path_factory.mktemp("index-of-60")
    corpus = write_corpus(root / "corpus.jsonl", UNTITLED_DOCS)
    for kind in ("flat", "ivf"):
        args = ["index", "build", "--model", str(tiny_dir), "--pooling", "mean", "--corpus", str(corpus)]
        assert main([*args, "--cells", "2:16,4:32", "--output", str(root / kind), "--index", kind]) == 0
    return root


def search_args(index, *extra):
    return ["search", "--index", str(index), "--query", "cats", "--top-k", "3", *extra]


def test_search_uses_the_index_models_pooling_and_refuses_another_model(built, other_weights_dir, capsys):
    # A plain Hugging Face folder has no pooling of its own: the manifest's is used.
    assert main(search_args(built / "flat")) == 0
    capsys.readouterr()
    assert main(search_args(built / "flat", "--model", str(other_weights_dir), "--pooling", "mean")) == 2
    error_line(capsys, "weights sha256", "but the query model", "has other weights", "leave out --model")
    assert main(search_args(built / "flat", "--pooling", "cls")) == 2
    error_line(capsys, "documents were pooled with mean, the query model with cls")


def test_a_manifest_location_pointing_at_other_weights_is_refused(built, other_weights_dir, tmp_path, capsys):
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(built / "flat", moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["model"]["location"] = str(other_weights_dir)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert main(search_args(moved)) == 2
    error_line(capsys, "has other weights")


def test_query_layer_deeper_than_the_documents_is_refused(built, capsys):
    assert main(search_args(built / "flat", "--cell", "2:16", "--query-layer", "4")) == 2
    error_line(capsys, "--query-layer 4 is deeper than the documents of cell 2:16", "--query-layer 2 or less")
    assert main(search_args(built / "flat", "--cascade", "2:16,4:32", "--query-layer", "3")) == 2
    error_line(capsys, "cell 2:16")
    assert main(search_args(built / "flat", "--query-layer", "2")) == 0  # documents at layer 4
    assert main(search_args(built / "flat", "--cell", "2:16", "--query-layer", "2")) == 0  # symmetric


@pytest.mark.parametrize(("flag", "kind"), [("--nprobe", "ivf"), ("--ef-search", "flat")])
def test_search_breadth_must_be_positive(built, capsys, flag, kind):
    with pytest.raises(SystemExit) as exit_code:  # refused where it is parsed (rule 4)
        main(search_args(built / kind, flag, "0"))
    assert exit_code.value.code == 2
    error_line(capsys, f"{flag}: must be at least 1, got 0")


# ---- a damaged index -------------------------------------------------------------------------------------------------


def damage(index, how):
    faiss_file = index / "cell-4x32.faiss"
    if how == "truncated":
        faiss_file.write_bytes(faiss_file.read_bytes()[:100])
    elif how == "random":
        faiss_file.write_bytes(np.random.default_rng(0).bytes(faiss_file.stat().st_size))
    elif how == "empty":
        faiss_file.write_bytes(b"")
    elif how == "other cell":
        faiss_file.write_bytes((index / "cell-2x16.faiss").read_bytes())
    elif how == "short ids":
        (index / "ids.txt").write_text("d0\nd1\n")
    elif how == "cell with a path":
        manifest = json.loads((index / "manifest.json").read_text())
        manifest["cells"][0] = ["../../etc/passwd", 16]
        (index / "manifest.json").write_text(json.dumps(manifest))


CASES = {
    # recorded sizes and checksums (what `index build` writes now)
    "truncated": ("cell-4x32.faiss: 100 bytes, but the build wrote",),
    "random": ("cell-4x32.faiss: its sha256 differs",),
    "empty": ("cell-4x32.faiss: 0 bytes, but the build wrote",),
    "other cell": ("cell-4x32.faiss:", "but the build wrote"),
    "short ids": ("ids.txt:", "but the build wrote"),
    "cell with a path": ("manifest.json: 'cells' must be a list of [layer, dim] pairs of positive integers",),
}


# An index built before sizes and checksums were recorded: faiss's own errors and the shapes, as messages.
CASES_WITHOUT_RECORD = {
    "truncated": ("cell-4x32.faiss: not a readable faiss index",),
    "random": ("cell-4x32.faiss: not a readable faiss index",),
    "empty": ("cell-4x32.faiss: empty, not a faiss index",),
    "other cell": ("holds 60 vectors of 16 numbers, but cell 4:32 of this index has 60 of 32",),
    "short ids": ("ids.txt: 2 ids, but the index holds 60 documents",),
    "cell with a path": CASES["cell with a path"],
}


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "older-index"])
@pytest.mark.parametrize("how", list(CASES))
def test_a_damaged_index_is_a_message_not_a_traceback(built, tmp_path, capsys, how, recorded):
    import shutil

    index = tmp_path / "idx"
    shutil.copytree(built / "flat", index)
    if not recorded:
        manifest = json.loads((index / "manifest.json").read_text())
        del manifest["files"]
        (index / "manifest.json").write_text(json.dumps(manifest))
    damage(index, how)
    assert main(search_args(index)) == 2
    line = error_line(capsys, *(CASES if recorded else CASES_WITHOUT_RECORD)[how])
    assert "--overwrite" in line


# ---- exit heads, the model's place, the corpus ids -------------------------------------------------------------------


def test_exit_heads_on_one_side_and_off_on_the_other(tiny_dir, built, tokenizer, tmp_path, monkeypatch, capsys):
    """A folder with exit heads gives other vectors with --no-heads at a layer with a head: search says which flag
    matches the index; pick times the model the way its results were evaluated."""
    from helpers.data import sts_tree

    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:400]
    rng = np.random.default_rng(1)
    sentences = list(dict.fromkeys(" ".join(rng.choice(words, rng.integers(3, 9))) for _ in range(220)))[:200]
    (tmp_path / "sentences.txt").write_text("\n".join(sentences) + "\n")
    heads = tmp_path / "with-heads"
    fit = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(tmp_path / "sentences.txt")]
    assert main([*fit, "--output", str(heads), "--quiet"]) == 0
    corpus = built / "corpus.jsonl"
    index = tmp_path / "idx"
    build = ["index", "build", "--model", str(heads), "--corpus", str(corpus), "--cells", "2:16,4:32"]
    assert main([*build, "--output", str(index), "--no-heads"]) == 0
    capsys.readouterr()
    assert main(["search", "--index", str(index), "--query", "cats"]) == 2
    error_line(capsys, "vectors at layer 2 were made without an exit head", "applies one there: pass --no-heads")
    assert main(["search", "--index", str(index), "--query", "cats", "--no-heads"]) == 0

    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    sts_tree(tmp_path / "data")
    evaluate = ["eval", "sts", "--model", str(heads), "--data-dir", str(tmp_path / "data"), "--quiet"]
    assert main([*evaluate, "--layers", "2,4", "--dims", "16,32", "--no-heads", "--output", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    assert main(["pick", "--results", str(tmp_path / "r")]) == 0
    assert "warning" not in capsys.readouterr().err
    timing = json.loads((tmp_path / "r" / "pick.json").read_text())["timing"]
    recorded = json.loads((tmp_path / "r" / "results.json").read_text())["model"]["weights_sha256"]
    assert timing["weights_sha256"] == recorded


def test_a_model_that_gives_an_index_its_vectors_may_query_it_whatever_else_it_adds(
    heads_folder, tiny_dir, tmp_path, capsys
):
    """Exit heads fitted on a model leave its last layer as it was: they may query an index the untouched model
    built at that layer (queries at any layer, with their heads); at a layer where a head acts, the refusal says
    so. An index from before its vectors' identity was recorded is judged the same way."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"text number {i}"}) + "\n" for i in range(12)))
    build = ["index", "build", "--model", str(tiny_dir), "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*build, "--cells", "4:32", "--output", str(tmp_path / "last")]) == 0
    assert main([*build, "--cells", "2:16,4:32", "--output", str(tmp_path / "both")]) == 0
    search = ["search", "--model", str(heads_folder), "--query", "text number 3", "--top-k", "1"]
    capsys.readouterr()
    assert main([*search, "--index", str(tmp_path / "last")]) == 0
    assert main([*search, "--index", str(tmp_path / "last"), "--query-layer", "2"]) == 0
    assert "d3" in capsys.readouterr().out
    assert main([*search, "--index", str(tmp_path / "both")]) == 2
    err = capsys.readouterr().err
    assert "its vectors at layer 2 were made without an exit head" in err and "pass --no-heads" in err
    manifest = tmp_path / "last" / "manifest.json"
    older = json.loads(manifest.read_text())
    del older["vectors"]  # as an index built before this records it
    manifest.write_text(json.dumps(older))
    assert main([*search, "--index", str(tmp_path / "last")]) == 0


def test_an_index_records_where_its_model_is_so_search_works_from_another_directory(
    tiny_dir, tmp_path, monkeypatch, capsys
):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dir, tmp_path / "runs" / "model")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"text number {i}"}) + "\n" for i in range(12)))
    build = ["index", "build", "--model", "runs/model", "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*build, "--cells", "4:32", "--output", "idx"]) == 0
    recorded = json.loads((tmp_path / "idx" / "manifest.json").read_text())["model"]["location"]
    assert recorded == str((tmp_path / "runs" / "model").resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["search", "--index", str(tmp_path / "idx"), "--query", "text number 3", "--top-k", "1"]) == 0
    assert "d3" in capsys.readouterr().out


@pytest.mark.parametrize("bad_id", ["doc\n2", "doc\r2", "doc\u20282"])
def test_a_corpus_id_with_a_line_break_is_refused_naming_the_line(tiny_dir, tmp_path, capsys, bad_id):
    corpus = tmp_path / "corpus.jsonl"
    docs = [{"_id": "d1", "text": "a red cat"}, {"_id": bad_id, "text": "a blue dog"}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    args = ["index", "build", "--model", str(tiny_dir), "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*args, "--cells", "4:32", "--output", str(tmp_path / "idx")]) == 2
    assert f"{corpus}:2: _id {bad_id!r} holds a line break" in capsys.readouterr().err
