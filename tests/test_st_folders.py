"""Model folders go through sentence-transformers: what it saves we load, what we save it loads, Normalize kept."""

import json

import numpy as np
import pytest

from helpers.data import SENTENCES
from matryoshka2d.cli import main
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.encoder import ElasticEncoder


@pytest.fixture(scope="module")
def st_saved(tmp_path_factory, tiny_dir):
    """A tiny model saved by the installed SentenceTransformer itself (Transformer, Pooling, Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    model = SentenceTransformer(
        modules=[Transformer(str(tiny_dir), max_seq_length=64), Pooling(32, pooling_mode="cls"), Normalize()],
        device="cpu",
    )
    path = tmp_path_factory.mktemp("st-saved")
    model.save(str(path))
    return path, model


def test_a_folder_saved_by_sentence_transformers_loads_with_the_same_embeddings(st_saved):
    path, model = st_saved
    pool_cfg = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert "pooling_mode" in pool_cfg or "pooling_mode_cls_token" in pool_cfg  # whichever format it writes
    ours = ElasticEncoder(str(path), device="cpu")
    assert (ours.pooling, ours.normalize_output, ours.max_length) == ("cls", True, 64)
    np.testing.assert_allclose(ours.encode(SENTENCES, normalize=True), model.encode(SENTENCES), atol=1e-5)


def test_info_reads_a_sentence_transformers_folder(st_saved, capsys):
    path, _ = st_saved
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pooling" in out and "cls" in out and "normalize" in out and "True" in out


def test_our_folder_loads_in_sentence_transformers_and_keeps_normalize(minilm, tmp_path):
    from sentence_transformers import SentenceTransformer

    assert minilm.normalize_output  # all-MiniLM-L6-v2 ships a Normalize module
    out = minilm.save(
        tmp_path / "m", keep_layers=2, metadata={"method": {"method": "2dmse", "kl_weight": 1.0}, "loss": "angle"}
    )
    theirs = SentenceTransformer(str(out), device="cpu")
    vectors = theirs.encode(SENTENCES)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors, minilm.encode(SENTENCES, layer=2, normalize=True), atol=1e-5)
    assert ElasticEncoder(str(out), device="cpu").normalize_output
    config = json.loads((out / "config_sentence_transformers.json").read_text())
    assert config["similarity_fn_name"] == "cosine"
    card = (out / "README.md").read_text()
    assert "2 transformer layers kept (of 6)" in card and "method: 2dmse" in card and "loss: angle" in card
    assert "Picking a cell" in card


def test_a_model_without_normalize_saves_without_it(tiny_bert, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = tiny_bert.save(tmp_path / "m")
    kinds = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
    assert kinds == ["Transformer", "Pooling"]
    np.testing.assert_allclose(
        SentenceTransformer(str(out), device="cpu").encode(SENTENCES), tiny_bert.encode(SENTENCES), atol=1e-5
    )


def test_the_card_shows_a_grid_an_evaluation_left_in_the_folder(tiny_bert, tmp_path):
    out = tmp_path / "m"
    (out / "eval").mkdir(parents=True)
    result = {
        "task": "sts",
        "metric": "spearman",
        "average": [{"layer": 2, "dim": 16, "spearman": 70.5}, {"layer": 4, "dim": 32, "spearman": 80.25}],
        "layers": [2, 4],  # read by the one reader of result files (rule 6), which needs what `eval` writes
        "dims": [16, 32],
    }
    (out / "eval" / "results.json").write_text(json.dumps(result))
    tiny_bert.save(out)
    card = (out / "README.md").read_text()
    assert "## Grid" in card and "| 4 |  | 80.25 |" in card and "| 2 | 70.50 |  |" in card


def test_a_module_we_cannot_run_is_named(st_saved, tmp_path):
    import shutil

    path, _ = st_saved
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    modules = json.loads((copy / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(BackboneError, match=r"modules.json entry 3 .*module LayerNorm is not supported"):
        ElasticEncoder(str(copy), device="cpu")
    modules[3] = {"idx": 3, "name": "3", "path": "x", "type": "sentence_transformers.models.NoSuchThing"}
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(BackboneError, match=r"entry 3 .*sentence-transformers cannot resolve this module"):
        ElasticEncoder(str(copy), device="cpu")


@pytest.mark.parametrize(
    "pooling_config",
    [
        {"embedding_dimension": 32, "pooling_mode": "lasttoken", "include_prompt": True},  # sentence-transformers 5+
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True},  # legacy
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},  # two on
        {"word_embedding_dimension": 32, "pooling_mode": "max"},
    ],
)
def test_plain_json_modules_read_as_sentence_transformers_reads_them(st_saved, tmp_path, pooling_config):
    """The JSON read of Transformer/Pooling/Normalize gives what sentence-transformers' classes give; a config it
    cannot read plainly (two pooling flags on) is left to sentence-transformers."""
    import shutil

    from sentence_transformers.util.misc import import_module_class

    from matryoshka2d.models.st_folder import read_sentence_config, settings_module

    folder = tmp_path / "model"
    shutil.copytree(st_saved[0], folder)
    modules = json.loads((folder / "modules.json").read_text())
    pooling = next(m for m in modules if m["type"].endswith("Pooling"))
    (folder / pooling["path"] / "config.json").write_text(json.dumps(pooling_config))
    for module in modules:
        plain = settings_module(module["type"], folder / module["path"])
        module_class = import_module_class(module["type"], str(folder), trust_remote_code=False)
        if module_class.__name__ == "Pooling":
            theirs = module_class.load(str(folder), subfolder=module["path"]).pooling_mode
            if plain is None:
                assert sum(bool(v) for k, v in pooling_config.items() if k.startswith("pooling_mode_")) > 1
                continue
            assert plain == ("Pooling", {"pooling_mode": theirs})
        elif module_class.__name__ == "Transformer":
            config = module_class.load_config(str(folder), subfolder=module["path"])
            assert plain == ("Transformer", {"max_seq_length": config.get("max_seq_length")})
        else:
            assert plain == ("Normalize", {})
    if pooling_config.get("pooling_mode") == "max":
        with pytest.raises(BackboneError, match="pooling mode 'max' is not supported"):
            read_sentence_config(str(folder))


def test_loading_a_plain_model_folder_does_not_import_sentence_transformers(st_saved):
    """sentence-transformers brings scikit-learn, pandas and pyarrow: about 200 MB of RSS that encode and serve
    do not need for Transformer, Pooling and Normalize."""
    import subprocess
    import sys

    code = (
        "import sys; from matryoshka2d.models.encoder import ElasticEncoder; "
        f"e = ElasticEncoder({str(st_saved[0])!r}, device='cpu'); "
        "print(e.pooling, 'sentence_transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["cls", "False"]
