"""A query side and its documents' model as one sentence-transformers folder (issue 42): `export --query-model` and
`export --query-cell`, loaded by plain sentence-transformers and by ElasticEncoder; bad input refused."""

import json

import numpy as np
import pytest

from helpers.data import SENTENCES
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.distill import DistillTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = [s for s in SENTENCES if s]


@pytest.fixture(scope="module")
def student_dir(teacher_dir, text_file, tmp_path_factory):
    """A 2-layer query encoder distilled (a few steps) from the 4-layer tiny teacher."""
    out = tmp_path_factory.mktemp("pair-student") / "q2"
    config = TrainConfig(
        model=str(teacher_dir),
        pooling="mean",
        method="distill",
        loss="cos",
        data=[str(text_file)],
        output=str(out),
        batch_size=16,
        steps=3,
        lr=1e-3,
        save_steps=0,
        exit_heads="fit",
        exclude_sts_test=False,
        method_options={"mode": "query", "layer": 2},
    )
    return DistillTrainer(config).run(progress=False)


def export(*args) -> int:
    return main(["export", "--pooling", "mean", *map(str, args)])


@pytest.fixture(scope="module")
def teacher_pair(teacher_dir, student_dir, tmp_path_factory):
    """`export --model TEACHER --query-model STUDENT`, made once for the tests that read it: (the pair's folder, what
    the export printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("teacher-pair") / "pair"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export("--model", teacher_dir, "--query-model", student_dir, "--output", out) == 0
    return out, printed.getvalue()


def test_a_query_encoder_and_its_teacher_as_one_folder(teacher_dir, student_dir, teacher_pair):
    from sentence_transformers import SentenceTransformer

    out, printed = teacher_pair
    assert "encode_query: query encoder" in printed and "check, sentence-transformers encode_query" in printed
    pair = SentenceTransformer(str(out), device="cpu")
    student = SentenceTransformer(str(student_dir), device="cpu")
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    np.testing.assert_allclose(pair.encode_query(TEXTS), student.encode(TEXTS), atol=1e-5)
    np.testing.assert_allclose(pair.encode_document(TEXTS), teacher.encode(TEXTS), atol=1e-5)
    np.testing.assert_allclose(pair.encode(TEXTS), teacher.encode(TEXTS), atol=1e-5)  # the default route
    routes = json.loads((out / "router_config.json").read_text())["structure"]
    assert sorted(routes) == ["document", "query"]
    # ElasticEncoder: the document route is the model, the query route its query_encoder
    loaded = ElasticEncoder(str(out), device="cpu")
    assert loaded.num_layers == 4 and loaded.query_encoder.num_layers == 2 and loaded.route == "document"
    np.testing.assert_allclose(loaded.query_encoder.encode(TEXTS), student.encode(TEXTS), atol=1e-5)
    from matryoshka2d.models.identity import weights_sha256
    from matryoshka2d.models.query_record import query_encoder_record

    assert weights_sha256(loaded) == weights_sha256(teacher)  # an index of the teacher is an index of the pair
    from matryoshka2d.serve.graph_cache import weights_digest, weights_folder

    # the ONNX backend's graphs of each route in a subfolder of their own (both are layer-N.onnx): the graph cache
    # names a subfolder by the weights the graphs compute (rule 3), and the routes' weights differ
    assert weights_folder(weights_digest(loaded)) != weights_folder(weights_digest(loaded.query_encoder))
    assert query_encoder_record(loaded) is None and query_encoder_record(loaded.query_encoder)["layer"] == 2


def test_search_takes_the_pairs_query_route_for_an_index_of_its_teacher(
    teacher_dir, student_dir, teacher_pair, text_file, tmp_path, capsys
):
    lines = text_file.read_text().split("\n")[:30]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(lines)))
    index, (out, _) = tmp_path / "idx", teacher_pair
    build = ["index", "build", "--model", str(teacher_dir), "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*build, "--cells", "4:32", "--output", str(index)]) == 0
    capsys.readouterr()
    search = ["search", "--index", str(index), "--query", lines[3], "--top-k", "3", "--cell", "4:32"]
    assert main([*search, "--query-model", str(student_dir)]) == 0
    expected = capsys.readouterr().out
    assert main([*search, "--model", str(out)]) == 0  # the pair's documents route is the teacher itself
    assert "d3" in capsys.readouterr().out
    assert "d3" in expected
    assert main([*search, "--query-model", str(out)]) == 0  # the pair as --query-model: its query route
    assert capsys.readouterr().out == expected


def test_a_query_cell_and_the_last_layer_at_its_width(tiny_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "pair"
    assert export("--model", tiny_dir, "--query-cell", "2x16", "--output", out) == 0
    model = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    pair = SentenceTransformer(str(out), device="cpu")
    np.testing.assert_allclose(pair.encode_query(TEXTS), model.encode(TEXTS, layer=2, dim=16), atol=1e-5)
    np.testing.assert_allclose(pair.encode_document(TEXTS), model.encode(TEXTS, dim=16), atol=1e-5)
    loaded = ElasticEncoder(str(out), device="cpu")
    assert loaded.hidden_size == 16 and loaded.query_encoder.num_layers == 2
    record = json.loads((out / "matryoshka2d.json").read_text())["pair"]
    assert record["query"]["kind"] == "query cell" and record["document"]["layer"] == 4


def test_bad_pairs_are_named_and_nothing_is_written(teacher_dir, tiny_dir, student_dir, tmp_path, capsys):
    out = tmp_path / "pair"
    assert export("--model", tiny_dir, "--query-model", student_dir, "--output", out) == 2
    err = capsys.readouterr().err
    assert "was distilled from" in err and str(tiny_dir) in err
    assert export("--model", tiny_dir, "--query-cell", "5x16", "--output", out) == 2
    assert "layer 5 is deeper than" in capsys.readouterr().err
    assert export("--model", tiny_dir, "--query-cell", "4x16", "--output", out) == 2
    assert "not shallower than" in capsys.readouterr().err
    assert export("--model", tiny_dir, "--query-cell", "three", "--output", out) == 2
    assert "LAYERxDIM" in capsys.readouterr().err
    assert export("--model", tiny_dir, "--query-model", teacher_dir, "--output", out) == 2
    assert "not a query encoder" in capsys.readouterr().err
    assert not out.exists()
    before = sorted(p.name for p in student_dir.iterdir())
    for inside in (student_dir / "pair", student_dir):
        args = ("--model", teacher_dir, "--query-model", student_dir, "--output", inside, "--overwrite")
        assert export(*args) == 2
        assert f"--query-model {student_dir}: " in capsys.readouterr().err  # files.check_apart, as every command
    assert export("--model", teacher_dir, "--query-cell", "2x32", "--output", teacher_dir / "p") == 2
    assert f"is inside --model {teacher_dir}: " in capsys.readouterr().err
    assert sorted(p.name for p in student_dir.iterdir()) == before and not (teacher_dir / "p").exists()
    assert export("--model", tiny_dir, "--query-cell", "2x16", "--layer", "2", "--output", out) == 2
    assert "a pair's cells are its query side's" in capsys.readouterr().err


def test_onnx_writes_each_routes_transformer_where_sentence_transformers_onnx_backend_reads_it(tiny_dir, tmp_path):
    import onnxruntime as ort
    import torch
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path / "pair"
    args = ("--model", tiny_dir, "--query-cell", "2x32", "--output", out, "--format", "onnx", "--quantize", "int8")
    assert export(*args) == 0
    for route, layers in (("query", 2), ("document", 4)):
        folder = out / f"{route}_0_Transformer"
        assert {p.name for p in (folder / "onnx").iterdir()} == {"model.onnx", "model_qint8.onnx"}
        session = ort.InferenceSession(str(folder / "onnx/model.onnx"), providers=["CPUExecutionProvider"])
        assert [o.name for o in session.get_outputs()] == ["last_hidden_state"]  # what optimum's model reads
        features = AutoTokenizer.from_pretrained(str(folder))(TEXTS, padding=True, return_tensors="np")
        feed = {i.name: features[i.name] for i in session.get_inputs()}
        model = AutoModel.from_pretrained(str(folder))
        assert model.config.num_hidden_layers == layers
        expected = model(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state
        np.testing.assert_allclose(session.run(None, feed)[0], expected.detach().numpy(), atol=1e-4)


def test_langchain_huggingface_embeddings_reach_the_query_route(teacher_dir, student_dir, teacher_pair):
    from langchain_huggingface import HuggingFaceEmbeddings
    from sentence_transformers import SentenceTransformer

    out, _ = teacher_pair
    embeddings = HuggingFaceEmbeddings(
        model_name=str(out), encode_kwargs={"task": "document"}, query_encode_kwargs={"task": "query"}
    )
    student = SentenceTransformer(str(student_dir), device="cpu")
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    np.testing.assert_allclose(embeddings.embed_query(TEXTS[0]), student.encode(TEXTS[:1])[0], atol=1e-5)
    np.testing.assert_allclose(embeddings.embed_documents(TEXTS), teacher.encode(TEXTS), atol=1e-5)
