"""Issue 32, the third hardening pass: no file outside a model folder is read, no model is replaced by its own export,
no NaN is passed on, and flags that would be ignored are refused (docs/reliability.md, section 9)."""

import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads import HEADS_FILE, HeadsError, fit_heads

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def heads_folder(tokenizer, tmp_path_factory):
    """A tiny model with closed-form exit heads, saved; tests copy it before they plant anything."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:300]
    rng = np.random.default_rng(5)
    texts = list(dict.fromkeys(" ".join(rng.choice(words, rng.integers(3, 8))) for _ in range(120)))
    encoder = ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", device="cpu"
    )
    heads, _ = fit_heads(encoder, [texts])
    encoder.set_exit_heads(heads)
    return encoder.save(tmp_path_factory.mktemp("with-heads"))


@pytest.fixture
def planted(heads_folder, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(heads_folder, folder)
    return folder


def _set_record(folder, **changes):
    meta_path = folder / "matryoshka2d.json"
    meta = json.loads(meta_path.read_text())
    meta["exit_heads"].update(changes)
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize("name", ["../../x/exit_heads.safetensors", "/etc/passwd", "ABSOLUTE"])
def test_a_heads_record_naming_a_file_outside_the_folder_is_refused_before_it_is_opened(
    planted, tmp_path, monkeypatch, name
):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((planted / HEADS_FILE).read_bytes())  # a real heads file, just not the folder's
    name = str(outside) if name == "ABSOLUTE" else name
    _set_record(planted, file=name)
    opened = []
    monkeypatch.setattr("matryoshka2d.models.heads_on_disk.file_sha256", lambda p: opened.append(p) or "x")
    with pytest.raises(HeadsError, match="only a file inside"):
        ElasticEncoder(str(planted), device="cpu")
    assert not opened  # not even hashed: a planted folder cannot test a local file's contents


@pytest.mark.parametrize("kind", ["nan", "inf", "int"])
def test_heads_holding_nan_inf_or_integers_are_refused_even_with_the_checksum_rerecorded(planted, kind):
    from safetensors.torch import load_file, save_file

    from matryoshka2d.files import file_sha256

    path = planted / HEADS_FILE
    tensors = load_file(str(path))
    key = sorted(tensors)[0]
    if kind == "int":
        tensors[key] = tensors[key].round().to(torch.int32)
    else:
        tensors[key].view(-1)[0] = float("nan") if kind == "nan" else float("inf")
    save_file(tensors, str(path))
    _set_record(planted, sha256=file_sha256(path))
    with pytest.raises(HeadsError, match="not a float tensor" if kind == "int" else "NaN or inf"):
        ElasticEncoder(str(planted), device="cpu")


def test_export_never_replaces_the_model_it_reads(planted, capsys):
    before = {p.name: p.read_bytes() for p in planted.iterdir() if p.is_file()}
    for output in (planted, planted / "cell", planted.parent):
        args = ["export", "--model", str(planted), "--layer", "2", "--dim", "16", "--output", str(output)]
        assert main([*args, "--overwrite"]) == 2
        assert f"--model {planted}" in capsys.readouterr().err  # rule 2: is, is inside, holds
    assert {p.name: p.read_bytes() for p in planted.iterdir() if p.is_file()} == before
    assert not (planted / "cell").exists()


def test_exit_head_options_without_exit_heads_are_refused(tiny_dir, triplets, tmp_path, capsys):
    base = ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--steps", "1"]
    for flag, value in (("--exit-heads-lr", "1e-3"), ("--exit-heads-inputs", "stack")):
        assert main([*base, "--output", str(tmp_path / flag), flag, value]) == 2
        assert f"{flag} set how exit heads train; they need --exit-heads" in capsys.readouterr().err
        assert not (tmp_path / flag).exists()


def test_serve_refuses_an_empty_layers_list(tiny_dir, capsys):
    args = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--backend", "onnx", "--layers", ""]
    assert main(args) == 2
    assert "--layers is empty" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_dir), "--pooling", "mean", "--layers", " "]) == 2
    assert "apply to --backend onnx" in capsys.readouterr().err


def test_pick_names_cells_with_nan_scores_and_picks_among_the_others(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    rows = [{"layer": n, "dim": d, "spearman": 40 + 5 * n + d / 8} for n in (1, 2, 4) for d in (8, 32)]
    rows[0]["spearman"] = rows[5]["spearman"] = float("nan")
    model = {"model": "tiny", "location": str(tiny_dir), "layers": 4, "hidden_size": 32, "pooling": "mean"}
    result = {"task": "sts", "metric": "spearman", "metrics": ["spearman"], "datasets": ["stsb"], "layers": [1, 2, 4]}
    result.update(dims=[8, 32], average=rows, model=model)
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "results.json").write_text(json.dumps(result))
    assert main(["pick", "--results", str(tmp_path / "sts")]) == 0
    out = capsys.readouterr()
    assert "2 cells have no finite score (NaN or inf) and are left out: (1,8) torch, (4,32) torch" in out.err
    chosen = json.loads((tmp_path / "sts" / "pick.json").read_text())["recommended"]
    assert (chosen["layer"], chosen["dim"]) != (4, 32) and np.isfinite(chosen["score"])


def test_a_run_stops_at_the_first_non_finite_loss_and_keeps_the_last_good_checkpoint(
    tiny_dir, triplets, sts_dev, tmp_path, monkeypatch
):
    from conftest import tiny_run
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


@pytest.mark.parametrize("bad_id", ["doc\n2", "doc\r2", "doc\u20282"])
def test_a_corpus_id_with_a_line_break_is_refused_naming_the_line(tiny_dir, tmp_path, capsys, bad_id):
    corpus = tmp_path / "corpus.jsonl"
    docs = [{"_id": "d1", "text": "a red cat"}, {"_id": bad_id, "text": "a blue dog"}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    args = ["index", "build", "--model", str(tiny_dir), "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*args, "--cells", "4:32", "--output", str(tmp_path / "idx")]) == 2
    assert f"{corpus}:2: _id {bad_id!r} holds a line break" in capsys.readouterr().err


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


def recording_bar(bars: list):
    """A stand-in for tqdm that records each bar made (into `bars`), its options, its moves and whether it closed."""

    class Bar:
        def __init__(self, **options):
            self.options, self.moves, self.closed = options, [], False
            bars.append(self)

        def update(self, n):
            self.moves.append(n)

        def close(self):
            self.closed = True

    return Bar


def test_index_build_shows_a_bar_over_the_documents_moved_by_every_forward_pass(tiny_dir, tmp_path, monkeypatch):
    """`index build` printed nothing until a shard (2,048 documents) was done: a bar with the corpus's total moves
    after every forward pass (tqdm gives the rate and the time left)."""
    from matryoshka2d.retrieval import index as index_module

    bars = []
    Bar = recording_bar(bars)

    monkeypatch.setattr(index_module, "tqdm", Bar)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"text number {i}"}) + "\n" for i in range(12)))
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    options = dict(batch_size=2, shard_size=8, log=lambda _: None, progress=True)
    index_module.build_index(encoder, corpus, [(4, 32)], tmp_path / "idx", **options)
    (bar,) = bars
    assert (bar.options["total"], bar.options["initial"], bar.options["unit"]) == (12, 0, "doc")
    assert sum(bar.moves) == 12 and len(bar.moves) >= 6  # every pass of at most 2 texts, not every shard of 8
    assert bar.closed


def test_heads_fit_shows_a_bar_over_the_sentences_it_will_use_moved_by_every_forward_pass(
    tiny_dir, text_file, tmp_path, monkeypatch
):
    """`heads fit` showed a count with no total: a bar whose total is the sentences the fit uses (the STS test
    sentences left out, at most --max-sentences) moves after every forward pass; off a terminal, the count lines."""
    from matryoshka2d.evaluate.sts import STS_SETS

    sentences = text_file.read_text().splitlines()  # 160 distinct
    for name in STS_SETS:  # two of them are STS test sentences
        a, b = (sentences[3], sentences[7]) if name == "sickr" else (f"{name} left", f"{name} right")
        path = tmp_path / "data" / "sts" / "raw" / f"{name}_test.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"sentence1\tsentence2\tscore\n{a}\t{b}\t3\n", encoding="utf-8")
    monkeypatch.setenv("MATRYOSHKA2D_DATA", str(tmp_path / "data"))
    bars = []
    Bar = recording_bar(bars)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("tqdm.auto.tqdm", Bar)
    fit = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(text_file), "--select", "mse"]
    for most, total in ((None, 158), (100, 100)):
        monkeypatch.setattr(sys, "stderr", Terminal())
        limit = ["--max-sentences", str(most)] if most else []
        assert main([*fit, *limit, "--output", str(tmp_path / f"bar{most}")]) == 0
        bar = bars.pop()
        assert (bar.options["total"], bar.options["unit"]) == (total, "sentence")
        assert sum(bar.moves) == total and max(bar.moves) <= 64 and len(bar.moves) >= 2  # every pass of 64 at most
        assert bar.closed and "sentences encoded" not in sys.stderr.getvalue()
        assert "2 sentences of the STS test sets were in --data" in sys.stderr.getvalue()  # not counted twice
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar, the count lines
    assert main([*fit, "--output", str(tmp_path / "lines")]) == 0
    assert not bars and "heads fit: 158 sentences encoded" in sys.stderr.getvalue()


def test_an_onnx_cache_that_is_a_file_is_refused_before_the_model_loads(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("matryoshka2d.cli.args.load_encoder", lambda *a, **k: pytest.fail("the model was loaded"))
    file = tmp_path / "cache"
    file.write_text("not a folder")
    for cache in (file, file / "graphs"):
        assert main(["serve", "--model", str(tiny_dir), "--backend", "onnx", "--onnx-cache", str(cache)]) == 2
        assert f"--onnx-cache {cache}: {file} is a file, not a folder" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the Ray watchdog reads /proc (Linux)")
def test_what_a_local_ray_leaves_of_a_build_killed_with_sigkill_is_ended():
    """A local Ray's agents outlived a killed `index build --engine ray` by 1-2 minutes: the watchdog the build
    starts ends every process descended from the build once the build is gone. Here stand-ins play Ray's
    processes: one the build started, and one that a child of the build (an agent, noted by the watchdog's first
    look) started after the watchdog and just before the build was killed, so no poll may have seen it: the
    watchdog's last look from the noted processes still finds it, whatever the machine's load."""
    import os
    import signal
    import subprocess
    import sys

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    build = f"""
import subprocess, sys, time
from matryoshka2d.retrieval.ray_watchdog import watch
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
head = subprocess.Popen({sleeper!r}, **quiet)
agent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; sys.stdin.readline(); "
    "print(subprocess.Popen({sleeper!r}).pid, flush=True); time.sleep(120)"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
dog = watch()
agent.stdin.write("go\\n")
agent.stdin.flush()
grandchild = int(agent.stdout.readline())
print(head.pid, grandchild, dog.pid, flush=True)
time.sleep(120)
"""
    other = subprocess.Popen(sleeper)  # not the build's: left alone
    driver = subprocess.Popen([sys.executable, "-c", build], stdout=subprocess.PIPE, text=True)
    head, grandchild, dog = (int(n) for n in driver.stdout.readline().split())
    try:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        for _ in range(600):  # the watchdog acts at once; this only bounds the wait
            if not _alive(dog):
                break
            time.sleep(0.05)
        assert not _alive(head) and not _alive(grandchild)
        assert _alive(other.pid)
    finally:
        other.kill()
        other.wait()
        for pid in (head, grandchild, dog):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap it counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
