"""Task losses and alignment terms against small hand-computed cases."""

import math

import pytest
import torch
import torch.nn.functional as F

from matryoshka2d.losses import AnglELoss, CoSENTLoss, EmbeddedBatch, InfoNCELoss, SoftmaxLoss, make_task_loss
from matryoshka2d.losses.align import mse_kl, similarity_kl
from matryoshka2d.losses.angle import angle_scores

E1, E2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])


def scored(u, v, scores):
    return EmbeddedBatch([u, v], "scored", torch.tensor(scores))


def test_cosent_hand_computed():
    # pair 0: cos 1 with score 1; pair 1: cos 0 with score 0 -> right order: log(1 + e^{20 (0 - 1)})
    u, v = torch.cat([E1, E1]), torch.cat([E1, E2])
    assert CoSENTLoss()(scored(u, v, [1.0, 0.0])).item() == pytest.approx(math.log1p(math.exp(-20)), abs=1e-6)
    # the wrong order costs log(1 + e^{20})
    assert CoSENTLoss()(scored(u, v, [0.0, 1.0])).item() == pytest.approx(math.log1p(math.exp(20)), rel=1e-6)
    # equal scores: nothing to rank
    assert CoSENTLoss()(scored(u, v, [1.0, 1.0])).item() == pytest.approx(0.0, abs=1e-7)


def test_triplets_become_positive_and_negative_pairs():
    a, p, n = E1, E1, E2
    batch = EmbeddedBatch([a, p, n], "triplets")
    _u, v, labels = batch.scored_pairs()
    assert labels.tolist() == [1.0, 0.0] and torch.equal(v, torch.cat([p, n]))
    assert CoSENTLoss()(batch).item() == pytest.approx(math.log1p(math.exp(-20)), abs=1e-6)


def test_nli_labels_rank_entailment_over_neutral_over_contradiction():
    batch = EmbeddedBatch([torch.randn(3, 4), torch.randn(3, 4)], "nli", torch.tensor([2, 0, 1]))
    assert batch.scored_pairs()[2].tolist() == [0.0, 2.0, 1.0]


def test_infonce_hand_computed():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    n = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    # anchor 0: logits vs [p0, p1, n0, n1] = 20 * [1, 0, 0, 1], target 0
    expected = -math.log(math.exp(20) / (2 * math.exp(20) + 2))
    loss = InfoNCELoss()(EmbeddedBatch([a, p, n], "triplets"))
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_infonce_on_pairs_takes_the_other_positives_as_negatives():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    # anchor 0: logits 20 * [1, 1] -> log 2; anchor 1: 20 * [0, 0] -> log 2
    loss = InfoNCELoss()(EmbeddedBatch([a, p], "pairs"))
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    with pytest.raises(ValueError, match="pairs have no scores or negatives to rank; train them with --loss infonce"):
        CoSENTLoss()(EmbeddedBatch([a, p], "pairs"))


def test_infonce_rejects_scored_pairs():
    with pytest.raises(ValueError, match="needs positive pairs"):
        InfoNCELoss()(scored(E1, E2, [1.0]))


def test_angle_score_is_one_for_equal_directions_and_scale_free():
    u = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert angle_scores(u, u).item() == pytest.approx(1.0, abs=1e-6)
    assert angle_scores(3 * u, u).item() == pytest.approx(1.0, abs=1e-6)
    # u = (1 + 0i), v = (0 + 1i): quotient -i, components sum to -1, |.| = 1 ... a 90 degree turn in one plane
    # and i vs 1 in the other plane of a 4-d vector gives a smaller score than equal vectors
    w = torch.tensor([[0.0, 2.0, 3.0, 1.0]])
    assert angle_scores(u, w).item() < 1.0


def test_angle_loss_on_triplets_is_angle_emb_format_c():
    """angle-emb 0.6.1 AngleLoss, format C: (ibn + cln) / 2 + 0.02 * angle ranking (tau 20), no CoSENT."""
    torch.manual_seed(0)
    a, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    batch = EmbeddedBatch([a, p, n], "triplets")
    target = torch.arange(4)
    ibn = F.cross_entropy(F.normalize(a, dim=-1) @ F.normalize(p, dim=-1).T * 20, target)
    cln = F.cross_entropy(F.normalize(a, dim=-1) @ F.normalize(torch.cat([p, n]), dim=-1).T * 20, target)
    scores = angle_scores(torch.cat([a, a]), torch.cat([p, n])) * 20
    angle = ranking(scores, [1.0] * 4 + [0.0] * 4)
    assert AnglELoss()(batch).item() == pytest.approx(((ibn + cln) / 2 + 0.02 * angle).item(), rel=1e-5)
    # CoSENT only when asked for, and then exactly CoSENT on the (a, p, 1), (a, n, 0) pairs
    cos_only = AnglELoss(cosine_weight=1, ibn_weight=0, cln_weight=0, angle_weight=0)(batch)
    assert cos_only.item() == pytest.approx(CoSENTLoss()(batch).item(), rel=1e-6)
    assert AnglELoss().describe("triplets").startswith("(in-batch 1 + with hard negatives 1) / 2, CoSENT 0, angle 0.02")
    assert AnglELoss().describe("triplets").endswith("scales 20/20/20 (angle-emb 0.6.1 terms for triplets)")
    era = AnglELoss(cosine_weight=1, ibn_weight=0, cln_weight=2, angle_weight=1, angle_scale=1.0)  # 2dmse-angle-0.3
    assert era.describe("triplets") == (
        "(in-batch 0 + with hard negatives 2) / 2, CoSENT 1, angle 1, scales 20/20/1 "
        "(weights given over angle-emb 0.6.1's defaults for triplets)"
    )


def ranking(scores, labels):
    """CoSENT's log(1 + sum over wrongly-ordered-able pairs of exp(s_i - s_j)), written out."""
    terms = [0.0]
    for i, li in enumerate(labels):
        for j, lj in enumerate(labels):
            if li < lj:
                terms.append(float(scores[i] - scores[j]))
    return torch.logsumexp(torch.tensor(terms), dim=0)


def test_angle_loss_on_nli_pairs_uses_symmetric_in_batch_negatives_of_entailed_pairs():
    torch.manual_seed(1)
    u, v = torch.randn(3, 6), torch.randn(3, 6)
    labels = torch.tensor([0, 2, 0])  # entailment, contradiction, entailment
    batch = EmbeddedBatch([u, v], "nli", labels)
    texts = F.normalize(torch.cat([u, v]), dim=-1)
    logits = texts @ texts.T * 20 - torch.eye(6) * 1e12
    partner = [3, 4, 5, 0, 1, 2]
    rows = [F.cross_entropy(logits[i : i + 1], torch.tensor([partner[i]])) for i in (0, 2, 3, 5)]
    ibn = torch.stack(rows).sum() / 6  # the mean over all 2B rows, rows without a positive counting 0
    angle = ranking(angle_scores(u, v) * 20, [2.0, 0.0, 2.0])
    assert AnglELoss()(batch).item() == pytest.approx((ibn + 0.02 * angle).item(), rel=1e-5)


def test_angle_loss_on_scored_pairs_keeps_cosent():
    torch.manual_seed(2)
    u, v = torch.randn(4, 6), torch.randn(4, 6)
    batch = scored(u, v, [4.5, 1.0, 3.2, 0.0])
    expected = CoSENTLoss()(batch) + 0.02 * ranking(angle_scores(u, v) * 20, [4.5, 1.0, 3.2, 0.0])
    assert AnglELoss()(batch).item() == pytest.approx(expected.item(), rel=1e-5)
    with pytest.raises(ValueError, match="not sentences data"):
        AnglELoss()(EmbeddedBatch([u, u], "sentences"))


def test_softmax_loss_hand_computed():
    loss = SoftmaxLoss(num_labels=3)
    u, v = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, -1.0]])
    batch = EmbeddedBatch([u, v], "nli", torch.tensor([1]))
    value = loss(batch)
    head = loss.heads["2"]
    features = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.5, 3.0]])
    assert value.item() == pytest.approx(F.cross_entropy(head(features), torch.tensor([1])).item(), rel=1e-6)
    with pytest.raises(ValueError, match="needs labelled NLI pairs"):
        loss(EmbeddedBatch([u, v, v], "triplets"))


def test_alignment_terms_vanish_when_equal_and_teacher_is_detached():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    b = EmbeddedBatch([x, torch.randn(4, 6)], "scored", torch.ones(4))
    assert similarity_kl(b, b, 0.3).item() == pytest.approx(0.0, abs=1e-6)
    assert mse_kl(x, x).item() == pytest.approx(0.0, abs=1e-6)
    student = torch.randn(4, 6, requires_grad=True)
    teacher = torch.randn(4, 6, requires_grad=True)
    value = similarity_kl(EmbeddedBatch([student, x], "scored"), EmbeddedBatch([teacher, x], "scored"), 0.3)
    value.backward()
    assert student.grad.abs().sum() > 0 and teacher.grad is None


def test_unknown_loss_name():
    with pytest.raises(ValueError, match="Unknown loss 'triplet'"):
        make_task_loss("triplet")


# ---- a batch of one row --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_data_file_per_kind(files, tmp_path_factory):
    """One training file of each kind of data a task loss may train on (matryoshka2d.training.data)."""
    from helpers.data import write_tsv

    folder = tmp_path_factory.mktemp("kinds")
    pairs = write_tsv(folder / "pairs.tsv", ["anchor", "positive"], [["red cat", "red cat runs"], ["old dog", "dog"]])
    kinds = {"triplets": "triplets.tsv", "nli": "nli.tsv", "scored": "dev.tsv", "sentences": "corpus.txt"}
    return {**{kind: files / name for kind, name in kinds.items()}, "pairs": pairs}


@pytest.mark.usefixtures("one_thread")
def test_every_task_loss_on_every_kind_at_a_batch_of_one_row_trains_or_is_refused_naming_both(
    tiny_dir, sts_dev, one_data_file_per_kind, tmp_path
):
    """A loss that compares each row with the batch's other rows (in-batch negatives, CoSENT's pairs of pairs) is 0
    on one row: --batch-size 1 trained for nothing and said nothing. Every loss of TASK_LOSSES on every kind of data
    it takes, at --batch-size 1: either refused before the run (naming --batch-size and the loss), or its first step
    moves the weights (no weight decay: only a gradient can)."""
    from helpers.models import tiny_run
    from matryoshka2d.losses import TASK_LOSSES
    from matryoshka2d.training.preflight import PreflightError
    from matryoshka2d.training.trainer import Trainer

    refused, trained = set(), set()
    for loss in TASK_LOSSES:
        for kind, data in one_data_file_per_kind.items():
            config = tiny_run(tiny_dir, data, sts_dev, tmp_path / f"{loss}-{kind}", steps=1, batch_size=1, loss=loss)
            config.weight_decay = 0.0
            try:
                trainer = Trainer(config)
            except PreflightError as exc:
                assert "--batch-size 1" in str(exc) and f"--loss {loss}" in str(exc), exc
                refused.add((loss, kind))
                continue
            except ValueError:
                continue  # a loss that does not train on this kind of data at all (said so by name elsewhere)
            before = {k: v.clone() for k, v in trainer.encoder.state_dict().items()}
            trainer.train_step()
            moved = any(not torch.equal(v, before[k]) for k, v in trainer.encoder.state_dict().items())
            assert moved, f"--loss {loss} on {kind} data at --batch-size 1 trained nothing and was not refused"
            trained.add((loss, kind))
    assert {("infonce", "pairs"), ("simcse", "sentences"), ("cosent", "scored")} <= refused
    assert {("infonce", "triplets"), ("softmax", "nli")} <= trained  # a hard negative, a classifier: one row trains
