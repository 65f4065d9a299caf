"""Issue 22, the second hardening pass: no finished model is replaced by a resume, two artefacts that meet are
the same model (index and query model, result files and the model pick times, a resumed index build and its
corpus), and damaged indexes and bad flags end in a one-line error (exit 2), never a traceback. The cases and
their messages are listed in docs/reliability.md, section 8."""

import json

import numpy as np
import pytest

import test_hardening as first_pass
from matryoshka2d.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
one_line_error = first_pass.one_line_error  # the first pass's check: one "error:" line, no traceback


def train_args(model, files, out, *extra):
    return first_pass.train_args(model, files, out, "--steps", "2", *extra)  # the last --steps counts


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- training ---------------------------------------------------------------------------------------------


def test_resume_never_replaces_a_finished_model(tiny_dir, files, tmp_path, capsys):
    """A finished run whose checkpoints were removed: --resume (with another --lr even) refuses, names what is
    there and --overwrite, and changes no file; --overwrite then trains afresh."""
    run = tmp_path / "run"
    assert main(train_args(tiny_dir, files, run, "--save-steps", "0")) == 0
    assert not (run / "checkpoints").exists()
    before = snapshot(run)
    capsys.readouterr()
    assert main(train_args(tiny_dir, files, run, "--resume", "--lr", "0.5")) == 2
    one_line_error(capsys, "--resume", "a finished model (2 steps, method plain", "no checkpoint", "--overwrite")
    assert snapshot(run) == before
    # Any model folder counts, not only our runs.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert main(train_args(tiny_dir, files, plain, "--resume")) == 2
    one_line_error(capsys, "a saved model (config.json)")
    assert main(train_args(tiny_dir, files, run, "--overwrite", "--lr", "0.5")) == 0  # not with --resume: rule 4
    assert snapshot(run) != before


def test_every_eval_cell_is_evaluated(tiny_dir, files, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(tiny_dir, files, run, "--eval-cell", "1:16,2:32", "--eval-steps", "1")) == 0
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval"]) for r in records if "eval" in r]
    assert evals == [(1, "dev.tsv@(1,16)"), (1, "dev.tsv@(2,32)"), (2, "dev.tsv@(1,16)"), (2, "dev.tsv@(2,32)")]
    meta = json.loads((run / "matryoshka2d.json").read_text())
    assert [r["eval"] for r in meta["final_evals"]] == ["dev.tsv@(1,16)", "dev.tsv@(2,32)"]
    assert meta["final_eval"] == meta["final_evals"][0]
    assert "step 1: STS dev.tsv@(2,32) spearman" in capsys.readouterr().out
    # Each cell is checked against the model before the first step.
    assert main(train_args(tiny_dir, files, tmp_path / "bad", "--eval-cell", "1:16,9:8")) == 2
    one_line_error(capsys, "layer 9 is out of range")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(("extra", "option"), [(["--layer", "0", "--dim", "0"], "--layer"), (["--dim", "0"], "--dim")])
def test_separate_refuses_zero_layer_or_dim(tiny_dir, files, tmp_path, capsys, extra, option):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:  # at parse time, naming the option (rule 4)
        main(train_args(tiny_dir, files, out, "--method", "separate", *extra))
    assert stopped.value.code == 2
    one_line_error(capsys, f"argument {option}: must be at least 1, got 0")
    assert not out.exists()
    # a cell beyond the model is the method's to refuse, naming the model's size
    assert main(train_args(tiny_dir, files, out, "--method", "separate", "--dim", "64")) == 2
    one_line_error(capsys, "separate: the cell (4,64) is outside the model's 4 layers x 32 dims")
    assert not (out / "matryoshka2d.json").exists()


# ---- an index and its query model, its files, its corpus ---------------------------------------------------------

DOCS = [
    {"_id": f"d{i}", "text": f"document number {i} talks about {w}"}
    for i, w in enumerate(["cats", "dogs", "rain", "guitars", "banks", "snow", "bikes", "music", "code", "tea"] * 6)
]


def write_corpus(path, docs=DOCS):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def other_weights_dir(tiny_dir, tmp_path_factory):
    """tiny_dir's model with one weight changed: the same shape, other weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-other")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    tensors = load_file(str(path / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("encoder.layer.0.attention.self.query.weight"))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def built(tiny_dir, tmp_path_factory):
    """A flat and an ivf index of the same corpus, cells 2:16 and 4:32, built from the command line."""
    root = tmp_path_factory.mktemp("second-pass-index")
    corpus = write_corpus(root / "corpus.jsonl")
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
    one_line_error(capsys, "weights sha256", "but the query model", "has other weights", "leave out --model")
    assert main(search_args(built / "flat", "--pooling", "cls")) == 2
    one_line_error(capsys, "documents were pooled with mean, the query model with cls")


def test_a_manifest_location_pointing_at_other_weights_is_refused(built, other_weights_dir, tmp_path, capsys):
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(built / "flat", moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["model"]["location"] = str(other_weights_dir)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert main(search_args(moved)) == 2
    one_line_error(capsys, "has other weights")


def test_query_layer_deeper_than_the_documents_is_refused(built, capsys):
    assert main(search_args(built / "flat", "--cell", "2:16", "--query-layer", "4")) == 2
    one_line_error(capsys, "--query-layer 4 is deeper than the documents of cell 2:16", "--query-layer 2 or less")
    assert main(search_args(built / "flat", "--cascade", "2:16,4:32", "--query-layer", "3")) == 2
    one_line_error(capsys, "cell 2:16")
    assert main(search_args(built / "flat", "--query-layer", "2")) == 0  # documents at layer 4
    assert main(search_args(built / "flat", "--cell", "2:16", "--query-layer", "2")) == 0  # symmetric


@pytest.mark.parametrize(("flag", "kind"), [("--nprobe", "ivf"), ("--ef-search", "flat")])
def test_search_breadth_must_be_positive(built, capsys, flag, kind):
    with pytest.raises(SystemExit) as exit_code:  # refused where it is parsed (rule 4)
        main(search_args(built / kind, flag, "0"))
    assert exit_code.value.code == 2
    one_line_error(capsys, f"{flag}: must be at least 1, got 0")


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
    line = one_line_error(capsys, *(CASES if recorded else CASES_WITHOUT_RECORD)[how])
    assert "--overwrite" in line


def test_a_resumed_build_refuses_a_corpus_edited_in_place(tiny_bert, tmp_path, monkeypatch, capsys):
    """Killed after two shards; one document of the first shard is edited at the same size: the resume is
    refused (it would have joined old vectors to the new text), and so is re-running a finished build."""
    from matryoshka2d.retrieval.index import IndexBuildError, build_index

    corpus = write_corpus(tmp_path / "corpus.jsonl")
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
    before = snapshot(tmp_path / "idx")
    with pytest.raises(IndexBuildError, match=r"changed since this build encoded it: documents 1\.\.8 \(shard 1\)"):
        build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)
    assert snapshot(tmp_path / "idx") == before
    corpus.write_text(text)  # restored: the build resumes and finishes
    manifest = build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)
    assert manifest["complete"] and manifest["documents"] == len(DOCS)
    corpus.write_text(edited)
    with pytest.raises(IndexBuildError, match="documents 1..8"):
        build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)


def test_eval_retrieval_refuses_a_query_layer_deeper_than_the_documents(tiny_dir, tmp_path, capsys):
    from test_eval_retrieval import beir

    corpus = [{"_id": f"d{i}", "title": "", "text": f"text {i} about {w}"} for i, w in enumerate("abcdefghijklmnop")]
    root = beir(tmp_path / "toy", corpus, [{"_id": "q1", "text": "a"}], [("q1", "d1", 1)])
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    assert main([*args, "--cascade", "1:8,3:32", "--query-layer", "4", "--output", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--query-layer 4 is deeper than the documents of the full cell 3:32")
    assert not (tmp_path / "o").exists()


# ---- result files and the model pick times ------------------------------------------------------------------------


def test_pick_checks_that_results_and_the_timed_model_are_one_model(
    tiny_dir, other_weights_dir, tmp_path, monkeypatch, capsys
):
    import shutil

    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))

    from test_eval_sts import sts_tree

    sts_tree(tmp_path / "data")
    common = ["--pooling", "mean", "--data-dir", str(tmp_path / "data"), "--layers", "1,4", "--dims", "8,32", "--quiet"]
    for name, model in (("a", tiny_dir), ("b", other_weights_dir)):
        assert main(["eval", "sts", "--model", str(model), *common, "--output", str(tmp_path / name)]) == 0
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert a["model"]["weights_sha256"] != b["model"]["weights_sha256"]
    capsys.readouterr()
    pick = ["pick", "--results", str(tmp_path / "a"), "--output", str(tmp_path / "pick")]
    assert main([*pick, "--model", str(other_weights_dir)]) == 2
    one_line_error(capsys, "are of", "but the model timed", "has other weights", "another's timings")
    assert not (tmp_path / "pick").exists()  # refused before timing anything or writing
    assert main(["pick", "--results", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    one_line_error(capsys, "the result files are of different models")
    assert main(pick) == 0  # the model named in the results: its own
    assert "warning" not in capsys.readouterr().err
    # A result file written before the checksum was recorded: a warning, not a refusal.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "a", old)
    del a["model"]["weights_sha256"]
    (old / "results.json").write_text(json.dumps(a))
    assert main(["pick", "--results", str(old), "--model", str(other_weights_dir)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "record no weights checksum" in err and "Traceback" not in err


# ---- serve ---------------------------------------------------------------------------------------------------------


def test_serve_checks_its_address_before_loading_the_model(tmp_path, capsys):
    import socket

    missing = str(tmp_path / "no-model")  # never loaded: the address is checked first
    for bad in ("70000", "-1"):
        with pytest.raises(SystemExit) as stopped:  # the range at parse time (rule 4)
            main(["serve", "--model", missing, "--port", bad])
        assert stopped.value.code == 2
        one_line_error(capsys, "argument --port: must be 0..65535", f"got {bad}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", missing, "--host", "127.0.0.1", "--port", str(port)]) == 2
        one_line_error(capsys, f"--port {port}: cannot listen there")


def test_exit_heads_on_one_side_and_off_on_the_other(tiny_dir, built, tokenizer, tmp_path, monkeypatch, capsys):
    """A folder with exit heads gives other vectors with --no-heads at a layer with a head: search says which flag
    matches the index; pick times the model the way its results were evaluated."""
    from test_eval_sts import sts_tree

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
    one_line_error(capsys, "vectors at layer 2 were made without an exit head", "applies one there: pass --no-heads")
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
