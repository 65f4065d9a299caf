"""Training options from the references (issue 21): angle-emb's in-batch duplicate filter and the weight-decay
exemption of biases and norms (Hugging Face / sentence-transformers trainers)."""

import numpy as np
import pytest
import torch

from matryoshka2d.methods import make_method
from matryoshka2d.training.config import TrainConfig, check_config, check_resumable
from matryoshka2d.training.data import read_training_data, without_repeated_texts
from matryoshka2d.training.throughput import adamw, decay_groups
from matryoshka2d.training.trainer import Trainer

ROWS = [
    ("a cat", "a dog", "a bird"),  # kept
    ("the sun", "A CAT", "a fish"),  # "A CAT" is "a cat" for an uncased tokenizer: dropped
    ("the sun", "a tree", "a boat"),  # "the sun" stayed seen although its row was dropped: dropped too
    ("same", "same", "a car"),  # a row that repeats its own text: dropped
    ("long text one", "p", "q"),  # kept
    ("long text two", "r", "s"),  # equal to the row above once truncated to 4 tokens: dropped
    ("x", "y", "z"),  # kept
]


@pytest.fixture
def triplets(tmp_path):
    path = tmp_path / "triplets.tsv"
    path.write_text("anchor\tpositive\tnegative\n" + "".join("\t".join(row) + "\n" for row in ROWS))
    return path


def test_duplicate_filter_drops_rows_as_angle_emb_does(triplets, tokenizer):
    data = read_training_data([str(triplets)])
    kept = without_repeated_texts(data, np.arange(len(ROWS)), tokenizer, max_length=4)
    assert kept.tolist() == [0, 4, 6]
    # in another order the first of two rows that share a text is the one kept
    assert without_repeated_texts(data, np.array([2, 1, 0]), tokenizer, max_length=8).tolist() == [2, 0]


def test_duplicate_filter_in_the_trainer_and_its_errors(triplets, tiny_dir, tmp_path):
    base = dict(data=[str(triplets)], output=str(tmp_path / "o"), model=str(tiny_dir), pooling="mean")
    base.update(batch_size=len(ROWS), eval_file=str(triplets.parent / "dev.tsv"), save_steps=0, device="cpu")
    (triplets.parent / "dev.tsv").write_text("sentence1\tsentence2\tscore\nred cat\tred cat\t5\nred\tdog\t1\n")
    trainer = Trainer(TrainConfig(**base, filter_duplicates=True, max_length=4))
    order = np.random.default_rng([trainer.config.seed, 0]).permutation(len(ROWS))  # step 0's rows, in order
    rows = trainer.batch_indices(0)
    assert rows.tolist() == without_repeated_texts(trainer.data, order, trainer.encoder.tokenizer, 4).tolist()
    assert 0 < len(rows) < len(ROWS)
    (micro,) = trainer.prepare_batch(0)
    assert micro[2] == len(rows) and micro[0].rows == [len(rows)] * 3 and len(micro[0].column_ids(0)) == len(rows)
    assert np.isfinite(trainer.train_step()["loss"])
    trainer._prefetch.close()
    sentences = tmp_path / "s.txt"
    sentences.write_text("one sentence\nanother sentence\n")
    simcse = Trainer(TrainConfig(**{**base, "data": [str(sentences)]}, loss="simcse", filter_duplicates=True))
    with pytest.raises(ValueError, match="filter_duplicates: plain sentences are two copies of each sentence"):
        simcse.batch_indices(0)
    with pytest.raises(ValueError, match="filter_duplicates must be true or false, got 'yes'"):
        check_config(TrainConfig(**base, filter_duplicates="yes"))


def test_weight_decay_exemption_follows_the_hugging_face_trainer(tiny_bert):
    """Biases and LayerNorm weights get no decay; embeddings and matrices do; the method's theta does (its name
    has no bias or norm in it, and sentence-transformers applies the rule to the loss's parameters the same way)."""
    from transformers import Trainer as HFTrainer

    method = make_method("ese", 4, 32, k=16, dynamic_weights=True)
    decayed, exempt = decay_groups([tiny_bert, method], 0.01, "norm-and-bias")
    names = {id(p): name for name, p in tiny_bert.named_parameters()}
    names[id(method.theta)] = "theta"
    hf = set(HFTrainer.get_decay_parameter_names(None, tiny_bert))  # the Trainer's own rule, on our model
    assert {names[id(p)] for p in decayed["params"]} == {*hf, "theta"}
    assert all("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in exempt["params"])
    assert any("word_embeddings" in names[id(p)] for p in decayed["params"]) and exempt["params"]
    assert (decayed["weight_decay"], exempt["weight_decay"]) == (0.01, 0.0)
    (everything,) = decay_groups([tiny_bert, method], 0.01, "none")
    assert len(everything["params"]) == len(decayed["params"]) + len(exempt["params"])


def test_an_exempt_parameter_is_not_decayed_by_a_step():
    layer, norm = torch.nn.Linear(3, 3), torch.nn.LayerNorm(3)
    model = torch.nn.Sequential(layer, norm)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = adamw([model], 0.1, 0.5, "norm-and-bias", torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = model.state_dict()
    assert torch.allclose(after["0.weight"], before["0.weight"] * (1 - 0.1 * 0.5))  # decoupled decay only
    for key in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(after[key], before[key])


def test_weight_decay_exempt_is_checked_and_changes_the_run():
    config = TrainConfig(data=["x.tsv"], output="o", weight_decay_exempt="norms")
    with pytest.raises(ValueError, match="weight_decay_exempt must be one of none, norm-and-bias, got 'norms'"):
        check_config(config)
    saved = {"weight_decay_exempt": "none"}
    with pytest.raises(ValueError, match=r"weight_decay_exempt \(checkpoint 'none', now 'norm-and-bias'\)"):
        check_resumable("ckpt", saved, {"weight_decay_exempt": "norm-and-bias"})
    check_resumable("ckpt", {}, {"weight_decay_exempt": "none", "filter_duplicates": False})  # older checkpoints


def test_train_flags_set_the_duplicate_filter_and_the_weight_decay_exemption(triplets, tiny_dir, tmp_path, capsys):
    """--filter-duplicates, --weight-decay and --weight-decay-exempt reach the run's recorded config (--quiet: no
    progress bar); a bad exemption is refused by argparse with the choices."""
    import json

    from matryoshka2d.cli import main

    (triplets.parent / "dev.tsv").write_text("sentence1\tsentence2\tscore\nred cat\tred cat\t5\nred\tdog\t1\n")
    out = tmp_path / "o"
    common = ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--steps", "1"]
    common += ["--batch-size", "4", "--eval-file", str(triplets.parent / "dev.tsv"), "--device", "cpu"]
    flags = ["--filter-duplicates", "--weight-decay", "0", "--weight-decay-exempt", "norm-and-bias"]
    assert main([*common, *flags, "--output", str(out), "--quiet"]) == 0
    assert "1/1 [" not in capsys.readouterr().err  # no tqdm bar
    training = json.loads((out / "matryoshka2d.json").read_text())["training"]
    assert training["filter_duplicates"] is True and training["weight_decay"] == 0
    assert training["weight_decay_exempt"] == "norm-and-bias"
    with pytest.raises(SystemExit):
        main([*common, "--weight-decay-exempt", "norms", "--output", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
