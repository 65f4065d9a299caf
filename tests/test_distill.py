"""Distilled exits and query encoders (issue 34): `matryoshka2d distill` on tiny models built in code."""

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.data import write_targets
from helpers.models import distill_config
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training.distill import DistillError, DistillTrainer, default_widths
from matryoshka2d.training.targets import TargetsError, TeacherTargets
from matryoshka2d.training.texts import passages, read_texts

pytestmark = pytest.mark.usefixtures("one_thread")


def distance_to_teacher(encoder, teacher, texts, layer) -> float:
    """Mean 1 - cos between the student's cell (layer, full width) and the teacher's last layer."""
    s = encoder.encode(texts, layer=layer, normalize=True)
    t = teacher.encode(texts, normalize=True)
    return float(1 - (s * t).sum(1).mean())


def test_a_shared_student_moves_every_exit_towards_its_teacher(teacher_dir, text_file, sts_dev, tmp_path):
    texts = text_file.read_text().split("\n")[:40]
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    before = {n: distance_to_teacher(teacher, teacher, texts, n) for n in (1, 2, 3)}
    out = DistillTrainer(distill_config(teacher_dir, text_file, tmp_path / "run", sts_dev, steps=12)).run(
        progress=False
    )
    student = ElasticEncoder(str(out), device="cpu")
    assert student.exit_heads.layers == [1, 2, 3]
    after = {n: distance_to_teacher(student, teacher, texts, n) for n in (1, 2, 3)}
    assert all(after[n] < before[n] for n in (1, 2, 3)), (before, after)
    assert distance_to_teacher(student, teacher, texts, 4) < 0.05  # the last layer is tied to the teacher
    record = json.loads((out / "matryoshka2d.json").read_text())["distill"]
    assert record["mode"] == "shared" and record["texts"] == 160 and record["widths"] == [32]
    targets = TeacherTargets(out)
    assert targets.vectors_path.stat().st_size == 160 * 32 * 2  # float16, one row per distinct text
    np.testing.assert_allclose(
        targets.load(text_file.read_text().split("\n")[:160], record["teacher_weights_sha256"], 32)[:3],
        teacher.encode(texts[:3], normalize=True),
        atol=2e-3,
    )


def test_resume_is_bitwise_and_reuses_the_targets(teacher_dir, text_file, sts_dev, tmp_path, monkeypatch):
    whole = DistillTrainer(distill_config(teacher_dir, text_file, tmp_path / "whole", sts_dev, save_steps=3))
    whole.run(progress=False)
    original = DistillTrainer.train_step

    def dying(self):
        if self.step == 4:
            raise KeyboardInterrupt  # the last checkpoint is step 3
        return original(self)

    monkeypatch.setattr(DistillTrainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        DistillTrainer(distill_config(teacher_dir, text_file, tmp_path / "cut", sts_dev, save_steps=3)).run(
            progress=False
        )
    monkeypatch.setattr(DistillTrainer, "train_step", original)
    made = TeacherTargets(tmp_path / "cut").vectors_path.stat().st_mtime_ns
    computed = []
    monkeypatch.setattr(TeacherTargets, "compute", lambda *a, **k: computed.append(1))
    resumed = DistillTrainer(distill_config(teacher_dir, text_file, tmp_path / "cut", sts_dev, save_steps=3))
    resumed.run(resume=True, progress=False)
    assert not computed and TeacherTargets(tmp_path / "cut").vectors_path.stat().st_mtime_ns == made
    for key, value in whole.encoder.state_dict().items():
        assert torch.equal(value, resumed.encoder.state_dict()[key]), key


def _killed_run(teacher, text_file, dev, out):
    """A run killed after its first checkpoint (step 3 of 6), as kill -9 leaves it."""
    trainer = DistillTrainer(distill_config(teacher, text_file, out, dev, save_steps=3))
    original = trainer.train_step

    def dying():
        if trainer.step == 4:
            raise KeyboardInterrupt
        return original()

    trainer.train_step = dying
    with pytest.raises(KeyboardInterrupt):
        trainer.run(progress=False)
    return out


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("damage", ["deleted", "damaged", "record deleted"])
def test_resume_refuses_missing_or_damaged_targets_and_changes_nothing(
    damage, teacher_dir, text_file, sts_dev, tmp_path
):
    out = _killed_run(teacher_dir, text_file, sts_dev, tmp_path / "run")
    targets = TeacherTargets(out)
    if damage == "deleted":
        targets.vectors_path.unlink()
    elif damage == "damaged":
        data = bytearray(targets.vectors_path.read_bytes())
        data[10] ^= 0xFF
        targets.vectors_path.write_bytes(bytes(data))
    else:
        targets.record_path.unlink()
    before = _files(out)
    with pytest.raises(TargetsError, match="teacher-targets") as err:
        DistillTrainer(distill_config(teacher_dir, text_file, out, sts_dev, save_steps=3)).run(
            resume=True, progress=False
        )
    assert ("missing" if damage != "damaged" else "damaged") in str(err.value) and "--overwrite" in str(err.value)
    assert _files(out) == before


def test_resume_refuses_a_teacher_whose_weights_changed(tiny_dir, text_file, sts_dev, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_dir, teacher)
    out = _killed_run(teacher, text_file, sts_dev, tmp_path / "run")
    model = ElasticEncoder(str(teacher), pooling="mean", device="cpu").model
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[5] += 1.0
    model.save_pretrained(teacher)
    before = _files(out)
    with pytest.raises(TargetsError, match="the teacher changed since the run started"):
        DistillTrainer(distill_config(teacher, text_file, out, sts_dev, save_steps=3)).run(resume=True, progress=False)
    assert _files(out) == before


def test_a_new_run_reads_back_the_targets_its_folder_holds_and_refuses_others_by_name(
    teacher_dir, text_file, sts_dev, tmp_path, monkeypatch, capsys
):
    """A second recipe on the same texts (or a run stopped before its first checkpoint, run again) must not pay the
    teacher's pass again, nor lose the targets silently: they are read back when every check holds; targets of
    other texts are refused by name with the folder untouched; --overwrite recomputes them."""
    first = DistillTrainer(distill_config(teacher_dir, text_file, tmp_path / "first", sts_dev)).run(progress=False)
    second = tmp_path / "second"
    shutil.copytree(first / "teacher-targets", second / "teacher-targets")
    made = TeacherTargets(second).vectors_path.stat().st_mtime_ns
    computed = []
    real_compute = TeacherTargets.compute
    monkeypatch.setattr(TeacherTargets, "compute", lambda *a, **k: computed.append(1) or real_compute(*a, **k))
    capsys.readouterr()
    DistillTrainer(distill_config(teacher_dir, text_file, second, sts_dev, steps=2)).run(progress=False)
    assert not computed and TeacherTargets(second).vectors_path.stat().st_mtime_ns == made
    assert f"read back from {TeacherTargets(second).vectors_path}" in capsys.readouterr().out

    fewer = tmp_path / "fewer.txt"
    fewer.write_text("\n".join(text_file.read_text().split("\n")[:80]) + "\n", encoding="utf-8")
    other = tmp_path / "other"
    shutil.copytree(first / "teacher-targets", other / "teacher-targets")
    before = _files(other)
    with pytest.raises(TargetsError, match="targets.json: the targets are of other texts") as err:
        DistillTrainer(distill_config(teacher_dir, fewer, other, sts_dev, steps=2)).run(progress=False)
    assert "--overwrite" in str(err.value) and _files(other) == before
    DistillTrainer(distill_config(teacher_dir, fewer, other, sts_dev, steps=2)).run(progress=False, overwrite=True)
    assert computed == [1] and json.loads(TeacherTargets(other).record_path.read_text())["rows"] == 80


def test_a_query_encoder_keeps_n_layers_and_a_head_and_meets_only_its_teachers_index(
    teacher_dir, tiny_dir, text_file, sts_dev, tmp_path, capsys
):
    options = {"mode": "query", "layer": 2}
    run = distill_config(teacher_dir, text_file, tmp_path / "q2", sts_dev, method_options=options, exit_heads="fit")
    out = DistillTrainer(run).run(progress=False)
    student = ElasticEncoder(str(out), device="cpu")
    assert student.num_layers == 2 and student.head is not None and student.exit_heads is None
    record = json.loads((out / "matryoshka2d.json").read_text())["distill"]
    assert record["mode"] == "query" and record["layer"] == 2 and record["teacher_layers"] == 4
    corpus = tmp_path / "corpus.jsonl"
    lines = text_file.read_text().split("\n")[:30]
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(lines)))
    teacher_index, other_index = tmp_path / "idx", tmp_path / "idx-other"
    for model, index in ((teacher_dir, teacher_index), (tiny_dir, other_index)):
        build = ["index", "build", "--model", str(model), "--pooling", "mean", "--corpus", str(corpus)]
        assert main([*build, "--cells", "2:16,4:16,4:32", "--output", str(index)]) == 0
    search = ["search", "--query", lines[3], "--query-model", str(out), "--top-k", "3"]
    capsys.readouterr()
    assert main([*search, "--index", str(teacher_index), "--cell", "4:16"]) == 0
    assert "d3" in capsys.readouterr().out  # the query's own document among the top 3
    assert main([*search, "--index", str(other_index), "--cell", "4:32"]) == 2
    err = capsys.readouterr().err
    assert "was distilled from" in err and "other weights" not in err
    assert main([*search, "--index", str(teacher_index), "--cell", "2:16"]) == 2
    assert "shallow layer" in capsys.readouterr().err


def test_eval_retrieval_scores_a_query_encoder_next_to_its_teacher(teacher_dir, text_file, sts_dev, tmp_path):
    from matryoshka2d.retrieval.cascade import evaluate_cascade

    options = {"mode": "query", "layer": 1}
    run = distill_config(teacher_dir, text_file, tmp_path / "q1", sts_dev, method_options=options, steps=2)
    student = ElasticEncoder(str(DistillTrainer(run).run(progress=False)), device="cpu")
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    lines = text_file.read_text().split("\n")[:20]
    (beir / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(lines))
    )
    (beir / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": lines[i]}) + "\n" for i in range(5))
    )
    (beir / "qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(5)))
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    result = evaluate_cascade(teacher, [beir], "test", None, query_encoders=[student], show_progress=False)
    assert [r["mode"].split(" (")[0] for r in result["rows"]] == ["flat", f"query encoder {student.name}"]
    assert result["query_encoders"][0]["model"] == student.name
    other = ElasticEncoder(str(teacher_dir), pooling="cls", device="cpu")
    with pytest.raises(ValueError, match="pooled with cls"):
        evaluate_cascade(other, [beir], "test", None, query_encoders=[student], show_progress=False)


def test_bad_input_is_named_and_nothing_is_written(teacher_dir, text_file, sts_dev, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    base = [
        "distill",
        "--teacher",
        str(teacher_dir),
        "--pooling",
        "mean",
        "--no-exclude-sts-test",
        "--quiet",
        "--eval-file",
        str(sts_dev),
    ]
    assert main([*base, "--data", str(empty), "--output", str(tmp_path / "a")]) == 2
    assert "no sentences" in capsys.readouterr().err
    query = [*base, "--data", str(text_file), "--output", str(tmp_path / "b"), "--mode", "query", "--layer"]
    assert main([*query, "4"]) == 2
    assert "n in 1..3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_code:  # refused where it is parsed (rule 4)
        main([*query, "0"])
    assert exit_code.value.code == 2 and "argument --layer: must be at least 1, got 0" in capsys.readouterr().err
    assert main([*base, "--data", str(text_file), "--output", str(tmp_path / "c"), "--mode", "query"]) == 2
    assert "--mode query needs --layer n" in capsys.readouterr().err
    assert main([*base, "--data", str(text_file), "--output", str(tmp_path / "d"), "--layer", "2"]) == 2
    assert "--layer is for --mode query" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abcd")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    assert main([*base, "--data", str(text_file), "--output", str(taken)]) == 2
    assert "already holds a model or a run" in capsys.readouterr().err
    assert (taken / "config.json").read_text() == "{}"


def test_the_default_leaves_sts_test_sentences_out(teacher_dir, sts_dev, tmp_path, capsys):
    from matryoshka2d.evaluate.sts import sts_test_sentence_keys
    from matryoshka2d.paths import data_dir

    try:
        keys = sts_test_sentence_keys(data_dir())
    except FileNotFoundError:
        pytest.skip("no shared STS data here")
    data = tmp_path / "mixed.txt"
    from matryoshka2d.evaluate.sts import sentence_key

    sts = "A girl is styling her hair."  # an STS-B test sentence
    assert sentence_key(sts) in keys
    data.write_text("\n".join([sts, *(f"word{i} sentence number {i}" for i in range(50))]) + "\n")
    args = [
        "distill",
        "--teacher",
        str(teacher_dir),
        "--pooling",
        "mean",
        "--data",
        str(data),
        "--output",
        str(tmp_path / "o"),
    ]
    assert main([*args, "--steps", "1", "--quiet", "--eval-file", str(sts_dev), "--exit-heads", "identity"]) == 0
    record = json.loads((tmp_path / "o" / "matryoshka2d.json").read_text())["distill"]
    assert record["sts_test_sentences_left_out"] == 1 and record["texts"] == 50


def test_beir_documents_become_passages_of_at_most_max_length_tokens(tokenizer, tmp_path):
    long = " ".join(f"word{i}" for i in range(300))
    pieces = passages(long, tokenizer, 32)
    assert len(pieces) > 5 and all(len(tokenizer(p)["input_ids"]) <= 32 for p in pieces)
    assert " ".join(pieces) == long  # cut at token boundaries, nothing lost
    folder = tmp_path / "beir"
    folder.mkdir()
    docs = [
        {"_id": "a", "title": "T", "text": long},
        {"_id": "b", "text": "short one"},
        {"_id": "c", "text": "short one"},
    ]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    texts = list(read_texts([str(folder)], tokenizer, 32))
    assert texts[-1] == "short one" and len(texts) == len(pieces) + 1  # the duplicate document dropped
    assert default_widths(384) == [64, 128, 256, 384] and default_widths(768) == [64, 128, 256, 512, 768]
    with pytest.raises(DistillError, match="widths"):
        from matryoshka2d.training.distill import DistillObjective

        DistillObjective(4, 32, widths=[64])
    with pytest.raises(DistillError, match="no exit below"):
        DistillObjective(1, 32)


def test_the_relational_and_mse_losses_train_too(teacher_dir, text_file, sts_dev, tmp_path):
    for loss in ("relational", "mse"):
        trainer = DistillTrainer(distill_config(teacher_dir, text_file, tmp_path / loss, sts_dev, loss=loss, steps=2))
        trainer.run(progress=False)
        assert np.isfinite(trainer.history[-1]["loss"]) and trainer.history[-1]["loss"] > 0


def test_train_distill_from_adds_the_term_to_any_method(teacher_dir, triplets, sts_dev, tmp_path):
    from matryoshka2d.training.trainer import Trainer

    run = distill_config(teacher_dir, triplets, tmp_path / "t", sts_dev, method="2dmse", loss=None, exit_heads=None)
    run.method_options, run.distill_from, run.distill_weight, run.steps = {}, str(teacher_dir), 2.0, 3
    trainer = Trainer(run)
    assert trainer.teacher_term.widths == sorted(trainer.method.widths() | {32})
    trainer.run(progress=False)
    records = [json.loads(line) for line in (tmp_path / "t" / "train_log.jsonl").read_text().splitlines()]
    assert all(r["distill"] > 0 for r in records if "loss" in r)
    assert not any(p.requires_grad for p in trainer.teacher_term.teacher.parameters())  # the teacher stays frozen
    run.distill_weight = 0
    with pytest.raises(ValueError, match="--distill-weight must be greater than 0"):
        Trainer(run)


def test_serve_runs_a_query_encoder_next_to_its_teacher(teacher_dir, tiny_dir, text_file, sts_dev, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from helpers.server import app_of

    options = {"mode": "query", "layer": 2}
    out = DistillTrainer(
        distill_config(teacher_dir, text_file, tmp_path / "q", sts_dev, method_options=options, steps=2)
    ).run(progress=False)
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    student = ElasticEncoder(str(out), device="cpu")
    app = app_of(teacher, "teacher", queries={"teacher-query": student})
    with TestClient(app) as client:
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["teacher-query"]["query_encoder_of"] == "teacher" and listed["teacher-query"]["layers"] == [2]
        reply = client.post("/v1/embeddings", json={"model": "teacher-query", "input": ["red cat"], "dimensions": 16})
        assert reply.status_code == 200 and reply.json()["model"] == "teacher-query"
        expected = student.encode(["red cat"], dim=16, normalize=True)[0]
        np.testing.assert_allclose(reply.json()["data"][0]["embedding"], expected, atol=1e-5)
        documents = client.post("/v1/embeddings", json={"model": "teacher", "input": ["red cat"]}).json()
        np.testing.assert_allclose(
            documents["data"][0]["embedding"], teacher.encode("red cat", normalize=True), atol=1e-5
        )
        wrong = client.post("/v1/embeddings", json={"model": "teacher-query", "input": ["a"], "layer": 4})
        assert wrong.status_code == 400 and "query encoder of 2 layers" in wrong.json()["error"]["message"]
    serve = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0"]
    assert main([*serve, "--query-model", str(out)]) == 2
    assert "was distilled from" in capsys.readouterr().err
    assert main([*serve, "--query-model", str(tiny_dir)]) == 2
    assert "not a query encoder" in capsys.readouterr().err


def test_the_targets_computed_on_ray_are_the_local_ones(teacher_dir, text_file, sts_dev, tmp_path):
    pytest.importorskip("ray", reason="ray (the [ray] extra, in dev) is not installed")
    base = ["distill", "--teacher", str(teacher_dir), "--pooling", "mean", "--data", str(text_file), "--quiet"]
    base += ["--no-exclude-sts-test", "--eval-file", str(sts_dev), "--steps", "1", "--exit-heads", "identity"]
    assert main([*base, "--output", str(tmp_path / "local")]) == 0
    assert main([*base, "--output", str(tmp_path / "ray"), "--engine", "ray", "--workers", "1"]) == 0
    here, there = (TeacherTargets(tmp_path / name) for name in ("local", "ray"))
    assert json.loads(there.record_path.read_text())["engine"] == "ray"
    a = np.fromfile(here.vectors_path, dtype=np.float16).astype(np.float32)
    b = np.fromfile(there.vectors_path, dtype=np.float16).astype(np.float32)
    np.testing.assert_allclose(a, b, atol=2e-3)


def test_the_recipe_reproduces_the_measured_runs():
    from matryoshka2d.training.distill_recipe import recipe

    # docs/distill.md: SciFact passages + NLI (78,091 texts), minilm-l6 on NLI (37,276), mpnet-base on 10,000
    values, line = recipe("query", 6, 384, 78091, 64)
    assert values == {"lr": 2e-4, "epochs": 3.0, "passage_tokens": 48}
    assert "3,663 steps" in line and "lr 2e-4" in line and "full width 384" in line
    values, line = recipe("shared", 6, 384, 37276, 64)
    assert values == {"epochs": 3.5, "lr": 1e-4} and "2,041 steps" in line
    values, line = recipe("shared", 12, 768, 10000, 64)
    assert values == {"epochs": 5.0, "lr": 3e-4} and "785 steps" in line and "12-layer teacher" in line
    # the static run (docs/distill.md: the same 78,091 texts, 3 epochs at 3e-3, no weight decay, full width)
    values, line = recipe("static", 6, 384, 78091, 64)
    assert values == {"lr": 3e-3, "epochs": 3.0, "weight_decay": 0.0, "passage_tokens": 48}
    assert "3,663 steps" in line and "no weight decay" in line and "full width 384" in line and "static run" in line
    assert recipe("shared", 6, 384, 37276, 64)[0].keys() == {"epochs", "lr"}  # weight decay is static's alone
    assert recipe("shared", 6, 384, 37276, 64, choose=()) == ({}, "")  # every option given: nothing chosen


def test_a_bare_distill_runs_the_recipe_and_says_so_and_a_given_option_wins(
    teacher_dir, text_file, sts_dev, tmp_path, capsys
):
    corpus = tmp_path / "beir"
    corpus.mkdir()
    long = " ".join(text_file.read_text().split("\n")[:30])  # one document of some 150 tokens
    (corpus / "corpus.jsonl").write_text(json.dumps({"_id": "a", "text": long}) + "\n")
    base = ["distill", "--teacher", str(teacher_dir), "--pooling", "mean", "--no-exclude-sts-test", "--quiet"]
    base += ["--eval-file", str(sts_dev), "--exit-heads", "identity", "--mode", "query", "--layer", "2"]
    base += ["--data", str(corpus), str(text_file)]
    assert main([*base, "--output", str(tmp_path / "bare")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("distill recipe (--mode query)"))
    assert "lr 2e-4" in line and "3 epochs" in line and "passages of 48 tokens" in line and "full width 32" in line
    record = json.loads((tmp_path / "bare" / "matryoshka2d.json").read_text())
    assert record["distill"]["recipe"] == line and record["distill"]["passage_tokens"] == 48
    assert record["distill"]["widths"] == [32] and record["training"]["lr"] == 2e-4
    assert record["training"]["epochs"] == 3.0 and record["steps"] == 3 * 3
    assert main([*base, "--output", str(tmp_path / "given"), "--lr", "1e-3", "--steps", "2", "--max-length", "64"]) == 0
    out = capsys.readouterr().out
    assert "distill recipe" not in out  # nothing left for the recipe to choose but the loss's width, given by default
    record = json.loads((tmp_path / "given" / "matryoshka2d.json").read_text())
    assert record["training"]["lr"] == 1e-3 and record["distill"]["recipe"] is None
    assert record["distill"]["passage_tokens"] == 64 and record["distill"]["texts"] < record_texts(tmp_path / "bare")


def record_texts(folder) -> int:
    return json.loads((folder / "matryoshka2d.json").read_text())["distill"]["texts"]


@pytest.mark.parametrize("kind", ["zeros", "nan", "halved"])
def test_teacher_targets_that_are_not_unit_vectors_are_refused_naming_file_and_row(tmp_path, kind):
    """Was: an all-zero targets file, its checksum re-signed, was trained on."""
    from matryoshka2d.training.targets import TargetsError, TeacherTargets

    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(6, 8))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    good = write_targets(tmp_path / "good", vectors)
    assert TeacherTargets(tmp_path / "good").load(good, "t" * 64, 8).shape == (6, 8)
    if kind == "zeros":
        vectors[:] = 0
    elif kind == "nan":
        vectors[3, 2] = np.nan
    else:
        vectors[3:] /= 2
    texts = write_targets(tmp_path / "bad", vectors)
    row = 1 if kind == "zeros" else 4
    with pytest.raises(TargetsError, match=rf"targets.f16: row {row} has length .*not 1"):
        TeacherTargets(tmp_path / "bad").load(texts, "t" * 64, 8)


def _changed_under_the_run(path, how: str) -> None:
    """Another writer's change to a targets file a run has mapped: the same file written over (the same inode and
    size), another file renamed into its place, or the file cut short (reading a cut page would end the run with
    SIGBUS)."""
    data = path.read_bytes()
    if how == "rewritten in place":
        with open(path, "r+b") as f:
            f.write(np.frombuffer(data, dtype=np.float16)[::-1].tobytes())
    elif how == "replaced":
        other = path.with_name("other.f16")
        other.write_bytes(np.frombuffer(data, dtype=np.float16)[::-1].tobytes())
        other.replace(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(len(data) // 2)


@pytest.mark.parametrize(
    "how, when", [("rewritten in place", 2), ("replaced", 2), ("cut short", 2), ("replaced", "after the last step")]
)
def test_targets_changed_while_a_run_reads_them_stop_it_and_no_model_is_saved(
    teacher_dir, text_file, sts_dev, tmp_path, monkeypatch, capsys, how, when
):
    """Was: teacher targets rewritten while a run mapped them were trained on until exit 0, and the model saved.
    Every read of the mapped rows compares the file with the one checked, and the run checks it again before it
    saves its model: exit 2 naming the file, no model."""
    out = tmp_path / "run"
    hook = "write_records" if when == "after the last step" else "train_step"
    original = getattr(DistillTrainer, hook)

    def changing(self, *args):
        if self.step == (6 if when == "after the last step" else when):
            _changed_under_the_run(TeacherTargets(self.out).vectors_path, how)
        return original(self, *args)

    monkeypatch.setattr(DistillTrainer, hook, changing)
    args = ["distill", "--teacher", str(teacher_dir), "--pooling", "mean", "--data", str(text_file), "--quiet"]
    args += ["--max-texts", "48", "--steps", "6", "--batch-size", "8", "--eval-file", str(sts_dev)]
    assert main([*args, "--exit-heads", "identity", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "targets.f16" in err and "while the run read it" in err and "Traceback" not in err, err
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()


def test_before_its_model_is_saved_a_run_reads_its_targets_whole_against_their_signature(tmp_path, monkeypatch):
    """A change that leaves the file's times and inode as they were (a clock set back, a write through a mapping
    not yet flushed) passes the check of each read; the whole read against the signature, before the model is
    saved, still sees it."""
    from matryoshka2d.training import targets as targets_module

    rng = np.random.default_rng(2)
    vectors = rng.normal(size=(6, 8))
    texts = write_targets(tmp_path, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    mapped = TeacherTargets(tmp_path).load(texts, "t" * 64, 8)
    mapped.check_intact()
    path = TeacherTargets(tmp_path).vectors_path
    as_checked = mapped.state
    with open(path, "r+b") as f:
        f.write(np.frombuffer(path.read_bytes(), dtype=np.float16)[::-1].tobytes())
    monkeypatch.setattr(targets_module, "file_state", lambda p: as_checked)
    assert mapped[0].shape == (8,)  # the per-read check cannot tell
    with pytest.raises(TargetsError, match="targets.f16: its bytes changed while the run read it"):
        mapped.check_intact()


def test_a_relational_loss_on_a_batch_of_one_row_is_refused_naming_both(
    teacher_dir, text_file, sts_dev, tmp_path, capsys
):
    """--loss relational compares each text's similarities to the batch's other texts: at --batch-size 1 it is 0,
    and the run trained nothing for its whole length; refused before the teacher's targets (cos still trains)."""
    from helpers.cli import error_line, exit_code

    base = ["distill", "--teacher", teacher_dir, "--pooling", "mean", "--data", text_file, "--max-texts", "16"]
    base += ["--steps", "1", "--batch-size", "1", "--no-exclude-sts-test", "--eval-file", sts_dev, "--quiet"]
    base += ["--exit-heads", "identity"]
    assert exit_code([*base, "--loss", "relational", "--output", tmp_path / "r"]) == 2
    error_line(capsys, "--batch-size 1, and --loss relational compares each row with the other rows", "trains nothing")
    assert not (tmp_path / "r").exists()
    assert exit_code([*base, "--loss", "cos", "--output", tmp_path / "c"]) == 0
    # the same term added to a training run (train --distill-from), on data of one row: refused by its own option
    # where the task loss trains on one row (infonce with a hard negative)
    one = tmp_path / "one.tsv"
    one.write_text("anchor\tpositive\tnegative\nred cat runs\ta red cat\tblue fish swims\n")
    train = ["train", "--model", teacher_dir, "--pooling", "mean", "--data", one, "--loss", "infonce", "--steps", "1"]
    train += ["--eval-file", sts_dev, "--quiet", "--distill-from", teacher_dir]
    assert exit_code([*train, "--distill-loss", "relational", "--output", tmp_path / "t"]) == 2
    error_line(capsys, f"--data {one} holds 1 row, so every batch is that row, and --distill-loss relational")
    assert exit_code([*train, "--distill-loss", "cos", "--output", tmp_path / "t"]) == 0
