"""Unsupervised SimCSE: plain sentences as a data kind, the loss against a hand computation, errors, and a
tiny run whose loss falls."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.models import tiny_run
from matryoshka2d.losses import EmbeddedBatch, SimCSELoss, make_task_loss
from matryoshka2d.training.data import DataError, read_sentences, read_training_data
from matryoshka2d.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_simcse_loss_by_hand():
    torch.manual_seed(0)
    a, b = torch.randn(5, 8), torch.randn(5, 8)
    value = SimCSELoss()(EmbeddedBatch([a, b], "sentences"))
    cos = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
    expected = -torch.log_softmax(cos / 0.05, dim=1).diagonal().mean()
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
    assert make_task_loss("simcse", temperature=0.1).temperature == 0.1
    with pytest.raises(ValueError, match="needs plain sentences encoded twice .* got triplets"):
        SimCSELoss()(EmbeddedBatch([a, b, b], "triplets"))
    with pytest.raises(ValueError, match="temperature must be positive"):
        SimCSELoss(temperature=0)


def test_sentences_kind(tmp_path, corpus):
    data = read_training_data([str(corpus)])
    assert data.kind == "sentences" and data.labels is None and len(data) == 64
    assert data.columns[0] == data.columns[1] and data.columns[0] is not data.columns[1]
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("premise\thypothesis\tlabel\na b\tc d\tneutral\na b\te f\tentailment\n")
    as_sentences = read_training_data([str(pairs), str(corpus)], sentences=True)
    assert as_sentences.kind == "sentences" and as_sentences.columns[0][:3] == ["a b", "c d", "e f"]
    assert len(as_sentences) == 67
    classification = tmp_path / "sst.tsv"
    classification.write_text("sentence\tlabel\ngood film\t1\nbad film\t0\n")
    assert read_sentences(classification) == ["good film", "bad film"]
    records = tmp_path / "r.jsonl"
    records.write_text('{"anchor": "x y", "positive": "z", "negative": "x y"}\n\n{"text": "w"}\n')
    assert read_sentences(records) == ["x y", "z", "w"]


def test_sentence_corpus_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match="empty.txt: no sentences"):
        read_training_data([str(empty)])
    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence\tlabel\nok\t1\nbroken\n")
    with pytest.raises(DataError, match=r"bad.tsv:3: 1 tab-separated columns, the header has 2"):
        read_sentences(bad)
    no_text = tmp_path / "ids.tsv"
    no_text.write_text("id\tlabel\n1\t2\n")
    with pytest.raises(DataError, match=r"ids.tsv:1: no text column"):
        read_sentences(no_text)


def config(tiny_dir, corpus, sts_dev, out, **kw):
    """16 steps of SimCSE on the tiny corpus, batches of 16 sentences."""
    options = {"loss": "simcse", "batch_size": 16, "steps": 16, **kw}
    return tiny_run(tiny_dir, corpus, sts_dev, out, **options)


def test_simcse_on_a_tiny_corpus_lowers_its_loss(tiny_dir, corpus, sts_dev, tmp_path):
    trainer = Trainer(config(tiny_dir, corpus, sts_dev, tmp_path))
    trainer.compute_loss(0)  # a step computes without error before any training
    # Both copies of a sentence went through the encoder with their own dropout masks.
    trainer.encoder.train()
    features = trainer.encoder.tokenize(["red cat runs", "red cat runs"])
    twice = trainer.encoder(features, [4])[4]
    assert not torch.allclose(twice[0], twice[1])
    losses = [trainer.train_step()["loss"] for _ in range(16)]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses


def test_plain_sentences_need_a_sentence_loss(tiny_dir, corpus, sts_dev, tmp_path):
    with pytest.raises(ValueError, match="holds plain sentences; .* not 'angle'"):
        Trainer(config(tiny_dir, corpus, sts_dev, tmp_path, loss="angle"))
