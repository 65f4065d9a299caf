"""The reference implementations' choices as options (issue 21): the features KL on unit vectors
(sentence-transformers), sign-stable PCA targets and angle-emb's svd_lowrank (ESE), ESE without the (N, D)
term (the paper), the Starbucks size check and full-model teacher (ielab/Starbucks), sentence-transformers'
two views and layer 0, and the warning for CLS pooling at the embedding output."""

import math

import numpy as np
import pytest
import torch

from matryoshka2d.cli import main
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import make_method
from matryoshka2d.methods.ese import fixed_signs, pca_targets


def hand_kl(student: np.ndarray, teacher: np.ndarray, temperature: float, factor: float) -> float:
    """KL(teacher || student) of softmax(row / T), summed over components, averaged over rows, times factor."""

    def softmax(x):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    p, q = softmax(teacher / temperature), softmax(student / temperature)
    return float((p * (np.log(p) - np.log(q))).sum(axis=1).mean() * factor)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_2dmse_feature_kl_on_unit_vectors_equals_a_hand_computation():
    """sentence-transformers' KL (adaptive_layer.py L246-276) on what all-MiniLM-L6-v2 outputs: unit vectors."""
    torch.manual_seed(0)
    options = dict(kl="features", kl_widths="full", kl_factor="T", kl_temperature=0.3, kl_normalize=True)
    method = make_method("2dmse", 4, 32, **options)
    plan = method.plan(np.random.default_rng(0))
    n = plan.info["n"]
    student = [6 * torch.randn(5, 32, dtype=torch.float64) for _ in range(3)]  # raw pooled norms are about 6
    teacher = [6 * torch.randn(5, 32, dtype=torch.float64) for _ in range(3)]
    states = {n: EmbeddedBatch(student, "triplets"), 4: EmbeddedBatch(teacher, "triplets")}
    kl, _ = method.extra_loss(plan, states)
    s, t = torch.cat(student).numpy(), torch.cat(teacher).numpy()  # rows: every text of every column
    assert kl.item() == pytest.approx(hand_kl(unit(s), unit(t), 0.3, 0.3), rel=1e-9)
    raw = make_method("2dmse", 4, 32, **{**options, "kl_normalize": False}).extra_loss(plan, states)[0]
    assert raw.item() == pytest.approx(hand_kl(s, t, 0.3, 0.3), rel=1e-9)
    assert raw.item() > 10 * kl.item()  # the raw vectors' KL is far larger: issue 21, item 1


def test_starbucks_feature_kl_on_unit_vectors_normalises_the_full_vector_then_cuts_it():
    """ielab/Starbucks' KL sees sentence_embedding (after Normalize), then keeps the first d numbers."""
    torch.manual_seed(1)
    method = make_method(
        "starbucks", 2, 8, sizes=[(1, 4), (2, 8)], kl="features", kl_factor="T", kl_detach=False,
        kl_scale_logits=False, kl_normalize=True,
    )  # fmt: skip
    student, teacher = 5 * torch.randn(3, 8, dtype=torch.float64), 5 * torch.randn(3, 8, dtype=torch.float64)
    states = {1: EmbeddedBatch([student], "scored"), 2: EmbeddedBatch([teacher], "scored")}
    kl, _ = method.extra_loss(method.plan(None), states)
    expected = hand_kl(unit(student.numpy())[:, :4], unit(teacher.numpy())[:, :4], 1.0, 0.3)  # no T in the softmax
    assert kl.item() == pytest.approx(expected, rel=1e-9)


def test_kl_normalize_auto_follows_the_backbone_pipeline():
    for name in ("2dmse", "starbucks"):
        for normalizes in (True, False):
            method = make_method(name, 4, 32, kl="features", kl_normalize="auto")
            method.adapt_to_backbone("mean", normalizes)
            assert method.kl_normalize is normalizes and method.config()["kl_normalize"] is normalizes
        with pytest.raises(ValueError, match=f"{name}: kl_normalize must be true, false or auto, got 'yes'"):
            make_method(name, 4, 32, kl_normalize="yes")


def test_2dmse_st_views_draw_layer_0_and_a_width_per_loss():
    """Matryoshka2dLoss: (N, d1) and (n, d2), n in 0..N-1, d1 and d2 drawn apart from the dims and D."""
    method = make_method("2dmse", 6, 64, views="st", min_layer=0, kl="features", kl_widths="full")
    layers, widths = set(), set()
    for seed in range(200):
        plan = method.plan(np.random.default_rng(seed))
        n, d, d_n = plan.info["n"], plan.info["d"], plan.info["d_n"]
        assert [(v.layer, v.dim) for v in plan.views] == [(6, d), (n, d_n)]
        layers.add(n)
        widths |= {d, d_n}
    assert layers == {0, 1, 2, 3, 4, 5} and widths == {8, 16, 32, 64}
    with pytest.raises(ValueError, match="views=st compares the layers at full width only"):
        make_method("2dmse", 6, 64, views="st")
    with pytest.raises(ValueError, match="shallow_weighting=inverse divides by n, so it needs min_layer 1"):
        make_method("2dmse", 6, 64, min_layer=0, shallow_weighting="inverse")
    with pytest.raises(ValueError, match=r"min_layer must be an integer within 0..5, got 6"):
        make_method("2dmse", 6, 64, min_layer=6)
    # the default draw is unchanged: n from 1..N-1 with the same generator as before the option existed
    default = make_method("2dmse", 6, 64).plan(np.random.default_rng(7)).info["n"]
    assert default == int(np.random.default_rng(7).integers(1, 6))


def test_2dmse_python_draws_are_sentence_transformers_draws_step_for_step(tiny_dir, monkeypatch):
    """draws=python: the layers and widths of Matryoshka2dLoss itself, step for step, from the same seed; a run
    resumed at a later step draws what the uninterrupted run drew there."""
    import random

    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import Matryoshka2dLoss, MultipleNegativesRankingLoss

    from matryoshka2d.cells import nested_dims

    model = SentenceTransformer(str(tiny_dir), device="cpu")
    layers, hidden = model[0].auto_model.config.num_hidden_layers, model.get_embedding_dimension()
    dims = sorted(nested_dims(hidden), reverse=True)
    loss_fn = Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), dims)
    drawn, sample = [], random.sample

    def spy(population, k, **kwargs):
        out = sample(population, k, **kwargs)
        drawn.append(out[0])
        return out

    monkeypatch.setattr(random, "sample", spy)
    tokenize = getattr(model, "preprocess", None) or model.tokenize
    features = [tokenize(["a red cat sat", "a dog ran"]), tokenize(["the cat", "one dog"])]
    random.seed(42)
    for _ in range(5):
        loss_fn(features, labels=None)
    monkeypatch.undo()
    assert len(drawn) == 15  # three draws a step: last layer's width, prior layer, its width
    theirs = [(dims[a], n, dims[b]) for a, n, b in zip(drawn[0::3], drawn[1::3], drawn[2::3], strict=True)]
    options = {"views": "st", "min_layer": 0, "kl": "features", "kl_widths": "full", "draws": "python"}
    method = make_method("2dmse", layers, hidden, **options)
    plans = [method.plan(method.generator(42, step)) for step in range(5)]
    assert [(p.info["d"], p.info["n"], p.info["d_n"]) for p in plans] == theirs
    assert [(v.layer, v.dim) for v in plans[0].views] == [(layers, theirs[0][0]), (theirs[0][1], theirs[0][2])]
    resumed = make_method("2dmse", layers, hidden, **options)
    assert resumed.plan(resumed.generator(42, 3)).info == plans[3].info
    assert method.plan(method.generator(42, 3)).info == plans[3].info  # a step drawn again (micro-batches)
    with pytest.raises(ValueError, match="draws=python draws sentence-transformers' views in its order; set views=st"):
        make_method("2dmse", 6, 64, draws="python")


def dependency_inputs():
    torch.manual_seed(0)
    return [0.5 * torch.randn(24, 16), 0.3 * torch.randn(24, 16)]  # distinct leading singular values


def test_pca_target_is_the_same_from_two_svd_routines_and_any_sketch():
    xs = dependency_inputs()
    exact = pca_targets(xs, 4, svd="exact")
    for seed in (1, 2, 3):
        torch.manual_seed(seed)  # svd_lowrank's random sketch comes from torch's global generator
        lowrank = pca_targets(xs, 4, svd="lowrank", q=16, niter=4)
        for a, b in zip(exact, lowrank, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # without the convention, the same routine returns columns of either sign from one sketch to the next
    signs = set()
    for seed in (1, 2, 3, 4):
        torch.manual_seed(seed)
        raw = pca_targets(xs, 4, svd="lowrank", sign="raw", q=16, niter=4)[1]
        signs.add(tuple(torch.sign((raw * exact[1]).sum(0)).tolist()))
    assert len(signs) > 1


def test_fixed_signs_make_the_largest_entry_of_each_column_positive():
    u = torch.tensor([[0.1, -0.9], [-0.8, 0.2], [0.3, 0.1]])
    flipped = fixed_signs(u)
    torch.testing.assert_close(flipped, torch.tensor([[-0.1, 0.9], [0.8, -0.2], [-0.3, -0.1]]))
    x = dependency_inputs()[0]
    a = torch.softmax(x.T @ x / 4.0, dim=-1)
    u = torch.linalg.svd(a).U
    assert (fixed_signs(u[:, :1]) > 0).all()  # the Perron-like first vector comes out positive


def test_lowrank_pca_with_raw_signs_is_angle_embs_call():
    """angle-emb's pca_compress (angle.py L465-478): torch.svd_lowrank(A, q=k) per layer, niter 2, no centring."""
    xs, k = dependency_inputs(), 4
    torch.manual_seed(5)
    ours = pca_targets(xs, k, svd="lowrank", sign="raw")
    torch.manual_seed(5)
    for x, target in zip(xs, ours, strict=True):
        a = torch.softmax(x.T @ x / math.sqrt(x.shape[-1]), dim=-1)
        u, s, _ = torch.svd_lowrank(a, q=k)
        torch.testing.assert_close(target, x @ (u @ torch.diag(s)), rtol=0, atol=0)


def test_ese_full_loss_off_drops_the_last_layer_at_full_width():
    """The paper's eqs. 2 and 7 have no (N, D) term; angle-emb's compute_loss adds it (full_loss=true)."""
    method = make_method("ese", 6, 64, k=16, full_loss=False)
    assert [(v.layer, v.dim) for v in method.plan(None).views] == [(i, 16) for i in range(1, 7)]
    states = {i: EmbeddedBatch([torch.randn(4, 64)] * 2, "scored", torch.ones(4)) for i in range(1, 7)}
    total, parts = method.loss(method.plan(None), states, lambda batch: torch.tensor(1.0))
    assert total.item() == pytest.approx(1 + sum(1 / (1 + math.log(i)) for i in range(1, 6)), rel=1e-6)
    assert "task(6,64)" not in parts and method.config()["full_loss"] is False
    with pytest.raises(ValueError, match="ese: pca must be one of exact, lowrank, got 'svd'"):
        make_method("ese", 6, 64, k=16, pca="svd")


def test_ese_angle_emb_layers_with_cls_pooling_warn_that_layer_0_is_constant():
    method = make_method("ese", 6, 64, k=16, layers="angle-emb")
    (warning,) = method.adapt_to_backbone("cls", False)
    assert "hidden_states[0], the embedding output" in warning and "cannot rank anything" in warning
    assert method.adapt_to_backbone("mean", False) == []
    assert make_method("ese", 6, 64, k=16).adapt_to_backbone("cls", False) == []


def test_starbucks_sizes_must_grow_in_depth_and_width_together():
    with pytest.raises(ValueError, match=r"starbucks size \(3,32\) is narrower than \(2,64\), a shallower size"):
        make_method("starbucks", 4, 128, sizes=[(2, 64), (3, 32), (4, 128)])
    with pytest.raises(ValueError, match=r"starbucks size \(2,64\) is listed twice"):
        make_method("starbucks", 4, 128, sizes=[(2, 64), (2, 64), (4, 128)])
    # an unsorted list that grows together once sorted is fine; the same layer may be listed at two widths
    method = make_method("starbucks", 4, 128, sizes=[(4, 128), (1, 32), (2, 32), (2, 64)])
    assert method.sizes == [(1, 32), (2, 32), (2, 64), (4, 128)]


def test_starbucks_teacher_full_is_the_full_model_whatever_the_list():
    sizes = [(1, 16), (2, 32)]
    narrow = make_method("starbucks", 4, 64, sizes=sizes)
    (warning,) = narrow.adapt_to_backbone("mean", False)
    assert "KL teacher is the largest listed size (2,32), not the full model (4,64)" in warning
    full = make_method("starbucks", 4, 64, sizes=sizes, kl_teacher="full")
    assert full.adapt_to_backbone("mean", False) == []
    plan = full.plan(None)
    assert [(v.layer, v.dim) for v in plan.views] == sizes and plan.layers == [1, 2, 4]  # layer 4 as teacher only
    torch.manual_seed(0)
    states = {i: EmbeddedBatch([torch.randn(5, 64, requires_grad=True)] * 2, "scored") for i in (1, 2, 4)}
    _, parts = full.extra_loss(plan, states)
    teacher = states[4].columns[0]
    kl, _ = full.extra_loss(plan, states)
    kl.backward()
    assert teacher.grad is None and "kl" in parts  # the full model is the (detached) teacher of both sizes


def test_cli_names_the_starbucks_size_that_does_not_grow(tiny_dir, tmp_path, capsys):
    data = tmp_path / "t.tsv"
    data.write_text("anchor\tpositive\tnegative\nred cat\tred cat runs\tblue dog\n")
    args = f"train --model {tiny_dir} --pooling mean --data {data} --output {tmp_path / 'o'}".split()
    assert main([*args, "--method", "starbucks", "--sizes", "2:16,3:8"]) == 2
    err = capsys.readouterr().err
    assert "starbucks size (3,8) is narrower than (2,16)" in err and "Traceback" not in err


def test_the_2dmse_era_loss_preset_is_angle_emb_0_3_on_triplets():
    """angle-emb v0.3.10 AngleLoss on triplets (format B, L931-952), w1 = w2 = w3 = 1, cosine and in-batch tau
    20, angle tau 1: CoSENT over (q, p) = 1 and (q, n) = 0, one cross-entropy of each query against all
    positives and negatives, and the angle ranking over the same pairs, added up."""
    from matryoshka2d.losses import make_task_loss
    from matryoshka2d.training import presets

    torch.manual_seed(2)
    q, p, n = (torch.randn(6, 16, dtype=torch.float64) for _ in range(3))
    ours = make_task_loss("angle", **presets.load("2dmse-angle-0.3")["loss_options"])(
        EmbeddedBatch([q, p, n], "triplets")
    )

    def ranking(scores, labels):  # log(1 + sum over (i, j) with label_i < label_j of exp(s_i - s_j))
        pairs = [scores[i] - scores[j] for i in range(len(scores)) for j in range(len(scores)) if labels[i] < labels[j]]
        return math.log1p(sum(math.exp(x) for x in pairs))

    def angle(u, v):  # |sum of (u / v) as complex numbers, times |v| / |u||
        a, b, c, d = u[:8], u[8:], v[:8], v[8:]
        z = (c**2 + d**2).sum()
        re, im = (a * c + b * d) / z, (b * c - a * d) / z
        ratio = math.sqrt(float((a**2 + b**2).sum() / z))
        return abs(float((re + im).sum()) / ratio)

    u, v = torch.cat([q, q]), torch.cat([p, n])
    labels = [1] * 6 + [0] * 6
    cosine = [20 * float(torch.nn.functional.cosine_similarity(x, y, dim=0)) for x, y in zip(u, v, strict=True)]
    candidates = torch.nn.functional.normalize(torch.cat([p, n]), dim=-1)
    logits = 20 * torch.nn.functional.normalize(q, dim=-1) @ candidates.T
    ce = float(torch.nn.functional.cross_entropy(logits, torch.arange(6)))
    expected = ranking(cosine, labels) + ce + ranking([angle(x, y) for x, y in zip(u, v, strict=True)], labels)
    assert ours.item() == pytest.approx(expected, rel=1e-9)
