"""SMAE pre-training: masking ratios, the decoder sees only the projected first-d numbers, a tiny run lowers its
loss and resumes exactly, the saved encoder fine-tunes with `train`, and unsupported set-ups are refused."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from helpers.data import WORDS
from helpers.models import tiny_run, tiny_transformer
from matryoshka2d.cli import main
from matryoshka2d.compress.masking import IGNORE, mask_batch
from matryoshka2d.compress.smae import (
    DECODER_MASK_RATIO,
    ENCODER_MASK_RATIO,
    SMAEError,
    SMAEObjective,
    pretrain_trainer,
)
from matryoshka2d.methods.starbucks import default_sizes
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def encoder(tiny_dir):
    return ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")


def test_masking_ratios_whole_words_and_nesting(tokenizer):
    rng = np.random.default_rng(0)
    single = [w for w in WORDS if w != "swims"]  # one token per word ("swims" is swim ##s): budgets are exact
    texts = [" ".join(rng.choice(single, 20)) for _ in range(40)]
    batch = mask_batch(tokenizer, texts, 64, ENCODER_MASK_RATIO, DECODER_MASK_RATIO, rng)
    assert (ENCODER_MASK_RATIO, DECODER_MASK_RATIO) == (0.2, 0.4)
    enc, dec = batch.encoder_labels != IGNORE, batch.decoder_labels != IGNORE
    assert enc.sum(1).tolist() == [4] * 40 and dec.sum(1).tolist() == [8] * 40  # round(20 x 0.2), round(20 x 0.4)
    assert bool((enc <= dec).all())  # the encoder's masked words are among the decoder's
    assert not (enc | dec)[:, 0].any() and not (enc | dec)[:, 21].any()  # [CLS] and [SEP] never masked
    replaced = batch.decoder_ids[dec]
    share_mask = (replaced == tokenizer.mask_token_id).float().mean().item()
    assert 0.7 < share_mask < 0.9  # BERT's 80 % [MASK] / 10 % random / 10 % unchanged
    # Unmasked positions keep their tokens; labels hold the originals.
    original = tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]
    assert torch.equal(batch.encoder_ids[~enc], original[~enc])
    assert torch.equal(batch.decoder_labels[dec], original[dec])
    # A word split into several tokens (un ##bel ##ie ##va ##bly) is masked whole or not at all.
    split = mask_batch(tokenizer, ["unbelievably red"] * 16, 16, 0.2, 0.9, np.random.default_rng(1))
    word = (split.decoder_labels != IGNORE)[:, 1:6]
    assert all(bool(row.all()) or not row.any() for row in word) and word.any()


def test_the_decoder_sees_only_the_first_d_numbers(encoder, tokenizer):
    objective = SMAEObjective(encoder)
    assert objective.sizes == default_sizes(4, 32) and "fresh" in objective.head_source
    encoder.eval()  # no dropout: identical inputs give identical losses
    batch = objective.mask(encoder, ["a red cat runs fast", "old dogs sleep"], np.random.default_rng(0))
    vector = torch.randn(2, 32)
    changed_beyond = vector.clone()
    changed_beyond[:, 16:] = torch.randn(2, 16) * 10
    changed_within = vector.clone()
    changed_within[:, 3] += 5.0
    with torch.no_grad():
        base = objective.decoder_loss(encoder, vector, 16, batch)
        assert objective.decoder_loss(encoder, changed_beyond, 16, batch) == base
        assert objective.decoder_loss(encoder, changed_within, 16, batch) != base
        assert objective.decoder_loss(encoder, changed_beyond, 32, batch) != base
    # The decoder ran on its own layer, and the encoder's layer stack is back in place afterwards.
    assert len(encoder.model.encoder.layer) == 4 and objective.decoder[0] is not encoder.model.encoder.layer[0]
    # Its loss parts stay device tensors, read back on the trainer's logging steps only (no host sync a step).
    _, parts = objective.loss(encoder, batch)
    assert set(parts) == {f"{term}({n},{d})" for n, d in objective.sizes for term in ("mlm", "mae")}
    assert all(isinstance(v, torch.Tensor) for v in parts.values())


def test_mean_reduction_is_the_sum_over_twice_the_sizes(encoder):
    """ielab's smae/modeling.py averages (mlm + mae) / 2 over the sizes; the paper's eq. 9 sums."""
    encoder.eval()
    texts = ["a red cat runs fast", "old dogs sleep", "big fish swims"]
    totals = {}
    for reduction in ("sum", "mean"):
        objective = SMAEObjective(encoder, sizes=[(1, 16), (2, 32), (4, 32)], reduction=reduction, seed=3)
        batch = objective.mask(encoder, texts, np.random.default_rng(0))
        with torch.no_grad():
            totals[reduction], parts = objective.loss(encoder, batch)
        assert sum(parts.values()) == pytest.approx(float(totals["sum"]), rel=1e-5)
        assert objective.config()["reduction"] == reduction
    assert float(totals["mean"]) == pytest.approx(float(totals["sum"]) / (2 * 3), rel=1e-6)
    with pytest.raises(SMAEError, match="reduction must be 'sum' .* or 'mean' .*, got 'max'"):
        SMAEObjective(encoder, reduction="max")


def config(tiny_dir, files, out, **kw):
    """SMAE at sizes (1, 16) and (2, 32) on the tiny corpus."""
    options = {"method": "smae", "loss": "mlm+mae", "lr": 2e-3, "method_options": {"sizes": [[1, 16], [2, 32]]}, **kw}
    return tiny_run(tiny_dir, files / "corpus.txt", files / "dev.tsv", out, **options)


def test_a_tiny_smae_run_lowers_its_loss(tiny_dir, files, tmp_path):
    trainer = pretrain_trainer(config(tiny_dir, files, tmp_path, steps=24))
    records = [trainer.train_step() for _ in range(24)]
    losses = [r["loss"] for r in records]
    assert {"mlm(1,16)", "mae(1,16)", "mlm(2,32)", "mae(2,32)"} <= set(records[0])
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.5, losses


class Killed(Exception):
    pass


def test_pretrain_resumes_exactly_and_saves_a_fine_tunable_encoder(tiny_dir, files, tmp_path, monkeypatch):
    kw = dict(steps=5, save_steps=2)
    straight = pretrain_trainer(config(tiny_dir, files, tmp_path / "a", **kw))
    straight.run(progress=False)
    expected = {k: v.clone() for k, v in straight.encoder.state_dict().items()}
    expected_decoder = {k: v.clone() for k, v in straight.method.state_dict().items()}

    original = Trainer.train_step

    def dying(self):
        if self.step == 3:
            raise Killed
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", dying)
    with pytest.raises(Killed):
        pretrain_trainer(config(tiny_dir, files, tmp_path / "b", **kw)).run(progress=False)
    monkeypatch.setattr(Trainer, "train_step", original)
    resumed = pretrain_trainer(config(tiny_dir, files, tmp_path / "b", **kw))
    resumed.run(resume=True, progress=False)
    for key, value in resumed.encoder.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6, msg=key)
    for key, value in resumed.method.state_dict().items():
        torch.testing.assert_close(value, expected_decoder[key], rtol=0, atol=1e-6, msg=key)

    out = tmp_path / "b"
    meta = json.loads((out / "matryoshka2d.json").read_text())
    assert meta["method"]["method"] == "smae" and meta["steps"] == 5 and meta["data_kind"] == "sentences"
    with (
        safe_open(str(out / "model.safetensors"), "pt") as saved,
        safe_open(str(tiny_dir / "model.safetensors"), "pt") as before,
    ):
        assert set(saved.keys()) == set(before.keys())  # the encoder only: no decoder, no MLM head
    # The result is an ordinary model for `train`.
    triplets = tmp_path / "t.tsv"
    triplets.write_text("anchor\tpositive\tnegative\nred cat\tred cat runs\tblue dog\nold dog\told dogs\tbig bird\n")
    args = ["train", "--model", str(out), "--data", str(triplets), "--steps", "1", "--method", "starbucks"]
    args += ["--sizes", "1:16,2:32", "--output", str(tmp_path / "ft"), "--eval-file", str(files / "dev.tsv")]
    assert main(args) == 0


def test_pretrain_cli(tiny_dir, files, tmp_path, capsys):
    out = tmp_path / "smae"
    args = ["pretrain", "--method", "smae", "--model", str(tiny_dir), "--pooling", "mean"]
    args += ["--data", str(files / "corpus.txt"), "--steps", "2", "--batch-size", "8", "--sizes", "1:16,2:32"]
    args += ["--output", str(out), "--eval-file", str(files / "dev.tsv"), "--quiet"]
    assert main(args) == 0
    meta = json.loads((out / "matryoshka2d.json").read_text())
    training = meta["training"]
    assert (training["lr"], training["weight_decay"], training["lr_schedule"], training["warmup_ratio"]) == (
        1e-4,
        0.05,
        "cosine",
        0.05,
    )
    assert meta["method"]["encoder_mask_ratio"] == 0.2 and meta["method"]["decoder_mask_ratio"] == 0.4
    assert meta["method"]["reduction"] == "sum"  # the paper's eq. 9 unless --reduction says otherwise
    assert "pre-trained encoder saved" in capsys.readouterr().out
    mean = tmp_path / "smae-mean"
    assert main([*args[:-5], "--output", str(mean), "--eval-file", str(files / "dev.tsv"), "--reduction", "mean"]) == 0
    assert json.loads((mean / "matryoshka2d.json").read_text())["method"]["reduction"] == "mean"
    with pytest.raises(SystemExit) as stopped:  # refused where it is parsed (rule 4)
        main([*args, "--encoder-mask-ratio", "1.5", "--output", str(tmp_path / "other")])
    assert stopped.value.code == 2
    assert "argument --encoder-mask-ratio: must be from 0 to 1, got 1.5" in capsys.readouterr().err


def test_smae_errors(encoder, tokenizer, tiny_dir, files, tmp_path):
    with pytest.raises(SMAEError, match=r"size \(5,32\) is outside the model's 4 layers x 32 dims"):
        SMAEObjective(encoder, sizes=[(5, 32)])
    with pytest.raises(SMAEError, match="bottleneck must be 'pooled' or 'cls'"):
        SMAEObjective(encoder, bottleneck="max")
    llama = ElasticEncoder.from_modules(tiny_transformer("llama", tokenizer.vocab_size), tokenizer, pooling="mean")
    with pytest.raises(SMAEError, match="bidirectional masked-LM encoder .* is 'llama'"):
        SMAEObjective(llama)
    encoder.add_pooler(8)
    with pytest.raises(SMAEError, match="has a pooler head"):
        SMAEObjective(encoder)
    with pytest.raises(SMAEError, match="smae: gradient_accumulation is not supported"):
        pretrain_trainer(config(tiny_dir, files, tmp_path, gradient_accumulation=2))
    with pytest.raises(SMAEError, match="unknown method 'mlm'"):
        pretrain_trainer(config(tiny_dir, files, tmp_path, method="mlm"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.txt: no sentences"):
        pretrain_trainer(config(tiny_dir, files, tmp_path, data=[str(empty)]))
