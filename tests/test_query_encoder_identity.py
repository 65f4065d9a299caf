"""A query encoder's record carries the checksum of its own weights and its width (docs/reliability.md, rule 7),
checked when it loads and wherever it meets documents: search, eval retrieval, serve, index build, export."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def student(teacher_dir, text_file, sts_dev, tmp_path_factory):
    """A query encoder of 2 layers distilled (2 steps) from the tiny teacher, and an index the teacher built."""
    from helpers.models import distill_config
    from matryoshka2d.training.distill import DistillTrainer

    work = tmp_path_factory.mktemp("query-student")
    options = {"mode": "query", "layer": 2}
    out = DistillTrainer(
        distill_config(teacher_dir, text_file, work / "q", sts_dev, method_options=options, steps=2)
    ).run(progress=False)
    corpus = work / "corpus.jsonl"
    lines = text_file.read_text().split("\n")[:20]
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(lines)))
    build = ["index", "build", "--model", str(teacher_dir), "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*build, "--cells", "4:16,4:32", "--output", str(work / "idx")]) == 0
    return out, work / "idx", corpus


@pytest.fixture
def student_copy(student, tmp_path):
    out, index, corpus = student
    folder = tmp_path / "student"
    shutil.copytree(out, folder)
    return folder, index, corpus


def _record(folder, **changes):
    path = folder / "matryoshka2d.json"
    meta = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            meta["distill"].pop(key, None)
        else:
            meta["distill"][key] = value
    path.write_text(json.dumps(meta))
    return meta["distill"]


def _search(folder, index, cell="4:32"):
    return main(["search", "--query", "red cat", "--query-model", str(folder), "--index", str(index), "--cell", cell])


def test_a_query_encoders_record_holds_its_own_checksum_and_width(student, capsys):
    from matryoshka2d.models.identity import weights_sha256

    out, index, _ = student
    record = json.loads((out / "matryoshka2d.json").read_text())["distill"]
    loaded = ElasticEncoder(str(out), device="cpu")
    assert record["weights_sha256"] == weights_sha256(loaded) and record["width"] == loaded.hidden_size == 32
    assert _search(out, index) == 0


def test_another_students_weights_under_an_intact_record_are_refused(student_copy, capsys):
    """Was: the record said nothing of the student's own weights, so any weights of the same shape passed."""
    from safetensors.torch import load_file, save_file

    folder, index, _ = student_copy
    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    weights = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    save_file(weights, str(folder / "model.safetensors"))
    assert _search(folder, index) == 2
    err = capsys.readouterr().err
    assert "own weights sha256" in err and "matryoshka2d.json" in err
    with pytest.raises(ValueError, match="another model's weights"):
        ElasticEncoder(str(folder), device="cpu")


def test_a_forged_record_of_another_width_is_refused(student, teacher_dir, tmp_path, capsys):
    """A query encoder of 16 numbers whose record claims the teacher (its own checksum and width recorded
    consistently): was accepted for an index of 32; widths were never compared."""
    from matryoshka2d.models.identity import weights_sha256

    out, index, _ = student
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    narrow = teacher.save(tmp_path / "narrow", keep_layers=2, dim=16)
    narrow_encoder = ElasticEncoder(str(narrow), device="cpu")
    assert narrow_encoder.hidden_size == 16
    record = json.loads((out / "matryoshka2d.json").read_text())["distill"]
    meta = json.loads((narrow / "matryoshka2d.json").read_text()) if (narrow / "matryoshka2d.json").is_file() else {}
    meta["distill"] = {**record, "weights_sha256": weights_sha256(narrow_encoder), "width": 16}
    (narrow / "matryoshka2d.json").write_text(json.dumps(meta))
    for cell in ("4:32", "4:16"):
        assert _search(narrow, index, cell) == 2
        assert "have 32 numbers, but the query encoder" in capsys.readouterr().err
    # A record whose width is not the folder's is refused when the folder loads.
    _record(narrow, width=32)
    with pytest.raises(ValueError, match="records vectors of 32 numbers, but the weights in .* give 16"):
        ElasticEncoder(str(narrow), device="cpu")


def test_a_query_encoder_record_without_its_own_checksum_is_refused_where_it_meets_documents(student_copy, capsys):
    folder, index, _ = student_copy
    _record(folder, weights_sha256=None, width=None)
    assert _search(folder, index) == 2
    assert "holds no checksum of its own weights" in capsys.readouterr().err


def test_eval_retrieval_and_serve_check_the_query_encoders_own_weights(student_copy, teacher_dir, capsys, monkeypatch):
    from matryoshka2d.retrieval.cascade import evaluate_cascade

    folder, _, _ = student_copy
    _record(folder, weights_sha256="0" * 64)
    monkeypatch.setattr("matryoshka2d.serve.process.serve_app", lambda *a, **k: None)  # never serve: a check must fail
    serve = ["serve", "--model", str(teacher_dir), "--pooling", "mean", "--port", "0", "--query-model", str(folder)]
    assert main(serve) == 2
    assert "own weights sha256 000000000000" in capsys.readouterr().err
    _record(folder, weights_sha256=None, width=None)  # as an earlier matryoshka2d wrote it
    student = ElasticEncoder(str(folder), device="cpu")
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    with pytest.raises(ValueError, match="holds no checksum of its own weights"):
        evaluate_cascade(teacher, [Path("unused")], "test", None, query_encoders=[student], show_progress=False)


def test_index_build_with_a_query_encoder_is_refused_and_says_to_use_the_teacher(student, tmp_path, capsys):
    """Was: exit 0, and an index nothing could search."""
    out, _, corpus = student
    build = ["index", "build", "--model", str(out), "--corpus", str(corpus), "--cells", "2:32"]
    assert main([*build, "--output", str(tmp_path / "idx")]) == 2
    err = capsys.readouterr().err
    assert "is a query encoder" in err and "Build the index with the teacher" in err and "--query-model" in err
    assert not (tmp_path / "idx").exists()


def test_a_query_encoders_exported_cell_states_its_own_checksum_and_width(student, tmp_path, capsys):
    """A folder written from a query encoder with other weights (an exported cell) gets its own checksum and width,
    not a copy of the student's, which would make it refuse to load."""
    from matryoshka2d.models.identity import weights_sha256

    out, index, _ = student
    export = tmp_path / "cell"
    assert main(["export", "--model", str(out), "--layer", "2", "--dim", "32", "--output", str(export)]) == 0
    cell = ElasticEncoder(str(export), device="cpu")
    record = json.loads((export / "matryoshka2d.json").read_text())["distill"]
    assert record["width"] == cell.hidden_size and record["weights_sha256"] == weights_sha256(cell)
    capsys.readouterr()
    assert _search(export, index) == 0
