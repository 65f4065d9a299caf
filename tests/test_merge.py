"""`matryoshka2d merge`: weighted averages of runs of one start (WiSE-FT, model soups), exit heads included."""

import json

import numpy as np
import pytest
import torch

from helpers.models import TINY, tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads_fit import fit_heads
from matryoshka2d.training.merge import MergeError, merge_encoders, merge_weights

pytestmark = pytest.mark.usefixtures("one_thread")

# 432 distinct texts: more than a stacked head of the tiny model has inputs (4 x 32 + 1).
SENTENCES = [
    f"the {a} {b} {c} {d}"
    for a in ("red", "green", "blue", "big", "small", "old")
    for b in ("cat", "dog", "bird", "fish", "horse", "cow")
    for c in ("runs", "sleeps", "eats", "jumps")
    for d in ("today", "again", "slowly")
]


def _encoder(tokenizer, inputs: str = "exit", name: str = "tiny") -> ElasticEncoder:
    encoder = ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", name=name, device="cpu"
    )
    heads, _ = fit_heads(encoder, [SENTENCES], inputs=inputs, ridge=0.1)
    encoder.set_exit_heads(heads)
    return encoder


def _moved(encoder: ElasticEncoder, seed: int) -> ElasticEncoder:
    """A stand-in for a fine-tuned run: every weight of the start moved a little, heads included."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (encoder.model, encoder.exit_heads):
            for p in module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return encoder


@pytest.fixture
def start_and_run(tokenizer, tmp_path):
    start = tmp_path / "start"
    _encoder(tokenizer).save(start, metadata={"method": {"name": "plain"}})
    run = tmp_path / "run"
    meta = {"method": {"name": "starbucks"}, "final_eval": {"spearman": 1.0}, "final_evals": []}
    meta["training"] = {"model": str(start)}  # what a run records of its start
    _moved(_encoder(tokenizer), seed=1).save(run, metadata=meta)
    return start, run


def _weights(folder) -> dict[str, torch.Tensor]:
    encoder = ElasticEncoder(str(folder), device="cpu")
    named = {f"model.{k}": v for k, v in encoder.model.state_dict().items()}
    return named | {f"heads.{k}": v for k, v in encoder.exit_heads.state_dict().items()}


def test_wise_ft_writes_the_weighted_average_of_every_weight_heads_included(start_and_run, tmp_path, capsys):
    start, run = start_and_run
    out = tmp_path / "wise-ft"
    assert main(["merge", "--models", str(run), str(start), "--weights", "0.7", "0.3", "--output", str(out)]) == 0
    assert f"merged 0.7 x {run} + 0.3 x {start} -> {out}" in capsys.readouterr().out
    merged, trained, started = _weights(out), _weights(run), _weights(start)
    assert merged.keys() == trained.keys() and any(not torch.equal(trained[k], started[k]) for k in trained)
    for key, value in merged.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, 0.7 * trained[key] + 0.3 * started[key], atol=1e-6, rtol=0)
        else:
            assert torch.equal(value, trained[key])  # position ids: taken as they are
    # The heads load on the averaged backbone (their checksum is of the average), and the folder says what it is.
    loaded = ElasticEncoder(str(out), device="cpu")
    assert loaded.exit_heads is not None and loaded.exit_heads.layers == [1, 2, 3]
    record = json.loads((out / "matryoshka2d.json").read_text())
    assert record["merge"]["weights"] == [0.7, 0.3] and record["method"] == {"name": "starbucks"}
    assert "final_eval" not in record and "final_evals" not in record  # the run's scores are not the average's
    # The same average in memory encodes the same cells.
    in_memory = merge_encoders(
        [ElasticEncoder(str(run), device="cpu"), ElasticEncoder(str(start), device="cpu")], [0.7, 0.3]
    )
    np.testing.assert_allclose(
        loaded.encode(SENTENCES, layer=2, dim=16), in_memory.encode(SENTENCES, layer=2, dim=16), atol=1e-5
    )


def test_a_weight_of_one_gives_that_model_and_equal_weights_are_the_default(start_and_run, tmp_path):
    start, run = start_and_run
    assert (
        main(["merge", "--models", str(run), str(start), "--weights", "1", "0", "--output", str(tmp_path / "a")]) == 0
    )
    trained = _weights(run)
    for key, value in _weights(tmp_path / "a").items():
        assert torch.equal(value, trained[key])
    assert main(["merge", "--models", str(run), str(start), "--output", str(tmp_path / "soup")]) == 0
    record = json.loads((tmp_path / "soup" / "matryoshka2d.json").read_text())
    assert record["merge"]["weights"] == [0.5, 0.5]


def test_stacked_heads_average_too(tokenizer):
    a, b = _encoder(tokenizer, "stack"), _moved(_encoder(tokenizer, "stack"), seed=2)
    before = {k: v.clone() for k, v in b.exit_heads.state_dict().items()}
    start = {k: v.clone() for k, v in a.exit_heads.state_dict().items()}
    merged = merge_encoders([a, b], [0.5, 0.5])
    for key, value in merged.exit_heads.state_dict().items():
        torch.testing.assert_close(value, (start[key] + before[key]) / 2, atol=1e-6, rtol=0)
    assert torch.equal(b.exit_heads.state_dict()[next(iter(before))], next(iter(before.values())))  # b untouched


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([0.5], "1 weights for 2 models"),
        ([0.6, 0.6], "must sum to 1"),
        ([1.5, -0.5], "finite and >= 0"),
        ([float("nan"), 1.0], "finite and >= 0"),
    ],
)
def test_weights_that_do_not_make_an_average_are_refused(weights, message):
    with pytest.raises(MergeError, match=message):
        merge_weights(weights, 2)


def test_one_model_is_not_a_merge():
    with pytest.raises(MergeError, match="at least two models"):
        merge_weights(None, 1)


def test_models_that_differ_in_heads_or_shape_are_refused_naming_them(tokenizer):
    with_heads = _encoder(tokenizer, name="with-heads")
    stacked = _encoder(tokenizer, "stack", name="stacked")
    with pytest.raises(MergeError, match="stacked has exit heads .* but with-heads has .*same kind, layers and inputs"):
        merge_encoders([with_heads, stacked])
    bare = ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", name="bare", device="cpu"
    )
    with pytest.raises(MergeError, match="bare has transformer but with-heads has exit heads, transformer"):
        merge_encoders([with_heads, bare])
    import transformers as tf

    wider = tf.AutoModel.from_config(
        tf.BertConfig(vocab_size=tokenizer.vocab_size, **{**TINY, "intermediate_size": 48})
    )
    other = ElasticEncoder.from_modules(wider, tokenizer, pooling="mean", name="wider", device="cpu")
    with pytest.raises(MergeError, match=r"has shape \(48, 32\) in wider but \(64, 32\) in bare"):
        merge_encoders([bare, other])
    cls = ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="cls", name="cls", device="cpu"
    )
    with pytest.raises(MergeError, match="cls pools with cls but bare with mean"):
        merge_encoders([bare, cls])


def test_merge_command_refuses_bad_input_and_writes_nothing(start_and_run, tmp_path, capsys):
    start, run = start_and_run
    out = tmp_path / "out"
    base = ["merge", "--models", str(run), str(start)]
    assert main([*base, "--weights", "0.7", "--output", str(out)]) == 2
    assert "1 weights for 2 models" in capsys.readouterr().err and not out.exists()
    for overwrite in ([], ["--overwrite"]):  # into a model's own folder (rule 1)
        assert main([*base, "--output", str(run), *overwrite]) == 2
        assert f"--output {run} is --models {run}" in capsys.readouterr().err
    assert main(["merge", "--models", str(run), str(tmp_path / "missing"), "--output", str(out)]) == 2
    assert "missing" in capsys.readouterr().err and not out.exists()


def test_merge_refuses_other_starts_and_non_finite_weights(start_and_run, tokenizer, tmp_path, capsys):
    """Issue 32, case 5: runs whose records name different starts, unrelated models of one shape and models with NaN
    weights are refused; --allow-different-starts averages the first two anyway."""
    start, run = start_and_run
    other = tmp_path / "other-start"
    _moved(_encoder(tokenizer), seed=7).save(other, metadata={"method": {"name": "plain"}})
    out = tmp_path / "out"
    assert main(["merge", "--models", str(run), str(other), "--output", str(out)]) == 2
    assert "not runs of one start" in capsys.readouterr().err and not out.exists()
    assert main(["merge", "--models", str(start), str(other), "--output", str(out)]) == 2  # two unrelated models
    assert "--allow-different-starts" in capsys.readouterr().err
    assert main(["merge", "--models", str(run), str(other), "--output", str(out), "--allow-different-starts"]) == 0
    broken = _encoder(tokenizer)
    with torch.no_grad():
        next(broken.model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(MergeError, match="holds NaN or inf"):
        merge_encoders([broken, _encoder(tokenizer)])


def test_one_folder_named_twice_is_refused_before_anything_loads(start_and_run, tmp_path, monkeypatch, capsys):
    """--models RUN RUN (or RUN and a link to it) averaged a model with itself and wrote a copy of it, saying
    nothing: refused before anything loads."""
    from matryoshka2d.cli import args as cli_args

    start, run = start_and_run
    (tmp_path / "alias").symlink_to(run)
    monkeypatch.setattr(cli_args, "load_encoder", lambda *a, **k: pytest.fail("a model was loaded"))
    for twice in ([run, run], [run, tmp_path / "alias"], [start, run, tmp_path / "alias"]):
        assert main(["merge", "--models", *map(str, twice), "--output", str(tmp_path / "out")]) == 2
        assert "--models names one folder twice" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
