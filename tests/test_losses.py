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


def test_angle_loss_terms_and_weights():
    torch.manual_seed(0)
    batch = EmbeddedBatch([torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)], "triplets")
    cos_only = AnglELoss(cosine_weight=1, ibn_weight=0, angle_weight=0)(batch)
    assert cos_only.item() == pytest.approx(CoSENTLoss()(batch).item(), rel=1e-6)
    ibn_only = AnglELoss(cosine_weight=0, ibn_weight=1, angle_weight=0)(batch)
    assert ibn_only.item() == pytest.approx(InfoNCELoss()(batch).item(), rel=1e-6)
    full = AnglELoss()(batch)
    angle_only = AnglELoss(cosine_weight=0, ibn_weight=0, angle_weight=1)(batch)
    assert full.item() == pytest.approx((cos_only + ibn_only + angle_only).item(), rel=1e-5)


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
