"""Layer 0, the static cell (issue 44): `distill --mode static`, and layer 0 wherever a cell goes, on tiny models
built in code. The teacher has a tokenizer of a few dozen word pieces, so that model2vec's own distillation (one
forward pass per token) runs here in a second, the same code path as on a real model."""

import json

import numpy as np
import pytest
import torch

from helpers.data import WORDS
from helpers.models import TINY
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.static import StaticCellError
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.distill import CLOSED_FORM, DistillError, DistillTrainer
from matryoshka2d.training.targets import TargetsError

pytestmark = pytest.mark.usefixtures("one_thread")

VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS) - {"swims"}), "swim", "##s"]


def small_teacher(folder, seed: int, vocabulary=VOCABULARY):
    """A tiny random BERT (no dropout, weights ~ N(0, 0.2) so that its layers differ) on a word-piece tokenizer of
    `vocabulary`, saved as a sentence-transformers folder with mean pooling."""
    import transformers as tf

    folder.mkdir(parents=True)
    tokenizer = tf.BertTokenizerFast(vocab={piece: i for i, piece in enumerate(vocabulary)})
    torch.manual_seed(seed)
    config = tf.BertConfig(
        vocab_size=len(vocabulary),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.2,
        **TINY,
    )
    model = tf.AutoModel.from_config(config).eval()
    ElasticEncoder.from_modules(model, tokenizer, pooling="mean", device="cpu").save(folder)
    return folder


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return small_teacher(tmp_path_factory.mktemp("static") / "teacher", seed=0)


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
    return small_teacher(tmp_path_factory.mktemp("static") / "other", seed=1)


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    """120 distinct sentences of 2 to 7 WORDS."""
    rng = np.random.default_rng(5)
    texts = list(dict.fromkeys(" ".join(rng.choice(WORDS, rng.integers(2, 8))) for _ in range(200)))[:120]
    path = tmp_path_factory.mktemp("static-data") / "sentences.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


def config(teacher, data, out, dev, **changes) -> TrainConfig:
    options = dict(
        model=str(teacher),
        method="distill",
        loss="cos",
        data=[str(data)],
        output=str(out),
        batch_size=16,
        steps=12,
        lr=1e-3,
        warmup_ratio=0.0,
        save_steps=0,
        eval_file=str(dev),
        method_options={"mode": "static"},
    )
    return TrainConfig(**{**options, **changes})


@pytest.fixture(scope="module")
def student(teacher, sentences, files, tmp_path_factory):
    """The static cell of `teacher`, distilled by model2vec, its head fitted in closed form, then 12 steps."""
    out = tmp_path_factory.mktemp("static-run") / "student"
    return DistillTrainer(config(teacher, sentences, out, files / "dev.tsv")).run(progress=False)


def distance(model: ElasticEncoder, teacher: ElasticEncoder, texts) -> float:
    """Mean 1 - cos between the model's layer 0 and the teacher's last layer."""
    s, t = model.encode(texts, layer=0, normalize=True), teacher.encode(texts, normalize=True)
    return float(1 - (s * t).sum(1).mean())


def test_distill_static_starts_from_model2vec_and_the_closed_form_head_and_trains_towards_the_teacher(
    student, teacher, sentences
):
    texts = sentences.read_text().split("\n")[:-1]
    teacher_model = ElasticEncoder(str(teacher), device="cpu")
    trained = ElasticEncoder(str(student), device="cpu")
    closed = ElasticEncoder(str(student / CLOSED_FORM), device="cpu")
    assert trained.layers == [0, 1, 2, 3, 4] and teacher_model.layers == [1, 2, 3, 4]
    # the transformer is the teacher's, untouched: only the cell learned
    theirs = teacher_model.model.state_dict()
    assert all(torch.equal(a, theirs[name]) for name, a in trained.model.state_dict().items())
    # the table is model2vec's (its tokenizer without special tokens), the head fitted then trained
    record = json.loads((student / "matryoshka2d.json").read_text())
    assert record["static"]["made"]["table"].startswith("model2vec distill_from_model, no PCA")
    assert record["static"]["vocabulary"] == trained.static_cell.vocabulary
    identity = trained.static_cell.encode(texts, head=False)  # the table's own means, in the model's space
    unit = teacher_model.encode(texts, normalize=True)
    raw = float(1 - (identity / np.linalg.norm(identity, axis=1, keepdims=True) * unit).sum(1).mean())
    assert distance(trained, teacher_model, texts) < distance(closed, teacher_model, texts) < raw
    distill = record["distill"]
    assert distill["mode"] == "static" and distill["layer"] == 0 and distill["teacher_layers"] == 4
    from matryoshka2d.models.identity import weights_sha256

    assert distill["teacher_weights_sha256"] == weights_sha256(teacher_model)
    log = [json.loads(line) for line in (student / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["eval"] == "dev.tsv@(0,32)"  # STS-B dev at the static cell


def test_plain_sentence_transformers_gives_encode_layer_0_from_the_model_folder_and_its_export(
    student, sentences, tmp_path
):
    from sentence_transformers import SentenceTransformer

    texts = [*sentences.read_text().split("\n")[:20], "", "unknownword red"]
    model = ElasticEncoder(str(student), device="cpu")
    inside = SentenceTransformer(str(student / "static"), device="cpu").encode(texts)
    assert np.abs(inside - model.encode(texts, layer=0)).max() <= 1e-5
    out = tmp_path / "cell"
    export = ["export", "--model", str(student), "--layer", "0", "--dim", "16", "--normalize", "--output", str(out)]
    assert main(export) == 0
    exported = SentenceTransformer(str(out), device="cpu")
    assert [type(m).__name__ for m in exported] == ["StaticEmbedding", "Dense", "Normalize"]
    expected = model.encode(texts, layer=0, dim=16, normalize=True)
    assert np.abs(exported.encode(texts) - expected).max() <= 1e-5
    # encode --layer 0 writes the same vectors
    (tmp_path / "in.txt").write_text("\n".join(texts[:20]) + "\n")
    args = ["encode", "--model", str(student), "--layer", "0", "--dim", "16", "--input", str(tmp_path / "in.txt")]
    assert main([*args, "--output", str(tmp_path / "e.npy")]) == 0
    assert np.abs(np.load(tmp_path / "e.npy") - model.encode(texts[:20], layer=0, dim=16)).max() <= 1e-6


def test_layer_0_goes_where_a_cell_goes_grids_backends_and_pick(student, tmp_path, monkeypatch, capsys):
    from matryoshka2d.evaluate.grid import EncoderCells
    from matryoshka2d.serve.backends import OnnxBackend, TorchBackend

    model = ElasticEncoder(str(student), device="cpu")
    texts = ["red cat runs", "old dog sleeps"]
    grid = EncoderCells(model, dims=[8, 32])
    assert grid.layers == [0, 1, 2, 3, 4]
    assert np.array_equal(grid.embed(texts)[(0, 8)], model.encode(texts, layer=0)[:, :8])
    torch_backend = TorchBackend(model)
    assert torch_backend.layers == [0, 1, 2, 3, 4]
    assert np.array_equal(torch_backend.pooled(texts, 0), model.encode(texts, layer=0))
    pytest.importorskip("onnxruntime")
    served = OnnxBackend(model, "int8", [0, 4], cache_folder=tmp_path / "graphs", log=lambda m: None)
    assert sorted(served.paths) == [4]  # no graph for the table: it stays in torch
    assert np.array_equal(served.pooled(texts, 0), model.encode(texts, layer=0))
    # pick: the static cell is its own point on the time axis, timed like every layer
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    rows = [{"layer": n, "dim": d, "spearman": 50 + 5 * n + d / 8} for n in (0, 2, 4) for d in (8, 32)]
    result = {
        "task": "sts",
        "metric": "spearman",
        "metrics": ["spearman"],
        "datasets": ["stsb"],
        "layers": [0, 2, 4],
        "dims": [8, 32],
        "average": rows,
        "model": {"model": "tiny", "location": str(student), "layers": 4, "hidden_size": 32, "pooling": "mean"},
    }
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "results.json").write_text(json.dumps(result))
    assert main(["pick", "--results", str(tmp_path / "sts"), "--max-bytes", "32"]) == 0
    picked = json.loads((tmp_path / "sts" / "pick.json").read_text())
    measured = picked["timing"]["ms_per_query"]
    assert set(measured) == {"0", "1", "2", "3", "4"}  # layer 0 measured like every layer
    zero = [p for p in picked["points"] if p["layer"] == 0]
    assert len(zero) == 2 and all(p["latency_ms"] == measured["0"] for p in zero)
    assert any(p["frontier"] for p in zero)  # the cheapest cell of all is on the frontier
    assert "(0,8)" in capsys.readouterr().out


def test_a_static_cell_searches_its_teachers_index_only(student, teacher, other_teacher, sentences, tmp_path, capsys):
    lines = sentences.read_text().split("\n")[:30]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(lines)))
    for model, index in ((teacher, "idx"), (other_teacher, "idx-other")):
        build = ["index", "build", "--model", str(model), "--corpus", str(corpus), "--cells", "4:32"]
        assert main([*build, "--output", str(tmp_path / index)]) == 0
    search = ["search", "--query", lines[3], "--query-model", str(student), "--top-k", "5"]
    capsys.readouterr()
    assert main([*search, "--index", str(tmp_path / "idx")]) == 0
    assert "1. d3 " in capsys.readouterr().out  # the query's own document first
    # the closed-form start the run keeps beside it is a query encoder of the same index, measured the same way
    start = ["search", "--query", lines[3], "--query-model", str(student / CLOSED_FORM), "--top-k", "5"]
    assert main([*start, "--index", str(tmp_path / "idx")]) == 0, capsys.readouterr().err
    assert main([*start, "--index", str(tmp_path / "idx-other")]) == 2
    assert "was distilled from" in capsys.readouterr().err
    assert main([*search, "--index", str(tmp_path / "idx-other")]) == 2
    assert "was distilled from" in capsys.readouterr().err
    assert main([*search, "--index", str(tmp_path / "idx"), "--query-layer", "2"]) == 2
    assert "query encoder" in capsys.readouterr().err
    # eval retrieval --query-model: its layer-0 queries against the teacher's documents, next to flat search
    from matryoshka2d.retrieval.cascade import evaluate_cascade

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text(corpus.read_text())
    (beir / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": lines[i]}) + "\n" for i in range(5))
    )
    (beir / "qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(5)))
    model = ElasticEncoder(str(student), device="cpu")
    result = evaluate_cascade(
        ElasticEncoder(str(teacher), device="cpu"), [beir], "test", None, query_encoders=[model], show_progress=False
    )
    assert result["rows"][1]["mode"].startswith(f"query encoder {model.name} (its static cell, layer 0)")
    with pytest.raises(ValueError, match="was distilled from"):
        evaluate_cascade(ElasticEncoder(str(other_teacher), device="cpu"), [beir], "test", None, query_encoders=[model])


def test_layer_0_of_a_model_without_a_static_cell_is_named(teacher, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("red cat\n")
    args = ["encode", "--model", str(teacher), "--layer", "0", "--input", str(tmp_path / "in.txt")]
    assert main([*args, "--output", str(tmp_path / "e.npy")]) == 2
    err = capsys.readouterr().err
    assert "holds none" in err and "distill --mode static" in err
    assert not (tmp_path / "e.npy").exists()
    from matryoshka2d.evaluate.grid import EncoderCells

    with pytest.raises(ValueError, match="static cell, which this model does not hold"):
        EncoderCells(ElasticEncoder(str(teacher), device="cpu"), layers=[0, 4], dims=[8])
    export = ["export", "--model", str(teacher), "--layer", "0", "--dim", "8", "--output", str(tmp_path / "x")]
    assert main(export) == 2
    assert "holds none" in capsys.readouterr().err


def test_a_damaged_or_foreign_static_cell_is_refused_when_the_model_loads(student, other_teacher, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(student, damaged)
    head = damaged / "static" / "1_Dense" / "model.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 0xFF
    head.write_bytes(bytes(data))
    with pytest.raises(StaticCellError, match=r"1_Dense/model.safetensors: the file is damaged"):
        ElasticEncoder(str(damaged), device="cpu")
    # the cell of one model put beside another model's transformer
    foreign = tmp_path / "foreign"
    shutil.copytree(other_teacher, foreign)
    shutil.copytree(student / "static", foreign / "static")
    meta = json.loads((foreign / "matryoshka2d.json").read_text()) if (foreign / "matryoshka2d.json").is_file() else {}
    meta["static"] = json.loads((student / "matryoshka2d.json").read_text())["static"]
    (foreign / "matryoshka2d.json").write_text(json.dumps(meta))
    with pytest.raises(StaticCellError, match="aligned to another backbone"):
        ElasticEncoder(str(foreign), device="cpu")


def test_static_mode_options_and_resume(teacher, other_teacher, sentences, files, tmp_path):
    import shutil

    dev = files / "dev.tsv"
    with pytest.raises(DistillError, match="--layer is for --mode query"):
        DistillTrainer(config(teacher, sentences, tmp_path / "a", dev, method_options={"mode": "static", "layer": 2}))
    with pytest.raises(DistillError, match="--exit-heads is for"):
        DistillTrainer(config(teacher, sentences, tmp_path / "b", dev, exit_heads="fit"))
    # a library caller's --eval-cell, as the command's: it would evaluate the teacher's frozen layers, not layer 0
    with pytest.raises(ValueError, match="--eval-cell 2:16 would evaluate the teacher's frozen layers"):
        DistillTrainer(config(teacher, sentences, tmp_path / "c", dev, eval_cell=[2, 16]))
    # killed after its checkpoint at step 3, resumed: the same cell as an uninterrupted run
    copy = tmp_path / "teacher"
    shutil.copytree(teacher, copy)
    out = tmp_path / "run"
    trainer = DistillTrainer(config(copy, sentences, out, dev, steps=6, save_steps=3))
    original = trainer.train_step

    def dying():
        if trainer.step == 4:
            raise KeyboardInterrupt
        return original()

    trainer.train_step = dying
    with pytest.raises(KeyboardInterrupt):
        trainer.run(progress=False)
    shutil.copytree(out, tmp_path / "run-again")
    resumed = DistillTrainer(config(copy, sentences, out, dev, steps=6, save_steps=3)).run(resume=True, progress=False)
    whole = DistillTrainer(config(copy, sentences, tmp_path / "whole", dev, steps=6)).run(progress=False)
    a = ElasticEncoder(str(resumed), device="cpu").static_cell.state_dict()
    b = ElasticEncoder(str(whole), device="cpu").static_cell.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a teacher whose weights changed since the run started: its cached targets are refused, as in every mode
    shutil.copy(other_teacher / "model.safetensors", copy / "model.safetensors")
    again = config(copy, sentences, tmp_path / "run-again", dev, steps=6, save_steps=3)
    with pytest.raises(TargetsError, match="the teacher changed since the run started"):
        DistillTrainer(again).run(resume=True, progress=False)


def test_a_bare_distill_mode_static_runs_the_static_recipe_and_says_so(teacher, sentences, files, tmp_path, capsys):
    """issue 42: the defaults are the measured recipe of each mode; the static run's (lr 3e-3, no weight decay,
    passages of 48 tokens, the loss on the full width the teacher's index holds), not shared mode's."""
    args = ["distill", "--teacher", str(teacher), "--mode", "static", "--data", str(sentences), "--quiet"]
    args += ["--no-exclude-sts-test", "--eval-file", str(files / "dev.tsv"), "--steps", "2"]
    assert main([*args, "--output", str(tmp_path / "bare")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("distill recipe (--mode static)"))
    assert "lr 3e-3" in line and "no weight decay" in line and "passages of 48 tokens" in line and "full width" in line
    record = json.loads((tmp_path / "bare" / "matryoshka2d.json").read_text())
    assert record["training"]["lr"] == 3e-3 and record["training"]["weight_decay"] == 0.0
    assert record["distill"]["widths"] == [32] and record["distill"]["passage_tokens"] == 48
    assert record["distill"]["recipe"] == line
    # a given option wins over the recipe
    assert main([*args, "--weight-decay", "0.1", "--lr", "1e-3", "--output", str(tmp_path / "given")]) == 0
    record = json.loads((tmp_path / "given" / "matryoshka2d.json").read_text())
    assert record["training"]["lr"] == 1e-3 and record["training"]["weight_decay"] == 0.1


def test_the_server_answers_layer_0_by_name_as_a_query_encoder_and_as_a_rung_of_adaptive_depth(student, teacher):
    """Layer 0 is served where a cell is: `layer: 0` (and MODEL@0xD), a static cell folder as the query side of its
    teacher (`serve --query-model`, input_type "query"), and a rung of the teacher's ladder (serve/ladder.py)."""
    from fastapi.testclient import TestClient

    from helpers.server import app_of
    from matryoshka2d.serve.depth import LayerCost, aligned_layers
    from matryoshka2d.serve.ladder import Ladder, Rung

    model = ElasticEncoder(str(student), device="cpu")
    texts = ["red cat sleeps", "blue dog"]
    expected = model.encode(texts, layer=0, normalize=True)
    assert aligned_layers(model)[0] == 0  # the static cell's head maps into the last layer's space
    with TestClient(app_of(model, "m")) as client:
        by_layer = client.post("/v1/embeddings", json={"model": "m", "input": texts, "layer": 0}).json()
        by_name = client.post("/v1/embeddings", json={"model": "m@0x16", "input": texts}).json()
        assert by_layer["layer"] == 0 and by_name["layer"] == 0
        np.testing.assert_allclose([d["embedding"] for d in by_layer["data"]], expected, atol=1e-5)
        np.testing.assert_allclose(
            [d["embedding"] for d in by_name["data"]],
            expected[:, :16] / np.linalg.norm(expected[:, :16], axis=1)[:, None],
            atol=1e-5,
        )
    documents = ElasticEncoder(str(teacher), device="cpu")
    full = documents.encode(texts, normalize=True)
    app = app_of(documents, "t", queries={"t-static": model}, query_layers={"t-static": 0})
    with TestClient(app) as client:
        queries = client.post("/v1/embeddings", json={"model": "t", "input": texts, "input_type": "query"}).json()
        assert {(d["layer"], d["encoder"]) for d in queries["data"]} == {(0, "t-static")}
        np.testing.assert_allclose([d["embedding"] for d in queries["data"]], expected, atol=1e-5)
        by_its_name = client.post("/v1/embeddings", json={"model": "t-static", "input": texts})  # no layer: its own
        assert by_its_name.status_code == 200 and by_its_name.json()["layer"] == 0, by_its_name.text
        np.testing.assert_allclose([d["embedding"] for d in by_its_name.json()["data"]], expected, atol=1e-5)
    # A ladder of the teacher's full depth and the static cell, the full depth far past any budget. A request that
    # finds the model idle delays nobody: the full depth. With work waiting (the ladder told so), open requests go
    # to the static cell and say so; documents and a named layer never move.
    slow = LayerCost({4: [(0.0, 1e6), (100.0, 1e6)]})
    cheap = LayerCost({0: [(0.0, 0.01), (100.0, 0.01)]})
    rungs = [Rung("t", 4, 1.0, cost=slow), Rung("t-static", 0, 0.8, cost=cheap)]
    idle = app_of(documents, "t", queries={"t-static": model}, query_layers={"t-static": 0},
                  ladder=Ladder(rungs, 50.0, cores=1.0))  # fmt: skip
    with TestClient(idle) as client:
        alone = client.post("/v1/embeddings", json={"model": "t", "input": texts}).json()
        assert {(d["layer"], d["encoder"]) for d in alone["data"]} == {(4, "t")}

    class Busy(Ladder):
        def choose(self, now, texts=1, idle=False):
            return super().choose(now, texts, idle=False)

    ladder = Busy([Rung("t", 4, 1.0, cost=slow), Rung("t-static", 0, 0.8, cost=cheap)], 50.0, cores=1.0)
    app = app_of(documents, "t", queries={"t-static": model}, query_layers={"t-static": 0}, ladder=ladder)
    with TestClient(app) as client:
        for body in ({}, {"layer": "auto"}):
            answer = client.post("/v1/embeddings", json={"model": "t", "input": texts, **body})
            reply = answer.json()
            assert reply["encoder"] == "t-static" and reply["layer"] == 0
            assert {(d["layer"], d["encoder"]) for d in reply["data"]} == {(0, "t-static")}
            assert (
                answer.headers["x-matryoshka2d-encoder"] == "t-static" and answer.headers["x-matryoshka2d-layer"] == "0"
            )
            np.testing.assert_allclose([d["embedding"] for d in reply["data"]], expected, atol=1e-5)
        document = client.post("/v1/embeddings", json={"model": "t", "input": texts, "input_type": "document"}).json()
        assert {(d["layer"], d["encoder"]) for d in document["data"]} == {(4, "t")}
        np.testing.assert_allclose([d["embedding"] for d in document["data"]], full, atol=1e-5)
        named = client.post("/v1/embeddings", json={"model": "t", "input": texts, "layer": 2}).json()
        assert named["layer"] == 2 and named["data"][0]["encoder"] == "t"
        described = client.get("/v1/models/t").json()["adaptive_depth"]
        assert [(r["encoder"], r["layer"], r["quality"]) for r in described["rungs"]] == [
            ("t", 4, 1.0),
            ("t-static", 0, 0.8),
        ]


def test_a_rung_of_another_models_space_is_refused_at_start(student, teacher, other_teacher, sentences, capsys):
    """--adaptive-depth with a query encoder of another model: refused before the server listens; with one of this
    model, and no exit heads, the ladder is the full depth and the static cell, its quality measured at start."""
    serve = ["serve", "--port", "0", "--adaptive-depth", "--query-model", str(student), "--max-length", "16"]
    assert main([*serve, "--model", str(other_teacher)]) == 2
    assert "was distilled from" in capsys.readouterr().err
    plain = ["serve", "--port", "0", "--adaptive-depth", "--model", str(teacher)]
    assert main(plain) == 2
    assert "no --query-model is served beside it" in capsys.readouterr().err


def test_the_ladder_measures_each_rungs_quality_on_the_texts_its_distill_record_names(student, teacher, sentences):
    from matryoshka2d.models.query_record import query_encoder_record
    from matryoshka2d.serve.backends import TorchBackend
    from matryoshka2d.serve.ladder import build_ladder, calibration_texts

    model = ElasticEncoder(str(student), device="cpu")
    documents = ElasticEncoder(str(teacher), device="cpu")
    texts, source = calibration_texts(None, [query_encoder_record(model)], documents.tokenizer)
    assert "sentence files" in source and texts[0] == sentences.read_text().split("\n")[0]
    ladder = build_ladder("t", TorchBackend(documents), [4], {"s": (TorchBackend(model), 0)}, 50.0, texts)
    full, static = ladder.rungs
    assert (full.encoder, full.layer, full.quality) == ("t", 4, 1.0)
    expected = float(
        np.mean(np.sum(model.encode(texts, layer=0, normalize=True) * documents.encode(texts, normalize=True), 1))
    )
    assert (static.encoder, static.layer) == ("s", 0) and static.quality == pytest.approx(expected, abs=1e-4)
    assert full.cost.layers == [4] and static.cost.layers == [0]


# ---- settings that would make layer 0 nothing, refused before any work --------------------------------------------


def test_a_teacher_whose_vocabulary_holds_none_of_the_texts_words_is_refused_before_any_work(
    sentences, files, tmp_path
):
    """A tokenizer that holds none of the texts' words (special tokens, and a word the texts never use) reads every
    word as [UNK]: the static cell gave one vector for every text, trained at that, and the run said nothing.
    Refused, naming the teacher and what its table reads, before the teacher's targets."""
    special = small_teacher(tmp_path / "special", seed=0, vocabulary=[*VOCABULARY[:5], "zebra"])
    out = tmp_path / "run"
    with pytest.raises(StaticCellError, match=r"reads every one of the 120 texts as the same tokens .*\[UNK\]") as e:
        DistillTrainer(config(special, sentences, out, files / "dev.tsv"))
    assert f"--teacher {special}" in str(e.value) and "one vector for every text" in str(e.value)
    assert not out.exists()


@pytest.fixture(scope="module")
def second_student(teacher, sentences, files, tmp_path_factory):
    """Another static cell of `teacher` (another seed and rate, a few steps): a soup's second ingredient."""
    out = tmp_path_factory.mktemp("static-run") / "second"
    return DistillTrainer(config(teacher, sentences, out, files / "dev.tsv", seed=7, lr=3e-3, steps=4)).run(
        progress=False
    )


def test_a_merge_of_static_students_averages_their_cells_and_says_so(
    student, second_student, teacher, sentences, tmp_path, capsys
):
    """Two static students of one teacher share its transformer untouched: the merge kept the first's layer 0 and
    dropped the second's, silently. Their cells are averaged like every weight; the merged folder is a query encoder
    of the same teacher that loads; a merge with a model without a cell is refused, naming both."""
    texts = sentences.read_text().split("\n")[:20]
    out = tmp_path / "soup"
    assert (
        main(["merge", "--models", str(student), str(second_student), "--weights", "0.3", "0.7", "--output", str(out)])
        == 0
    )
    assert "static cells (layer 0) of every model averaged and kept" in capsys.readouterr().out
    merged, first, second = (ElasticEncoder(str(f), device="cpu") for f in (out, student, second_student))
    a, b, m = first.static_cell.state_dict(), second.static_cell.state_dict(), merged.static_cell.state_dict()
    for key in m:
        torch.testing.assert_close(m[key], 0.3 * a[key] + 0.7 * b[key])
    assert not np.allclose(merged.encode(texts, layer=0), first.encode(texts, layer=0), atol=1e-4)
    from matryoshka2d.models.query_record import check_own_weights, query_encoder_record

    # the folder is a query encoder of the teacher's index, whose record states the merged weights
    assert query_encoder_record(merged)["mode"] == "static"
    check_own_weights(merged)  # its record states the merged weights' checksum
    capsys.readouterr()
    assert main(["merge", "--models", str(student), str(teacher), "--output", str(tmp_path / "mixed")]) == 2
    err = capsys.readouterr().err
    assert "query encoders average into one only when all are" in err and f"{teacher}: no query encoder" in err
    assert not (tmp_path / "mixed").exists()


def test_heads_fit_on_a_static_student_is_refused_before_the_fit_naming_the_model(student, sentences, tmp_path, capsys):
    """`heads fit` on a static student wrote a folder whose record vouched for other weights: it loaded nowhere."""

    def no_fit(*a, **k):
        raise AssertionError("heads were fitted")

    out = tmp_path / "heads"
    args = ["heads", "fit", "--model", str(student), "--data", str(sentences), "--output", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("matryoshka2d.models.heads_fit.fit_heads", no_fit)
        assert main([*args, "--no-exclude-sts-test", "--select", "mse"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--model {student}: a query encoder (`distill --mode static` of" in err and "Fit heads on the teacher" in err
    )
    assert not out.exists()


@pytest.mark.parametrize("backend", ["torch", "onnx", "onnx-int8"])
def test_pick_recommends_for_layer_0_only_commands_that_run(student, tmp_path, backend, capsys):
    """pick recommended `export --layer 0 --format onnx` for a static cell scored on ONNX, which export refuses (the
    table exports as a sentence-transformers folder only). Its commands are built through the commands' own checks:
    each line for layer 0 on each backend parses, and its export runs."""
    import shlex

    from matryoshka2d.cli import build_parser
    from matryoshka2d.pick.commands import deployment
    from matryoshka2d.pick.picker import Point

    lines = deployment(Point(0, 16, 70.0, 0.1, 64, backend=backend), str(student), (4, 32), retrieval=False)
    commands = {line.split(":")[0]: shlex.split(line.split("`")[1])[1:] for line in lines}
    assert set(commands) == {"serve", "export"}
    build_parser().parse_args(commands["serve"])  # serve's own options, checked as serve checks them (ServerConfig)
    export = [str(tmp_path / "cell") if word == "DIR" else word for word in commands["export"]]
    assert main(export) == 0, capsys.readouterr().err
    assert "--format" not in export
    if backend != "torch":
        assert "a sentence-transformers folder: --layer 0 is the static cell" in lines[1], lines[1]


def test_a_run_that_drops_the_static_cell_says_so_at_its_start(student, files, tmp_path, capsys):
    """train (or distill --mode shared/query) from a model with a static cell saved it without layer 0, silently:
    the cell was aligned to the transformer the run changes. The run says so at its start."""
    out = tmp_path / "trained"
    args = ["train", "--model", str(student), "--data", str(files / "triplets.tsv"), "--steps", "1", "--quiet"]
    assert main([*args, "--batch-size", "4", "--eval-file", str(files / "dev.tsv"), "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert "its static cell (layer 0) is not kept: training changes the transformer it was aligned to" in said
    assert ElasticEncoder(str(out), device="cpu").static_cell is None
