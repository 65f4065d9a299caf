"""Files a folder names stay inside it (docs/reliability.md, rule 2: matryoshka2d.confined.inside and the confined
reader): a module path, a checkpoint file, teacher targets, an ONNX graph's external data, an index's files, an
exit heads record or a model's own record that leads out of its folder is refused before it is opened or hashed."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.data import write_targets
from helpers.models import set_heads_record
from matryoshka2d.cli import main
from matryoshka2d.files import file_sha256
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads import HEADS_FILE, HeadsError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_inside_refuses_every_way_out_and_names_the_folder_the_file_and_the_field(tmp_path):
    from matryoshka2d.confined import OutsideFolderError, inside

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


@pytest.mark.parametrize("name", ["../../x/exit_heads.safetensors", "/etc/passwd", "ABSOLUTE"])
def test_a_heads_record_naming_a_file_outside_the_folder_is_refused_before_it_is_opened(
    planted, tmp_path, monkeypatch, name
):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((planted / HEADS_FILE).read_bytes())  # a real heads file, just not the folder's
    name = str(outside) if name == "ABSOLUTE" else name
    set_heads_record(planted, file=name)
    opened = []
    monkeypatch.setattr("matryoshka2d.models.heads_on_disk.file_sha256", lambda p: opened.append(p) or "x")
    with pytest.raises(HeadsError, match="only a file inside"):
        ElasticEncoder(str(planted), device="cpu")
    assert not opened  # not even hashed: a planted folder cannot test a local file's contents


def test_a_model_record_is_read_inside_its_folder_only(tmp_path, monkeypatch):
    """merge and heads fit copy the model's matryoshka2d.json: it was read through a link out of the folder, and,
    for a model with no folder here, from the current folder."""
    from types import SimpleNamespace

    from matryoshka2d.cli.args import folder_metadata

    (tmp_path / "matryoshka2d.json").write_text('{"method": "someone else\'s"}')
    monkeypatch.chdir(tmp_path)
    assert folder_metadata(SimpleNamespace(location=None)) == {}
    model = tmp_path / "model"
    model.mkdir()
    assert folder_metadata(SimpleNamespace(location=str(model))) == {}
    (model / "matryoshka2d.json").symlink_to(tmp_path / "matryoshka2d.json")
    with pytest.raises(ValueError, match="leaves the model folder"):
        folder_metadata(SimpleNamespace(location=str(model)))
    (model / "matryoshka2d.json").unlink()
    (model / "matryoshka2d.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="matryoshka2d.json: not a JSON object"):
        folder_metadata(SimpleNamespace(location=str(model)))


# ---- checkpoints, teacher targets, graphs and indexes ----------------------------------------------------------------


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


def test_teacher_targets_that_link_out_of_the_run_are_refused_before_they_are_hashed(tmp_path, monkeypatch):
    from matryoshka2d.training import targets as targets_module
    from matryoshka2d.training.targets import FOLDER, VECTORS, TargetsError, TeacherTargets

    rng = np.random.default_rng(0)
    unit = rng.normal(size=(5, 8))
    texts = write_targets(tmp_path / "run", unit / np.linalg.norm(unit, axis=1, keepdims=True))
    vectors = tmp_path / "run" / FOLDER / VECTORS
    shutil.move(vectors, tmp_path / "outside.f16")
    vectors.symlink_to(tmp_path / "outside.f16")
    hashed = []
    monkeypatch.setattr(targets_module, "read_and_sign", lambda record, p: hashed.append(p) or ("x", "x"))
    with pytest.raises(TargetsError, match="leaves"):
        TeacherTargets(tmp_path / "run").load(texts, "t" * 64, 8)
    assert not hashed


def test_an_exported_graph_naming_external_data_outside_its_folder_is_refused_before_onnxruntime(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from matryoshka2d.export.onnx_graphs import ONNX_FILE, ExportError, OnnxCellEncoder

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


@pytest.fixture(scope="module")
def teacher_index(teacher_dir, text_file, tmp_path_factory):
    """An index the tiny teacher built of 20 lines of text_file, cells 4:16 and 4:32."""
    work = tmp_path_factory.mktemp("teacher-index")
    corpus = work / "corpus.jsonl"
    lines = text_file.read_text().split("\n")[:20]
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(lines)))
    build = ["index", "build", "--model", str(teacher_dir), "--pooling", "mean", "--corpus", str(corpus)]
    assert main([*build, "--cells", "4:16,4:32", "--output", str(work / "idx")]) == 0
    return work / "idx"


@pytest.mark.parametrize("name", ["ids.txt", "cell-4x32.faiss", "manifest.json"])
def test_index_files_that_link_out_of_the_index_are_refused_before_they_are_read(teacher_index, tmp_path, capsys, name):
    """The index's own files (named by its manifest, or the manifest itself) as links to copies outside it: was read
    and hashed, the message differing with what the file outside held."""
    from matryoshka2d.files import file_sha256 as real_sha256

    built = teacher_index
    index, outside = tmp_path / "idx", tmp_path / f"outside-{name}"
    shutil.copytree(built, index)
    shutil.move(index / name, outside)
    (index / name).symlink_to(outside)
    hashed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("matryoshka2d.retrieval.search.file_sha256", lambda p: hashed.append(p) or real_sha256(p))
        assert main(["search", "--query", "red cat", "--index", str(index), "--cell", "4:32"]) == 2
    assert "leaves" in capsys.readouterr().err and not [p for p in hashed if Path(p).name == name]
