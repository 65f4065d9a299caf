"""Issue 41, rules 1, 3 and 7 of the fourth hardening pass (docs/reliability.md, section 11):

1. files a folder names stay inside it (matryoshka2d.files.inside, before anything is opened);
3. a cached ONNX graph is named by what it computes (the weights it was built from, and its precision), and a
   cache that cannot be written is used read-only;
7. a query encoder's record carries the checksum of its own weights and its width, checked when it loads and where
   it meets documents.
"""

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.files import file_sha256
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.encoder import ElasticEncoder

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["a red cat", "the old dog sleeps in the sun", "x"]


# ---- rule 1: files a folder names stay inside it -----------------------------------------------------------


def test_inside_refuses_every_way_out_and_names_the_folder_the_file_and_the_field(tmp_path):
    from matryoshka2d.files import OutsideFolderError, inside

    folder, outside = tmp_path / "folder", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    (folder / "in.txt").write_text("x")
    (folder / "out-link").symlink_to(outside)
    (folder / "in-link").symlink_to(folder / "in.txt")
    record = folder / "record.json"
    for name in ("../outside/x", "sub/../../outside/x", str(outside / "x"), "out-link/x", "out-link", "", None, 3):
        with pytest.raises(OutsideFolderError) as refused:
            inside(folder, name, record, "the field")
        assert str(record) in str(refused.value) and "the field" in str(refused.value)
        assert str(folder) in str(refused.value)
    assert inside(folder, "in-link", record, "f") == folder / "in-link"  # a link that stays inside is fine
    assert inside(folder, "sub", record, "f") == folder / "sub"
    assert inside(folder, "", record, "f", folder_itself=True) == folder


@pytest.fixture(scope="module")
def st_folder(tiny_bert, tmp_path_factory):
    """A tiny model saved as a sentence-transformers folder (modules.json: Transformer at '', Pooling in 1_Pooling)."""
    return tiny_bert.save(tmp_path_factory.mktemp("st-folder"))


@pytest.fixture
def planted_st(st_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(st_folder, folder)
    return folder


def _module_paths(folder, **paths):
    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        kind = module["type"].rpartition(".")[2]
        if kind in paths:
            module["path"] = paths[kind]
    (folder / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize("way", ["..", "absolute", "link"])
def test_a_transformer_module_path_outside_the_folder_is_refused_before_its_settings_are_read(
    planted_st, tmp_path, way
):
    """Was: the toolkit's own reader read sentence_bert_config.json from `../somewhere` and applied its length."""
    elsewhere = tmp_path / "somewhere"
    elsewhere.mkdir()
    (elsewhere / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 7}))
    if way == "link":
        (planted_st / "tx").symlink_to(elsewhere)
    path = {"..": "../somewhere", "absolute": str(elsewhere), "link": "tx"}[way]
    _module_paths(planted_st, Transformer=path)
    with pytest.raises(BackboneError, match="leaves") as refused:
        ElasticEncoder(str(planted_st), device="cpu")
    assert "modules.json" in str(refused.value) and "entry 0" in str(refused.value)


@pytest.mark.parametrize("way", ["..", "link"])
def test_a_pooling_module_path_outside_the_folder_is_refused_not_applied(planted_st, tmp_path, way):
    """Was: cls pooling from a config outside the folder was applied, while the recorded pooling check passed."""
    elsewhere = tmp_path / "pool"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, "pooling_mode": "cls"}))
    if way == "link":
        shutil.rmtree(planted_st / "1_Pooling")
        (planted_st / "1_Pooling").symlink_to(elsewhere)
    else:
        _module_paths(planted_st, Pooling="../pool")
    with pytest.raises(BackboneError, match="leaves") as refused:
        ElasticEncoder(str(planted_st), device="cpu")
    assert "entry 1" in str(refused.value)
    assert main(["info", str(planted_st)]) == 2  # a command: one line, exit 2


def test_checkpoint_files_that_link_out_of_the_checkpoint_are_refused_before_they_are_hashed(tmp_path, monkeypatch):
    from matryoshka2d.training import checkpoints

    folder, outside = tmp_path / "step-0000001", tmp_path / "outside.bin"
    folder.mkdir()
    outside.write_bytes(b"secret")
    for name in (checkpoints.TENSORS, checkpoints.STATE, checkpoints.CONFIG):
        (folder / name).write_text("{}")
    (folder / checkpoints.TENSORS).unlink()
    (folder / checkpoints.TENSORS).symlink_to(outside)
    files = {n: {"bytes": 6, "sha256": file_sha256(outside)} for n in (checkpoints.TENSORS,)}
    files |= {n: {"bytes": 2, "sha256": file_sha256(folder / n)} for n in (checkpoints.STATE, checkpoints.CONFIG)}
    (folder / checkpoints.MANIFEST).write_text(json.dumps({"files": files}))
    hashed = []
    monkeypatch.setattr(checkpoints, "file_sha256", lambda p: hashed.append(Path(p).name) or "x")
    with pytest.raises(checkpoints.CheckpointError, match="leaves"):
        checkpoints.verify(folder)
    assert checkpoints.TENSORS not in hashed


def _targets(folder, vectors: np.ndarray):
    """A targets folder holding `vectors` as float16 and a record that vouches for them (checksums re-signed)."""
    from matryoshka2d.training.targets import FOLDER, RECORD, VECTORS, texts_sha256

    (folder / FOLDER).mkdir(parents=True, exist_ok=True)
    (folder / FOLDER / VECTORS).write_bytes(vectors.astype(np.float16).tobytes())
    record = {
        "rows": len(vectors),
        "dim": vectors.shape[1],
        "sha256": file_sha256(folder / FOLDER / VECTORS),
        "texts_sha256": texts_sha256([f"t{i}" for i in range(len(vectors))]),
        "teacher_weights_sha256": "t" * 64,
    }
    (folder / FOLDER / RECORD).write_text(json.dumps(record))
    return [f"t{i}" for i in range(len(vectors))]


def test_teacher_targets_that_link_out_of_the_run_are_refused_before_they_are_hashed(tmp_path, monkeypatch):
    from matryoshka2d.training import targets as targets_module
    from matryoshka2d.training.targets import FOLDER, VECTORS, TargetsError, TeacherTargets

    rng = np.random.default_rng(0)
    unit = rng.normal(size=(5, 8))
    texts = _targets(tmp_path / "run", unit / np.linalg.norm(unit, axis=1, keepdims=True))
    vectors = tmp_path / "run" / FOLDER / VECTORS
    shutil.move(vectors, tmp_path / "outside.f16")
    vectors.symlink_to(tmp_path / "outside.f16")
    hashed = []
    monkeypatch.setattr(targets_module, "file_sha256", lambda p: hashed.append(p) or "x")
    with pytest.raises(TargetsError, match="leaves"):
        TeacherTargets(tmp_path / "run").load(texts, "t" * 64, 8)
    assert not hashed


@pytest.mark.parametrize("kind", ["zeros", "nan", "halved"])
def test_teacher_targets_that_are_not_unit_vectors_are_refused_naming_file_and_row(tmp_path, kind):
    """Was: an all-zero targets file, its checksum re-signed, was trained on."""
    from matryoshka2d.training.targets import TargetsError, TeacherTargets

    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(6, 8))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    good = _targets(tmp_path / "good", vectors)
    assert TeacherTargets(tmp_path / "good").load(good, "t" * 64, 8).shape == (6, 8)
    if kind == "zeros":
        vectors[:] = 0
    elif kind == "nan":
        vectors[3, 2] = np.nan
    else:
        vectors[3:] /= 2
    texts = _targets(tmp_path / "bad", vectors)
    row = 1 if kind == "zeros" else 4
    with pytest.raises(TargetsError, match=rf"targets.f16: row {row} has length .*not 1"):
        TeacherTargets(tmp_path / "bad").load(texts, "t" * 64, 8)


def test_an_exported_graph_naming_external_data_outside_its_folder_is_refused_before_onnxruntime(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from matryoshka2d.deploy.onnx_graphs import ONNX_FILE, ExportError, OnnxCellEncoder

    (tmp_path / "secret.bin").write_bytes(np.ones(4, np.float32).tobytes())
    weight = onnx.helper.make_tensor("w", onnx.TensorProto.FLOAT, [4], np.zeros(4, np.float32).tobytes(), raw=True)
    weight.ClearField("raw_data")
    weight.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "../../secret.bin"), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=value)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
        [weight],
    )
    path = tmp_path / "cell" / ONNX_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(onnx.helper.make_model(graph).SerializeToString())
    with pytest.raises(ExportError, match="'../../secret.bin', which leaves"):
        OnnxCellEncoder(tmp_path / "cell")


@pytest.mark.parametrize("name", ["ids.txt", "cell-4x32.faiss", "manifest.json"])
def test_index_files_that_link_out_of_the_index_are_refused_before_they_are_read(student, tmp_path, capsys, name):
    """The index's own files (named by its manifest, or the manifest itself) as links to copies outside it: was read
    and hashed, the message differing with what the file outside held."""
    from matryoshka2d.files import file_sha256 as real_sha256

    _, built, _ = student
    index, outside = tmp_path / "idx", tmp_path / f"outside-{name}"
    shutil.copytree(built, index)
    shutil.move(index / name, outside)
    (index / name).symlink_to(outside)
    hashed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("matryoshka2d.retrieval.search.file_sha256", lambda p: hashed.append(p) or real_sha256(p))
        assert main(["search", "--query", "red cat", "--index", str(index), "--cell", "4:32"]) == 2
    assert "leaves" in capsys.readouterr().err and not [p for p in hashed if Path(p).name == name]


# ---- rule 3: a cached graph is named by what it computes -----------------------------------------------------


@pytest.fixture(scope="module")
def two_models(tokenizer, tmp_path_factory):
    """Two tiny models of one shape and other weights (a teacher and its query encoder, as far as the cache sees)."""
    folders = []
    for seed in (0, 1):
        encoder = ElasticEncoder.from_modules(
            tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", device="cpu"
        )
        with torch.no_grad():  # the second one: other weights of the same shape
            for parameter in encoder.parameters():
                parameter.add_(0.05 * seed * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
        folders.append(encoder.save(tmp_path_factory.mktemp(f"model-{seed}")))
    return [ElasticEncoder(str(f), device="cpu") for f in folders]


@pytest.fixture(scope="module")
def shared_cache(two_models, tmp_path_factory):
    """One cache folder holding the layer-2 fp32 graphs of both models, built by real exports once here."""
    pytest.importorskip("onnxruntime")
    from matryoshka2d.deploy.backends import OnnxBackend

    root = tmp_path_factory.mktemp("shared-cache")
    for encoder in two_models:
        OnnxBackend(encoder, layers=[2], cache_folder=root, log=lambda _: None)
    return root


def _backend(encoder, root, quantize=None, layers=(2,)):
    from matryoshka2d.deploy.backends import OnnxBackend

    lines = []
    backend = OnnxBackend(encoder, quantize, layers=list(layers), cache_folder=root, log=lines.append)
    return backend, lines


def test_two_models_share_one_cache_folder_without_replacing_each_others_graphs(two_models, shared_cache, tmp_path):
    """Was: the query model's layer-2 graph replaced the teacher's in a shared --onnx-cache, the teacher's cells
    then answered with the query model's vectors, and every restart rebuilt every graph."""
    from matryoshka2d.deploy import backends

    root = tmp_path / "cache"
    shutil.copytree(shared_cache, root)
    exports = []
    real = backends.export_exit
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backends, "export_exit", lambda *a: exports.append(a[1]) or real(*a))
        for _ in range(2):  # a restart: both servers again
            for encoder in two_models:
                backend, lines = _backend(encoder, root)
                expected = encoder.pooled_states(TEXTS, [2])[2]
                np.testing.assert_allclose(backend.pooled(TEXTS, 2), expected, atol=1e-4)
                assert not any("rebuilt" in line or "building" in line for line in lines), lines
    assert exports == []
    folders = sorted(p.name for p in root.iterdir())
    assert len(folders) == 2 and all(name.startswith("weights-") for name in folders)


@contextlib.contextmanager
def read_only(*folders):
    """Make folders read-only for this process as a user would find them: chattr +i as root (whom permissions do
    not stop), chmod 555 otherwise; skip where neither makes a write fail."""
    as_root = os.geteuid() == 0
    for folder in folders:
        if as_root:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
                pytest.skip("cannot make a folder read-only here (chattr)")
        else:
            folder.chmod(0o555)
    try:
        probe = folders[0] / ".probe"
        try:
            probe.write_text("x")
            probe.unlink()
            pytest.skip("the folder could still be written")
        except OSError:
            pass
        yield
    finally:
        for folder in folders:
            if as_root:
                subprocess.run(["chattr", "-i", str(folder)])
            else:
                folder.chmod(0o755)


def test_a_read_only_cache_is_used_read_only_and_a_missing_graph_there_names_the_option(
    two_models, shared_cache, tmp_path
):
    """Was: a read-only cache holding the graph ignored, or a raw "[Errno 1] Operation not permitted"."""
    from matryoshka2d.deploy.onnx_graphs import ExportError

    encoder = two_models[0]
    root = tmp_path / "cache"
    shutil.copytree(shared_cache, root)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with read_only(root, *root.iterdir()):
        backend, _ = _backend(encoder, root)
        np.testing.assert_allclose(backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2], atol=1e-4)
        with pytest.raises(ExportError) as refused:
            _backend(encoder, root, layers=(1, 2))  # layer 1 was never built
        message = str(refused.value)
        assert str(root) in message and "--onnx-cache" in message and "layer 1" in message
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_a_read_only_model_folder_with_its_graph_cache_is_served_from_that_cache(two_models, shared_cache, tmp_path):
    from matryoshka2d.deploy.backends import CACHE_FOLDER, weights_digest, weights_folder

    model = tmp_path / "model"
    shutil.copytree(two_models[0].location, model)
    sub = weights_folder(weights_digest(two_models[0]))
    shutil.copytree(shared_cache / sub, model / CACHE_FOLDER / sub)
    encoder = ElasticEncoder(str(model), device="cpu")
    with read_only(model, model / CACHE_FOLDER, model / CACHE_FOLDER / sub):
        from matryoshka2d.deploy.backends import OnnxBackend

        backend = OnnxBackend(encoder, layers=[2], log=lambda _: None)
        assert backend.cache.root == model / CACHE_FOLDER
        np.testing.assert_allclose(backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2], atol=1e-4)


def _rerecord(folder, name, **changes):
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["graphs"][name] = {**manifest["graphs"][name], "sha256": file_sha256(folder / name), **changes}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def planted_link_message(encoder, shared_cache, tmp_path, content):
    """Serve from a cache whose layer-2 graph is a link to a file outside it (the graph itself, or other bytes),
    the manifest re-signed for that file; the line that refused it, with the cache's place left out."""
    from matryoshka2d.deploy import backends
    from matryoshka2d.deploy.backends import weights_digest, weights_folder

    root = tmp_path / content
    shutil.copytree(shared_cache, root)
    folder = root / weights_folder(weights_digest(encoder))
    outside = tmp_path / f"outside-{content}.onnx"
    if content == "graph":
        shutil.copyfile(folder / "layer-2.onnx", outside)
    else:
        outside.write_bytes(b"not a graph at all")
    (folder / "layer-2.onnx").unlink()
    (folder / "layer-2.onnx").symlink_to(outside)
    _rerecord(folder, "layer-2.onnx")  # the manifest vouches for the file outside
    kept, read, real = outside.read_bytes(), [], backends.file_sha256
    built = shared_cache / folder.name / "layer-2.onnx"  # a copy stands in for the export (seconds)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backends, "file_sha256", lambda p: read.append(Path(p).resolve()) or real(p))
        patch.setattr(backends, "export_exit", lambda encoder, layer, path: Path(shutil.copyfile(built, path)))
        backend, lines = _backend(encoder, root)
    assert outside.resolve() not in read  # not hashed, so nothing is learnt of its contents
    refused = [line for line in lines if "leaves" in line]
    assert len(refused) == 1 and "it is not read" in refused[0], lines
    assert outside.read_bytes() == kept and not (folder / "layer-2.onnx").is_symlink()
    np.testing.assert_allclose(backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2], atol=1e-4)
    return refused[0].replace(str(root), "ROOT")


def test_a_cached_graph_that_links_out_of_the_cache_is_refused_before_it_is_read(two_models, shared_cache, tmp_path):
    """Was: the link was followed, the file outside read and hashed, and the message depended on its checksum."""
    encoder = two_models[0]
    messages = [planted_link_message(encoder, shared_cache, tmp_path, content) for content in ("graph", "other")]
    assert messages[0] == messages[1]  # the message does not depend on what the outside file holds


def test_an_fp32_graph_under_the_int8_name_is_not_scored_or_served_as_int8(two_models, shared_cache, tmp_path):
    """Was: an fp32 graph copied over layer-2.int8.onnx, the manifest re-signed, passed the cosine check as int8."""
    from matryoshka2d.deploy.backends import weights_digest, weights_folder
    from matryoshka2d.deploy.graph_check import external_data_inside
    from matryoshka2d.deploy.onnx_graphs import graph_precision

    encoder = two_models[0]
    root = tmp_path / "cache"
    shutil.copytree(shared_cache, root)
    folder = root / weights_folder(weights_digest(encoder))
    _backend(encoder, root, "int8")  # the true int8 graph and its manifest entry
    assert graph_precision(external_data_inside(folder / "layer-2.int8.onnx")) == "int8"
    shutil.copyfile(folder / "layer-2.onnx", folder / "layer-2.int8.onnx")
    _rerecord(folder, "layer-2.int8.onnx", min_cosine_vs_torch=1.0)
    backend, lines = _backend(encoder, root, "int8")
    assert any("holds no quantized operator" in line and "rebuilt" in line for line in lines), lines
    assert graph_precision(external_data_inside(backend.paths[2])) == "int8"
    assert backend.describe()["precision"] == "int8"


# ---- rule 7: a query encoder's record carries its own checksum and width ------------------------------------


@pytest.fixture(scope="module")
def student(teacher_dir, text_file, sts_dev, tmp_path_factory):
    """A query encoder of 2 layers distilled (2 steps) from the tiny teacher, and an index the teacher built."""
    from matryoshka2d.training.distill import DistillTrainer
    from test_distill import config

    work = tmp_path_factory.mktemp("query-student")
    options = {"mode": "query", "layer": 2}
    out = DistillTrainer(config(teacher_dir, text_file, work / "q", sts_dev, method_options=options, steps=2)).run(
        progress=False
    )
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
    monkeypatch.setattr("matryoshka2d.deploy.server.serve", lambda *a, **k: None)  # never serve: a check must fail
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
