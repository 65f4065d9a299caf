"""`matryoshka2d export`: a standalone cell that plain sentence-transformers, transformers and onnxruntime run."""

import itertools
import json

import numpy as np
import pytest
from safetensors import safe_open

from helpers.data import SENTENCES
from matryoshka2d.cli import main
from matryoshka2d.export.cell import ExportError, export_cell
from matryoshka2d.models.encoder import ElasticEncoder

TEXTS = [s for s in SENTENCES if s]


def layer_indices(folder) -> set[int]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {int(k.split("layer.")[1].split(".")[0]) for k in f.keys() if "layer." in k}  # noqa: SIM118


def test_tiny_cell_round_trip_through_the_cli(tiny_dir, tmp_path, capsys):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    out = tmp_path / "cell"
    assert (
        main(
            [
                "export",
                "--model",
                str(tiny_dir),
                "--pooling",
                "mean",
                "--layer",
                "2",
                "--dim",
                "16",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "parameters kept:" in printed and "size on disk, whole folder:" in printed
    source = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    theirs = SentenceTransformer(str(out), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(theirs, source.encode(TEXTS, layer=2, dim=16), atol=1e-5)
    cut = AutoModel.from_pretrained(str(out))
    assert cut.config.num_hidden_layers == 2 and len(cut.encoder.layer) == 2
    assert layer_indices(out) == {0, 1}  # the layers above are not on disk
    record = json.loads((out / "matryoshka2d.json").read_text())
    assert record["exported_cell"] == {"from": str(tiny_dir), "layer": 2, "dim": 16, "normalize": False}


def test_normalize_can_be_asked_for(tiny_bert, tmp_path):
    from sentence_transformers import SentenceTransformer

    export_cell(tiny_bert, 3, 8, tmp_path / "cell", normalize=True)
    theirs = SentenceTransformer(str(tmp_path / "cell"), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(theirs, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(theirs, tiny_bert.encode(TEXTS, layer=3, dim=8, normalize=True), atol=1e-5)


def test_onnx_and_int8_run_in_onnxruntime(tiny_bert, tmp_path):
    pytest.importorskip("onnxruntime", reason="the [onnx] extra (onnxruntime) is not installed")
    pytest.importorskip("onnxscript", reason="the [onnx] extra (onnxscript) is not installed")
    from matryoshka2d.export.onnx_graphs import ONNX_FILE, ONNX_INT8_FILE, OnnxCellEncoder

    sts = tmp_path / "stsb_test.tsv"
    rows = ["sentence1\tsentence2\tscore"] + [
        f"{a}\t{b}\t{i % 5}" for i, (a, b) in enumerate(itertools.pairwise(TEXTS))
    ]
    sts.write_text("\n".join(rows) + "\n")
    report = export_cell(tiny_bert, 2, 16, tmp_path / "cell", fmt="onnx", quantize="int8", sts_file=sts)
    expected = tiny_bert.encode(TEXTS, layer=2, dim=16)
    got = OnnxCellEncoder(tmp_path / "cell", ONNX_FILE).encode(TEXTS, batch_size=2)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    int8 = OnnxCellEncoder(tmp_path / "cell", ONNX_INT8_FILE).encode(TEXTS)
    assert int8.shape == expected.shape and np.isfinite(int8).all()
    assert set(report.sts) == {"torch fp32", "ONNX int8"}
    assert report.checks["onnxruntime fp32 vs encode()"] <= 1e-4
    assert any("ONNX int8" in line and "MiB" in line for line in report.lines())


def test_the_traced_graph_holds_for_any_batch_and_length(tiny_bert, tmp_path):
    """The TorchScript exporter traces two short sentences once; its graph must still compute encoder.forward for
    one text, a padded batch, and texts longer than the ones it was traced on."""
    ort = pytest.importorskip("onnxruntime")
    from matryoshka2d.export.onnx_graphs import export_exit, graph_exporter

    path = export_exit(tiny_bert, 2, tmp_path / "exit.onnx")
    assert graph_exporter(path) == "torchscript"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for texts in ([TEXTS[0]], TEXTS, ["word " * 60, TEXTS[1]]):
        features = tiny_bert.tokenize(texts)
        expected = tiny_bert.forward(features, [2])[2].detach().numpy()
        got = session.run(None, {i.name: features[i.name].numpy() for i in session.get_inputs()})[0]
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_a_failing_exporter_falls_back_to_the_next_and_says_so(tiny_bert, tmp_path, monkeypatch, capsys):
    pytest.importorskip("onnxscript", reason="the [onnx] extra (onnxscript) is not installed")
    from matryoshka2d.export import onnx_graphs as export

    def cannot_trace(*_):
        raise RuntimeError("cannot trace this model")

    monkeypatch.setitem(export._EXPORT, "torchscript", cannot_trace)
    path = export.export_exit(tiny_bert, 2, tmp_path / "exit.onnx")
    assert export.graph_exporter(path) == "dynamo"
    assert "torchscript: RuntimeError: cannot trace this model; written by dynamo" in capsys.readouterr().err
    monkeypatch.setitem(export._EXPORT, "dynamo", cannot_trace)
    with pytest.raises(ExportError, match="no torch.onnx exporter could export other.onnx: torchscript: .*; dynamo"):
        export.export_exit(tiny_bert, 2, tmp_path / "other.onnx")
    assert not (tmp_path / "other.onnx").exists()


def test_a_graph_that_does_not_hold_on_other_texts_is_not_kept(tiny_bert, tmp_path, monkeypatch, capsys):
    """A traced graph that computes something else than the module (as one specialised to the traced shapes
    would) is dropped for the next exporter's."""
    pytest.importorskip("onnxscript", reason="the [onnx] extra (onnxscript) is not installed")
    import torch

    from matryoshka2d.export import onnx_graphs as export

    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *features):
            return 2 * self.inner(*features)

    trace = export._EXPORT["torchscript"]
    # eval(): the exporter puts the module it was given back in the mode it found it in, submodules included
    monkeypatch.setitem(export._EXPORT, "torchscript", lambda graph, *rest: trace(Doubled(graph).eval(), *rest))
    path = export.export_exit(tiny_bert, 2, tmp_path / "exit.onnx")
    assert export.graph_exporter(path) == "dynamo"
    err = capsys.readouterr().err
    assert "torchscript: ExportError: its graph does not reproduce the model on other texts" in err


def test_minilm_cell_3_128_keeps_half_the_layers_and_matches(minilm, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    report = export_cell(minilm, 3, 128, tmp_path / "cell")
    theirs = SentenceTransformer(str(tmp_path / "cell"), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(theirs, minilm.encode(TEXTS, layer=3, dim=128, normalize=True), atol=1e-5)
    assert AutoModel.from_pretrained(str(tmp_path / "cell")).config.num_hidden_layers == 3
    assert layer_indices(tmp_path / "cell") == {0, 1, 2}
    per_layer = sum(p.numel() for p in minilm.model.encoder.layer[0].parameters())
    assert report.parameters_full - report.parameters_kept == 3 * per_layer  # three of six layers gone
    assert report.normalize  # minilm-l6 normalizes; so does its cell


def test_export_errors(tiny_bert, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match=r"--output .*full is not empty; pass --overwrite"):
        export_cell(tiny_bert, 2, 16, full)
    export_cell(tiny_bert, 2, 16, full, overwrite=True)
    assert not (full / "keep.txt").exists() and (full / "modules.json").is_file()
    with pytest.raises(ExportError, match="--quantize int8 quantizes the ONNX graph; add --format onnx"):
        export_cell(tiny_bert, 2, 16, tmp_path / "a", quantize="int8")
    with pytest.raises(ExportError, match="--format 'tflite' is not supported"):
        export_cell(tiny_bert, 2, 16, tmp_path / "a", fmt="tflite")
    with pytest.raises(ValueError, match="layer 9 is out of range for tiny-bert: it has 4 layers"):
        export_cell(tiny_bert, 9, 16, tmp_path / "a")
    with pytest.raises(ValueError, match="dim 64 is out of range for tiny-bert"):
        export_cell(tiny_bert, 2, 64, tmp_path / "a")
    assert not (tmp_path / "a").exists()  # nothing half-written
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["export", "--model", "minilm-l6", "--layer", "1", "--dim", "8", "--output", str(file)]) == 2
    assert "--output" in capsys.readouterr().err


def test_exported_folder_carries_the_config_keys_vllm_and_sglang_read(tiny_bert, tmp_path):
    from transformers import AutoConfig

    # A folder a 2dmse run saved: its record says which widths got a loss.
    trained = tiny_bert.save(
        tmp_path / "trained", metadata={"method": {"method": "2dmse"}, "trained_widths": [8, 16, 32]}
    )
    config = json.loads((trained / "config.json").read_text())
    assert (config["is_matryoshka"], config["matryoshka_dimensions"]) == (True, [8, 16, 32])

    export_cell(str(trained), 2, 16, tmp_path / "cell")
    # vLLM reads these as attributes of the Hugging Face config (PretrainedConfig keeps unknown keys).
    hf_config = AutoConfig.from_pretrained(str(tmp_path / "cell"))
    assert hf_config.is_matryoshka is True and hf_config.matryoshka_dimensions == [8, 16]
    assert hf_config.num_hidden_layers == 2
    # vLLM's rule (ModelConfig.is_matryoshka): a non-empty matryoshka_dimensions or is_matryoshka.
    assert bool(getattr(hf_config, "matryoshka_dimensions", None)) or getattr(hf_config, "is_matryoshka", False)
    card = (tmp_path / "cell" / "README.md").read_text()
    assert "- layers: 1, 2 (exit after any of them" in card and "- widths trained: 8, 16 (" in card


def test_a_folder_without_a_training_record_claims_only_its_width(tiny_bert, tmp_path):
    out = tiny_bert.save(tmp_path / "plain")
    config = json.loads((out / "config.json").read_text())
    assert (config["is_matryoshka"], config["matryoshka_dimensions"]) == (False, [32])
    assert "- layers: 1, 2, 3, 4 (" in (out / "README.md").read_text()
    # An older run's record without trained_widths: the method's own dims (2dmse lists those below D).
    old = tiny_bert.save(tmp_path / "old", metadata={"method": {"method": "2dmse", "dims": [8, 16]}})
    assert json.loads((old / "config.json").read_text())["matryoshka_dimensions"] == [8, 16, 32]
