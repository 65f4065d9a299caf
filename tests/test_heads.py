"""Exit heads (issue 18): the closed-form fit, heads in the model folder, every place a cell is made, training."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.models import tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads import HEADS_FILE, ExitHeads, HeadsError
from matryoshka2d.models.heads_fit import NormalEquations, fit_heads


@pytest.fixture(scope="module")
def sentences(tokenizer):
    """Two hundred distinct short 'sentences' of real word pieces (more than the tiny model's 33 inputs)."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:400]
    rng = np.random.default_rng(1)
    return list(dict.fromkeys(" ".join(rng.choice(words, rng.integers(3, 9))) for _ in range(220)))[:200]


@pytest.fixture()
def encoder(tokenizer):
    return ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", name="tiny-bert", device="cpu"
    )


@pytest.fixture(scope="module")
def text_file(sentences, tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "sentences.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return path


def test_streamed_normal_equations_give_the_ridge_solution_of_all_rows():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(300, 6)), rng.normal(size=(300, 4))
    eq = NormalEquations.empty(6, 4)
    for part in np.array_split(np.arange(300), 7):  # batch by batch, as the fit streams
        eq.add(x[part], y[part])
    strength = 3.0
    x1 = np.hstack([x, np.ones((300, 1))])
    penalty = np.diag([strength] * 6 + [0.0])
    expected = np.linalg.solve(x1.T @ x1 + penalty, x1.T @ y)
    np.testing.assert_allclose(eq.solve(strength), expected, atol=1e-10)
    assert eq.squared_error(expected) == pytest.approx(float(((x1 @ expected - y) ** 2).sum()), rel=1e-9)


def test_fitted_heads_map_shallow_layers_onto_the_last_and_leave_it_alone(encoder, sentences):
    heads, report = fit_heads(encoder, [sentences[:120], sentences[120:]])
    assert heads.layers == [1, 2, 3] and report.sentences == 200 and report.held_out == 20
    assert set(report.strengths) == {1, 2, 3}
    raw = encoder.pooled_states(sentences, [1, 4], pooled=True)
    target = raw[4] / np.linalg.norm(raw[4], axis=1, keepdims=True)
    before = np.mean((raw[1] - target) ** 2)
    encoder.set_exit_heads(heads)
    after = encoder.encode(sentences, layer=1)
    assert np.mean((after - target) ** 2) < 0.5 * before  # closer to the last layer's space
    np.testing.assert_array_equal(encoder.encode(sentences, layer=4), encoder.encode(sentences, layer=4, heads=False))
    np.testing.assert_allclose(encoder.encode(sentences, layer=1, heads=False), raw[1], atol=1e-6)


def test_fit_refuses_no_data_and_too_few_sentences(encoder, sentences):
    with pytest.raises(HeadsError, match="holds no sentences"):
        fit_heads(encoder, [])
    with pytest.raises(HeadsError, match=r"fitting needs more sentences than that \(give at least 64\)"):
        fit_heads(encoder, [sentences[:30]])
    with pytest.raises(HeadsError, match=r"--layers \[4\]: exit heads go on layers 1..3"):
        fit_heads(encoder, [sentences], layers=[4])


def _dev_pairs(encoder, sentences):
    """A stand-in for STS-B dev: pairs of the sentences, scored by the last layer's own cosine."""
    from matryoshka2d.evaluate.sts import PairSet

    first, second = sentences[:60], sentences[60:120]
    top = encoder.encode(first + second, layer=encoder.num_layers, heads=False)
    return PairSet("dev", Path("dev.tsv"), first, second, (top[:60] * top[60:]).sum(1).astype(np.float64))


def test_the_ridge_strength_is_given_or_chosen_on_sts_dev(encoder, sentences):
    from matryoshka2d.models.heads_fit import RIDGE_GRID

    given, report = fit_heads(encoder, [sentences], ridge=0.5)
    assert report.strengths == {1: 0.5, 2: 0.5, 3: 0.5} and given.record["ridge_chosen_by"] == "given (--ridge)"
    dev = _dev_pairs(encoder, sentences)
    chosen, report = fit_heads(encoder, [sentences], select="sts-dev", dev=dev)
    for layer in (1, 2, 3):
        scores = report.dev_spearman[layer]
        assert set(scores) == set(RIDGE_GRID) and all(-1 <= v <= 1 for v in scores.values())
        assert report.strengths[layer] == max(scores, key=scores.get)
    assert chosen.record["ridge_chosen_by"] == "STS-B dev Spearman"
    with pytest.raises(HeadsError, match="--select sts-dev needs the STS-B dev pairs"):
        fit_heads(encoder, [sentences], select="sts-dev")
    with pytest.raises(HeadsError, match=r"--ridge -1.0: .* must be > 0"):
        fit_heads(encoder, [sentences], ridge=-1.0)


def test_heads_fit_sts_dev_without_the_dev_file_names_it(tiny_dir, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MATRYOSHKA2D_DATA", str(tmp_path))
    args = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(text_file)]
    assert main([*args, "--select", "sts-dev", "--output", str(tmp_path / "h"), "--quiet"]) == 2
    assert f"no STS-B dev file at {tmp_path / 'sts' / 'raw' / 'stsb_dev.tsv'}" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
    assert main([*args, "--output", str(tmp_path / "auto"), "--quiet"]) == 0  # the default falls back, and says so
    printed = capsys.readouterr()
    assert "chosen by held-out squared error (--select mse)" in printed.err
    assert "ridge strength held-out mse" in printed.out
    lines = text_file.read_text().split("\n")
    dev = tmp_path / "sts" / "raw" / "stsb_dev.tsv"
    dev.parent.mkdir(parents=True)
    rows = [f"{a}\t{b}\t{i % 5}" for i, (a, b) in enumerate(zip(lines[:40], lines[40:80], strict=True))]
    dev.write_text("sentence1\tsentence2\tscore\n" + "\n".join(rows) + "\n")
    assert main([*args, "--select", "sts-dev", "--output", str(tmp_path / "h"), "--quiet"]) == 0
    assert "ridge strength STS-B dev Spearman" in capsys.readouterr().out
    assert main([*args, "--output", str(tmp_path / "auto2"), "--quiet"]) == 0  # found: the default uses it
    assert "ridge strength STS-B dev Spearman" in capsys.readouterr().out


def _saved_with_heads(encoder, sentences, folder):
    heads, _ = fit_heads(encoder, [sentences])
    encoder.set_exit_heads(heads)
    encoder.save(folder, metadata={"method": {"name": "plain"}})
    return folder


def test_heads_live_in_the_folder_and_load_with_it(encoder, sentences, tmp_path):
    folder = _saved_with_heads(encoder, sentences, tmp_path / "m")
    record = json.loads((folder / "matryoshka2d.json").read_text())["exit_heads"]
    assert record["layers"] == [1, 2, 3] and record["file"] == HEADS_FILE and len(record["backbone_sha256"]) == 64
    assert json.loads((folder / "matryoshka2d.json").read_text())["method"] == {"name": "plain"}
    loaded = ElasticEncoder(str(folder), device="cpu")
    assert loaded.exit_heads is not None and loaded.folder_has_heads
    np.testing.assert_allclose(
        loaded.encode(sentences[:20], layer=2, dim=16), encoder.encode(sentences[:20], layer=2, dim=16), atol=1e-5
    )
    off = ElasticEncoder(str(folder), device="cpu", heads=False)
    assert off.exit_heads is None and off.folder_has_heads
    np.testing.assert_allclose(
        off.encode(sentences[:20], layer=2), encoder.encode(sentences[:20], layer=2, heads=False), atol=1e-5
    )
    # Saving again keeps them: a model never silently loses its heads.
    loaded.save(tmp_path / "again")
    assert ElasticEncoder(str(tmp_path / "again"), device="cpu").exit_heads.layers == [1, 2, 3]


def test_a_damaged_heads_file_or_record_is_refused(encoder, sentences, tmp_path):
    folder = _saved_with_heads(encoder, sentences, tmp_path / "m")
    data = bytearray((folder / HEADS_FILE).read_bytes())
    data[-5] ^= 0xFF
    (folder / HEADS_FILE).write_bytes(bytes(data))
    with pytest.raises(HeadsError, match="exit_heads.safetensors: the file is damaged or was changed"):
        ElasticEncoder(str(folder), device="cpu")
    ElasticEncoder(str(folder), device="cpu", heads=False)  # off: the rest of the model still loads
    (folder / HEADS_FILE).unlink()
    with pytest.raises(HeadsError, match="names exit_heads.safetensors, which is missing"):
        ElasticEncoder(str(folder), device="cpu")


def test_heads_of_another_backbone_are_refused(encoder, sentences, tmp_path, tokenizer):
    folder = _saved_with_heads(encoder, sentences, tmp_path / "m")
    torch.manual_seed(5)
    other = ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size).apply(
            lambda m: m.reset_parameters() if isinstance(m, torch.nn.Linear) else None
        ),
        tokenizer,
        pooling="mean",
        device="cpu",
    )
    other.save(tmp_path / "other")
    for name in (HEADS_FILE, "matryoshka2d.json"):  # graft the heads onto the other backbone
        shutil.copy(folder / name, tmp_path / "other" / name)
    with pytest.raises(HeadsError, match="fitted on another backbone"):
        ElasticEncoder(str(tmp_path / "other"), device="cpu")


def test_heads_of_another_shape_are_refused(encoder):
    with pytest.raises(ValueError, match=r"do not fit tiny-bert"):
        encoder.set_exit_heads(ExitHeads([1], 16, 32))
    with pytest.raises(ValueError, match=r"exit heads at layers \[4\]: tiny-bert has exits 1..3"):
        encoder.set_exit_heads(ExitHeads([4], 32, 32))


def test_an_exported_cell_keeps_its_head(encoder, sentences, tmp_path):
    from sentence_transformers import SentenceTransformer

    from matryoshka2d.export.cell import export_cell

    _saved_with_heads(encoder, sentences, tmp_path / "m")
    model = ElasticEncoder(str(tmp_path / "m"), device="cpu")
    report = export_cell(model, 3, 16, tmp_path / "cell", fmt="onnx", normalize=True)
    expected = model.encode(sentences[:10], layer=3, dim=16, normalize=True)
    got = SentenceTransformer(str(tmp_path / "cell"), device="cpu").encode(sentences[:10])
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert report.checks and max(report.checks.values()) < 1e-4  # the ONNX graph too
    dense = json.loads((tmp_path / "cell" / "2_Dense" / "config.json").read_text())
    assert (dense["in_features"], dense["out_features"]) == (32, 16)  # only the rows the cell needs
    assert not (tmp_path / "cell" / HEADS_FILE).exists()


def test_heads_fit_command_writes_a_new_folder_and_leaves_the_input_alone(tiny_dir, text_file, tmp_path, capsys):
    before = sorted(p.name for p in tiny_dir.iterdir())
    out = tmp_path / "with-heads"
    args = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(text_file)]
    assert main([*args, "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "fitted affine exit heads at layers 1,2,3 (32 -> 32) on 200 sentences (20 held out" in printed
    assert "| cell | no heads | heads | gain |" in printed or "no STS-B dev gain table" in printed
    assert sorted(p.name for p in tiny_dir.iterdir()) == before
    assert ElasticEncoder(str(out), device="cpu").exit_heads.layers == [1, 2, 3]
    assert main([*args, "--output", str(out)]) == 2  # not over a model without --overwrite
    assert "already exists and is not empty" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main([*args[:-1], str(empty), "--output", str(tmp_path / "x")]) == 2
    assert "empty.txt: no sentences" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_no_heads_flag_on_a_folder_without_heads_is_fine_and_says_so(tiny_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a cat\na dog\n")
    args = ["encode", "--model", str(tiny_dir), "--pooling", "mean", "--input", str(src), "--layer", "2"]
    assert main([*args, "--output", str(tmp_path / "v"), "--no-heads"]) == 0
    assert "--no-heads: it has no exit heads" in capsys.readouterr().err


def test_training_with_exit_heads_trains_them_and_saves_them(tiny_dir, text_file, tmp_path):
    from matryoshka2d.training.config import TrainConfig
    from matryoshka2d.training.trainer import Trainer

    lines = text_file.read_text().split("\n")
    rows = ["anchor\tpositive\tnegative"] + [
        f"{a}\t{a} too\t{b}" for a, b in zip(lines[:96:2], lines[1:96:2], strict=True)
    ]
    data = tmp_path / "t.tsv"
    data.write_text("\n".join(rows) + "\n")
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence1\tsentence2\tscore\nred cat\tred cat\t5\nred cat\tblue dog\t1\nold dog\thappy cat\t0\n")

    def config(out, **kw):
        return TrainConfig(
            model=str(tiny_dir),
            pooling="mean",
            data=[str(data)],
            output=str(out),
            batch_size=8,
            steps=2,
            eval_file=str(dev),
            lr=1e-3,
            warmup_ratio=0.0,
            save_steps=0,
            method="2dmse",
            **kw,
        )

    trainer = Trainer(config(tmp_path / "run", exit_heads="identity", exit_heads_lr=1e-2))
    start = {k: v.clone() for k, v in trainer.encoder.exit_heads.state_dict().items()}
    trainer.run(progress=False)
    moved = [k for k, v in trainer.encoder.exit_heads.state_dict().items() if not torch.equal(v, start[k])]
    assert moved  # the heads got gradient through the shallow views
    saved = ElasticEncoder(str(tmp_path / "run"), device="cpu")
    assert saved.exit_heads.layers == [1, 2, 3]
    assert saved.exit_heads.record["init"] == "identity"
    with pytest.raises(ValueError, match="method 'plain' trains no view below the last layer"):
        Trainer(TrainConfig(**{**config(tmp_path / "p", exit_heads="fit").__dict__, "method": "plain"}))


def _both_sides_match_encode(encoder, layers, dims, texts):
    """A grid with and without heads from one pass; each side equals encode() at every cell. Returns both."""
    from matryoshka2d.evaluate.grid import EncoderCells

    cells = EncoderCells(encoder, layers, dims, compare_heads=True)
    with_heads = cells.embed(texts)
    without = cells.without_heads().embed(texts)
    for layer, dim in cells.cells():
        np.testing.assert_allclose(with_heads[(layer, dim)], encoder.encode(texts, layer=layer, dim=dim), atol=1e-5)
        np.testing.assert_allclose(
            without[(layer, dim)], encoder.encode(texts, layer=layer, dim=dim, heads=False), atol=1e-5
        )
    return with_heads, without


def test_one_pass_gives_the_cells_with_and_without_heads(encoder, sentences):
    heads, _ = fit_heads(encoder, [sentences])
    encoder.set_exit_heads(heads)
    with_heads, without = _both_sides_match_encode(encoder, [1, 4], [8, 32], sentences[:12])
    assert not np.allclose(with_heads[(1, 32)], without[(1, 32)])
    np.testing.assert_array_equal(with_heads[(4, 32)], without[(4, 32)])  # the last layer has no head


def test_a_frozen_backbone_trains_only_the_query_head_on_query_document_pairs(tiny_dir, text_file, tmp_path, capsys):
    """train --freeze-encoder --exit-heads keep, asymmetric at query layer 2, on anchor/positive pairs: the
    layer-2 head learns, the other heads and the backbone stay as they were, so the heads still load."""
    fitted = tmp_path / "fitted"
    fit = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(text_file)]
    assert main([*fit, "--output", str(fitted), "--quiet"]) == 0
    lines = text_file.read_text().split("\n")
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(
        "anchor\tpositive\n" + "".join(f"{q}\t{q} {d}\n" for q, d in zip(lines[:40], lines[40:80], strict=True))
    )
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence1\tsentence2\tscore\nred cat\tred cat\t5\nred cat\tblue dog\t1\nold dog\thappy cat\t0\n")
    args = ["train", "--model", str(fitted), "--pooling", "mean", "--data", str(pairs), "--eval-file", str(dev)]
    args += ["--method", "asymmetric", "--method-option", "query_layers=[2]", "--method-option", "full_weight=0"]
    args += ["--batch-size", "8", "--steps", "3", "--lr", "1e-2", "--save-steps", "0"]
    assert main([*args, "--exit-heads", "keep", "--freeze-encoder", "--output", str(tmp_path / "q")]) == 0
    assert "loss: infonce (default for pairs data" in capsys.readouterr().out
    before = ElasticEncoder(str(fitted), device="cpu")
    after = ElasticEncoder(str(tmp_path / "q"), device="cpu")  # loads: the backbone checksum still matches
    for name, tensor in before.model.state_dict().items():
        assert torch.equal(tensor, after.model.state_dict()[name]), name
    old, new = before.exit_heads.state_dict(), after.exit_heads.state_dict()
    assert not torch.equal(old["heads.2.linear.weight"], new["heads.2.linear.weight"])
    assert all(torch.equal(old[k], new[k]) for k in old if not k.startswith("heads.2."))
    # without heads to train (or a pooler) nothing could learn; angle cannot train pairs: both said upfront
    assert main([*args, "--freeze-encoder", "--output", str(tmp_path / "r")]) == 2
    assert "freeze_encoder trains only the pooler head or the exit heads" in capsys.readouterr().err
    assert main([*args, "--exit-heads", "keep", "--loss", "angle", "--output", str(tmp_path / "s")]) == 2
    assert "holds anchor/positive pairs (no negatives); they train only with" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()


def test_a_document_cache_serves_every_model_of_one_backbone(tiny_dir, text_file, tmp_path, monkeypatch):
    """eval retrieval --doc-cache: the corpus is encoded once for the backbone; a model with heads reuses the
    pooled states and scores exactly as without the cache."""
    from helpers.data import beir

    corpus = [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(text_file.read_text().split("\n")[:40])]
    queries = [{"_id": f"q{i}", "text": d["text"].split()[0]} for i, d in enumerate(corpus[:12])]
    root = beir(tmp_path / "toy", corpus, queries, [(f"q{i}", f"d{i}", 1) for i in range(12)], split="train")
    fitted = tmp_path / "fitted"
    fit = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(text_file)]
    assert main([*fit, "--output", str(fitted), "--quiet"]) == 0
    calls = []
    real = ElasticEncoder.pooled_states
    monkeypatch.setattr(
        ElasticEncoder,
        "pooled_states",
        lambda self, texts, *a, **k: calls.append(len(texts)) or real(self, texts, *a, **k),
    )

    def rows(model, out, *extra):
        args = ["eval", "retrieval", "--model", str(model), "--pooling", "mean", "--dataset-dir", str(root), "--quiet"]
        assert (
            main([*args, "--cascade", "1:8,4:32", "--query-layer", "2", "--output", str(tmp_path / out), *extra]) == 0
        )
        return [(r["mode"], r["ndcg@10"]) for r in json.loads((tmp_path / out / "cascade.json").read_text())["rows"]]

    plain = rows(fitted, "plain")
    cache = tmp_path / "cache"
    rows(tiny_dir, "raw", "--doc-cache", str(cache))
    calls.clear()
    assert rows(fitted, "cached", "--doc-cache", str(cache)) == plain
    assert len(list(cache.iterdir())) == 1 and len(corpus) not in calls  # only the queries were encoded


# ---- heads that read the pooled layers 0..exit side by side (inputs="stack") ---------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_a_stacked_head_reads_every_layer_up_to_its_exit_and_fits_at_least_as_well(encoder, sentences):
    stacked, _ = fit_heads(encoder, [sentences], inputs="stack", ridge=1e-6)
    single, _ = fit_heads(encoder, [sentences], ridge=1e-6)
    assert [stacked.reads(n) for n in (1, 3)] == [[0, 1], [0, 1, 2, 3]]
    assert [stacked.heads[str(n)].linear.in_features for n in (1, 2, 3)] == [64, 96, 128]  # (n + 1) x 32
    assert stacked.record["inputs"] == "pooled layers 0..exit, side by side"
    raw = encoder.pooled_states(sentences, [0, 1, 2, 3, 4], pooled=True)  # layer 0: the embedding output
    tensors = {n: torch.from_numpy(v) for n, v in raw.items()}
    target = _unit(raw[4])
    with torch.no_grad():
        for n in (1, 2, 3):
            # the exit-only fit is the stacked fit with zero weight on the other layers: the stacked one is closer
            err_stacked = np.mean((stacked(n, tensors).numpy() - target) ** 2)
            err_single = np.mean((single(n, tensors[n]).numpy() - target) ** 2)
            assert err_stacked <= err_single + 1e-9
        with pytest.raises(HeadsError, match=r"reads the pooled vectors of layers \[0, 1, 2\]; it was given"):
            stacked(2, tensors[2])
        encoder.set_exit_heads(stacked)
        manual = stacked(2, tensors).numpy()
    np.testing.assert_allclose(encoder.pooled_states(sentences, [2])[2], manual, atol=1e-5)
    assert encoder.pooled_inputs([2, 4]) == [0, 1, 2, 4] and encoder.pooled_inputs([2], heads=False) == [2]
    np.testing.assert_array_equal(encoder.encode(sentences, layer=4), encoder.encode(sentences, layer=4, heads=False))


def test_stacked_heads_load_with_their_folder_and_make_every_cell_the_same_way(encoder, sentences, tmp_path):
    heads, _ = fit_heads(encoder, [sentences], inputs="stack")
    encoder.set_exit_heads(heads)
    encoder.save(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "matryoshka2d.json").read_text())["exit_heads"]["inputs"] == "stack"
    loaded = ElasticEncoder(str(tmp_path / "m"), device="cpu")
    assert loaded.exit_heads.inputs == "stack" and "each reading layers 0..its exit" in loaded.exit_heads.describe()
    texts = sentences[:12]
    np.testing.assert_allclose(loaded.encode(texts, layer=3, dim=16), encoder.encode(texts, layer=3, dim=16), atol=1e-5)
    _both_sides_match_encode(loaded, [1, 3, 4], [8, 32], texts)  # both sides from one pass
    # a plain sentence-transformers folder pools one layer: the cell is refused, with what to do instead
    with pytest.raises(HeadsError, match=r"reads the pooled vectors of layers \[0, 1, 2, 3\]; .* --inputs exit"):
        loaded.save(tmp_path / "cell", keep_layers=3, dim=16)
    assert not (tmp_path / "cell" / "model.safetensors").exists()


def test_stacked_heads_start_as_the_exit_itself_and_train_along(encoder, sentences, tmp_path, tiny_dir, text_file):
    from matryoshka2d.training.config import TrainConfig
    from matryoshka2d.training.trainer import Trainer

    identity = ExitHeads.identity([1, 2, 3], 32, 32, inputs="stack")
    encoder.set_exit_heads(identity)
    np.testing.assert_allclose(
        encoder.encode(sentences[:8], layer=2), encoder.encode(sentences[:8], layer=2, heads=False), atol=1e-6
    )
    lines = text_file.read_text().split("\n")
    data = tmp_path / "t.tsv"
    data.write_text(
        "anchor\tpositive\tnegative\n"
        + "\n".join(f"{a}\t{a} too\t{b}" for a, b in zip(lines[:200:2], lines[1:200:2], strict=True))
        + "\n"
    )
    base = dict(model=str(tiny_dir), pooling="mean", data=[str(data)], batch_size=8, steps=2, lr=1e-3)
    base |= dict(warmup_ratio=0.0, save_steps=0, method="starbucks", exit_heads_lr=1e-2)
    trainer = Trainer(TrainConfig(**base, output=str(tmp_path / "run"), exit_heads="fit", exit_heads_inputs="stack"))
    assert trainer.encoder.exit_heads.inputs == "stack"
    trainer.run(progress=False)
    saved = ElasticEncoder(str(tmp_path / "run"), device="cpu")
    assert saved.exit_heads.inputs == "stack" and saved.exit_heads.record["init"] == "closed-form ridge"
    with pytest.raises(ValueError, match="the heads of .* read 'stack'; keep trains them as they are"):
        Trainer(
            TrainConfig(
                **{**base, "model": str(tmp_path / "run")},
                output=str(tmp_path / "again"),
                exit_heads="keep",
                exit_heads_inputs="exit",
            )
        )


def test_an_exit_graph_with_a_stacked_head_runs_in_onnxruntime(encoder, sentences, tmp_path):
    """serve --backend onnx builds one graph per exit from encoder.forward: the stacked head's extra layers (the
    embedding output among them) must be in the graph, at any batch and length."""
    ort = pytest.importorskip("onnxruntime")
    from matryoshka2d.export.onnx_graphs import export_exit

    heads, _ = fit_heads(encoder, [sentences], inputs="stack")
    encoder.set_exit_heads(heads)
    encoder.eval()
    path = export_exit(encoder, 2, tmp_path / "exit.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for texts in (sentences[:1], sentences[:9], [" ".join(sentences[:12]), sentences[3]]):
        features = encoder.tokenize(texts)
        with torch.no_grad():
            expected = encoder.forward(features, [2])[2].numpy()
        got = session.run(None, {i.name: features[i.name].numpy() for i in session.get_inputs()})[0]
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_an_mlp_fit_is_the_same_for_the_same_seed(encoder, sentences):
    first, _ = fit_heads(encoder, [sentences], kind="mlp", mlp_epochs=1, ridge=0.1)
    torch.manual_seed(123)  # whatever the global generator holds
    again, _ = fit_heads(encoder, [sentences], kind="mlp", mlp_epochs=1, ridge=0.1)
    for name, tensor in first.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)


def test_a_stacked_cell_exports_as_an_onnx_graph_only(encoder, sentences, tmp_path):
    pytest.importorskip("onnxruntime")
    from matryoshka2d.export.cell import export_cell
    from matryoshka2d.export.onnx_graphs import ExportError, OnnxCellEncoder

    heads, _ = fit_heads(encoder, [sentences], inputs="stack")
    encoder.set_exit_heads(heads)
    with pytest.raises(ExportError, match=r"reads the pooled vectors of layers \[0, 1, 2\]; .* add --format onnx"):
        export_cell(encoder, 2, 16, tmp_path / "st")
    assert not (tmp_path / "st").exists()
    report = export_cell(encoder, 2, 16, tmp_path / "cell", fmt="onnx", quantize="int8", normalize=True)
    assert (tmp_path / "cell" / "onnx" / "cell.onnx").is_file() and (
        tmp_path / "cell" / "onnx" / "cell_int8.onnx"
    ).is_file()
    assert not (tmp_path / "cell" / "model.safetensors").exists()  # no sentence-transformers folder: ONNX only
    assert any("ONNX only" in note for note in report.notes) and report.checks["onnxruntime fp32 vs encode()"] < 1e-4
    texts = [*sentences[:9], " ".join(sentences[:40])]  # one longer than the model's max_length: cut the same way
    expected = encoder.encode(texts, layer=2, dim=16, normalize=True)
    np.testing.assert_allclose(OnnxCellEncoder(tmp_path / "cell").encode(texts), expected, atol=1e-4)
    assert report.layer == 2 and report.parameters_kept < report.parameters_full
