"""Each method asks for exactly the views its paper describes, and computes only the layers they need."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from matryoshka2d.cells import nested_dims, parse_cells
from matryoshka2d.losses import make_task_loss
from matryoshka2d.losses.align import feature_kl
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.methods import make_method
from matryoshka2d.methods.base import View
from matryoshka2d.methods.ese import fixed_signs, pca_target, pca_targets
from matryoshka2d.methods.starbucks import default_sizes


def views(method, seed=0):
    return [(v.layer, v.dim) for v in method.plan(np.random.default_rng(seed)).views]


def test_plain_is_the_full_model():
    assert views(make_method("plain", 6, 384)) == [(6, 384)]


def test_mrl_nested_dims_at_the_last_layer():
    assert nested_dims(384) == [8, 16, 32, 64, 128, 256, 384]
    assert views(make_method("mrl", 6, 384)) == [(6, d) for d in (8, 16, 32, 64, 128, 256, 384)]


def test_2dmse_four_views_with_uniform_shallow_layer_and_nested_dim():
    method = make_method("2dmse", 6, 384)
    seen_n, seen_d = set(), set()
    for seed in range(300):
        plan = method.plan(np.random.default_rng(seed))
        n, d = plan.info["n"], plan.info["d"]
        assert [(v.layer, v.dim) for v in plan.views] == [(6, 384), (n, 384), (6, d), (n, d)]
        assert plan.layers == sorted({n, 6})
        seen_n.add(n)
        seen_d.add(d)
    assert seen_n == {1, 2, 3, 4, 5}  # U(1, N-1): never the last layer
    assert seen_d == {8, 16, 32, 64, 128, 256}  # the nested set below D


def test_2dmse_kl_pulls_shallow_towards_detached_last_layer():
    method = make_method("2dmse", 4, 8, dims=[4])
    plan = method.plan(np.random.default_rng(1))
    n = plan.info["n"]
    leaves = {layer: [torch.randn(3, 8, requires_grad=True) for _ in range(2)] for layer in (n, 4)}
    states = {layer: EmbeddedBatch(cols, "scored", torch.tensor([1.0, 2.0, 3.0])) for layer, cols in leaves.items()}
    kl, parts = method.extra_loss(plan, states)
    kl.backward()
    assert "kl" in parts and kl.item() > 0
    assert leaves[n][0].grad.abs().sum() > 0
    assert all(t.grad is None for t in leaves[4])


def test_ese_views_weights_and_layer_one_is_the_first_transformer_layer():
    method = make_method("ese", 6, 384)
    assert views(method) == [(6, 384), (1, 128), (2, 128), (3, 128), (4, 128), (5, 128), (6, 128)]
    weights = method.layer_weights().tolist()
    assert weights == pytest.approx([1 / (1 + math.log(i)) for i in range(1, 6)])
    assert weights[0] == 1.0
    # with a task loss that returns 1 per view and no compression, the total is 1 + sum(w_i) + 1
    no_compress = make_method("ese", 6, 384, beta=0.0)
    states = {i: EmbeddedBatch([torch.randn(4, 384)] * 2, "scored", torch.ones(4)) for i in range(1, 7)}
    total, _ = no_compress.loss(no_compress.plan(None), states, lambda batch: torch.tensor(1.0))
    assert total.item() == pytest.approx(2 + sum(weights), rel=1e-6)


def test_ese_compress_target_and_terms():
    torch.manual_seed(0)
    x = torch.randn(10, 16)
    target = pca_target(x, 4)
    assert target.shape == (10, 4) and not target.requires_grad
    a = torch.softmax(x.T @ x / 4.0, dim=-1)
    u, s, _ = torch.linalg.svd(a)
    torch.testing.assert_close(target, x @ fixed_signs(u[:, :4]) @ torch.diag(s[:4]))
    method = make_method("ese", 3, 16, k=4, beta=1.0, compress_target="dependency")
    states = {
        i: EmbeddedBatch([torch.randn(5, 16, requires_grad=True)] * 2, "scored", torch.ones(5)) for i in (1, 2, 3)
    }
    total, parts = method.loss(method.plan(None), states, lambda batch: batch.columns[0].sum() * 0)
    assert {"compress1", "compress2", "compress3"} <= set(parts)
    total.backward()


def test_ese_scaled_target_keeps_the_direction_and_takes_the_size_of_the_first_k():
    torch.manual_seed(0)
    xs = [torch.randn(10, 16), 3 * torch.randn(10, 16)]
    plain, scaled = pca_targets(xs, 4), pca_targets(xs, 4, scaled=True)
    for x, p, s in zip(xs, plain, scaled, strict=True):
        torch.testing.assert_close(s.norm(dim=-1), x[:, :4].norm(dim=-1))
        torch.testing.assert_close(F.normalize(s, dim=-1), F.normalize(p, dim=-1))
    # one batched SVD gives what one SVD per layer gives
    torch.testing.assert_close(plain[1], pca_target(xs[1], 4))


def test_ese_angle_emb_reading_indexes_from_the_embedding_output_and_averages_the_shallow_sum():
    method = make_method("ese", 6, 64, k=16, layers="angle-emb", shallow_mean=True, beta=0.0)
    assert method.shallow == [0, 1, 2, 3, 4]
    weights = [1 / (1 + math.log(1 + i)) for i in range(5)]
    assert method.layer_weights().tolist() == pytest.approx(weights, rel=1e-6)
    assert views(method) == [(6, 64), (0, 16), (1, 16), (2, 16), (3, 16), (4, 16), (6, 16)]
    states = {i: EmbeddedBatch([torch.randn(4, 64)] * 2, "scored", torch.ones(4)) for i in range(0, 7)}
    total, _ = method.loss(method.plan(None), states, lambda batch: torch.tensor(1.0))
    assert total.item() == pytest.approx(2 + sum(weights) / 5, rel=1e-6)
    with pytest.raises(ValueError, match="layers must be one of paper, angle-emb"):
        make_method("ese", 6, 64, k=16, layers="hidden")


def test_2dmse_reference_options():
    method = make_method("2dmse", 6, 64, shallow_weighting="inverse", kl="features", kl_widths="full", kl_factor="T")
    plan = method.plan(np.random.default_rng(3))
    n = plan.info["n"]
    assert [v.weight for v in plan.views] == pytest.approx([1.0, 1 / n, 1.0, 1 / n])
    student = torch.randn(4, 64, requires_grad=True)
    teacher = torch.randn(4, 64, requires_grad=True)
    states = {layer: EmbeddedBatch([teacher, teacher], "scored", torch.ones(4)) for layer in range(1, 7)}
    states[n] = EmbeddedBatch([student, student], "scored", torch.ones(4))
    kl, parts = method.extra_loss(plan, states)
    expected = feature_kl(torch.cat([student, student]), torch.cat([teacher, teacher]), 0.3, "T")
    assert kl.item() == pytest.approx(expected.item(), rel=1e-6) and "kl" in parts
    kl.backward()
    assert teacher.grad is None  # detached by default, as sentence-transformers since PR #3757
    with pytest.raises(ValueError, match="kl_factor must be one of T2, T, 1"):
        make_method("2dmse", 6, 64, kl_factor="T3")


def test_starbucks_feature_kl_as_the_authors_code():
    method = make_method(
        "starbucks", 2, 8, sizes=[(1, 4), (2, 8)], kl="features", kl_factor="T", kl_detach=False, kl_scale_logits=False
    )
    student, teacher = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    states = {1: EmbeddedBatch([student], "scored"), 2: EmbeddedBatch([teacher], "scored")}
    kl, _ = method.extra_loss(method.plan(None), states)
    expected = F.kl_div(F.log_softmax(student[:, :4], -1), F.softmax(teacher[:, :4], -1), reduction="batchmean") * 0.3
    assert kl.item() == pytest.approx(expected.item(), rel=1e-5)
    kl.backward()
    assert teacher.grad is not None and teacher.grad.abs().sum() > 0  # their teacher is not detached


def test_ese_dynamic_weights_are_learned_and_keep_their_sum():
    method = make_method("ese", 6, 64, k=16, dynamic_weights=True)
    default = sum(1 / (1 + math.log(i)) for i in range(1, 6))
    assert method.layer_weights().sum().item() == pytest.approx(default, rel=1e-6)
    assert method.layer_weights().tolist() == pytest.approx([1 / (1 + math.log(i)) for i in range(1, 6)], rel=1e-5)
    assert [name for name, _ in method.named_parameters()] == ["theta"]


def test_starbucks_default_sizes():
    assert default_sizes(12, 768) == [(2, 32), (4, 64), (6, 128), (8, 256), (10, 512), (12, 768)]
    assert default_sizes(6, 384) == [(1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 384)]
    method = make_method("starbucks", 6, 384)
    assert views(method) == default_sizes(6, 384)
    assert method.kl_temperature == 0.3


def test_starbucks_custom_list_and_range_check():
    method = make_method("starbucks", 4, 32, sizes=parse_cells("1:8,2:16"))
    plan = method.plan(None)
    assert plan.views == [View(1, 8), View(2, 16)] and plan.layers == [1, 2]
    with pytest.raises(ValueError, match=r"\(5,8\) is outside"):
        make_method("starbucks", 4, 32, sizes=[(5, 8)])


def test_separate_trains_one_cut_view():
    method = make_method("separate", 6, 384, layer=2, dim=64)
    assert views(method) == [(2, 64)] and method.keep_layers == 2


def test_unknown_method_and_bad_options():
    with pytest.raises(ValueError, match="Unknown method 'ese2'"):
        make_method("ese2", 6, 384)
    with pytest.raises(ValueError, match="k=500 must be within 1..384"):
        make_method("ese", 6, 384, k=500)
    with pytest.raises(ValueError, match="at least 2 layers"):
        make_method("2dmse", 1, 384)


def test_parse_cells_errors():
    assert parse_cells("(1,32) (2,64)") == [(1, 32), (2, 64)]
    with pytest.raises(ValueError, match="cannot read cell 'x:1'"):
        parse_cells("x:1")


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("plain", {}),
        ("mrl", {}),
        ("2dmse", {}),
        ("ese", {"k": 4, "beta": 1.0, "dynamic_weights": True}),
        ("starbucks", {"sizes": [(1, 4), (3, 8)]}),
        ("separate", {"layer": 2, "dim": 4}),
        ("asymmetric", {"dims": [4]}),
    ],
)
def test_a_methods_loss_parts_stay_on_the_device(name, options):
    """The trainer reads the parts back on logging steps only; a float() in a method would be a host sync (a
    wait for the GPU) every step."""
    method = make_method(name, 3, 16, **options)
    plan = method.plan(np.random.default_rng(0))
    states = {n: EmbeddedBatch([torch.randn(6, 16) for _ in range(3)], "triplets", None) for n in plan.layers}
    _, parts = method.loss(plan, states, make_task_loss("infonce"))
    assert parts and all(isinstance(v, torch.Tensor) for v in parts.values()), parts


@pytest.mark.parametrize("name", ["plain", "mrl", "2dmse", "ese", "starbucks", "separate", "asymmetric"])
def test_every_method_records_its_settings_as_json_under_their_keys(name):
    """config() is what matryoshka2d.json and the model card show: every named setting, JSON as written."""
    method = make_method(name, 6, 384)
    record = method.config()
    assert record["method"] == name
    assert json.loads(json.dumps(record)) == record  # tuples are already lists: reading it back changes nothing
    named = {entry.partition("=")[0] for entry in method.settings.split()}
    assert named <= set(record) and len(record) >= len(named) + 1


def test_a_setting_recorded_under_another_key_reads_its_attribute():
    record = make_method("2dmse", 6, 384, kl="features", shallow_weight=0.5).config()
    assert record["kl"] == "features" and record["weights_full_shallow_lastsmall_shallowsmall"] == [1.0, 0.5, 1.0, 1.0]
    sizes = make_method("starbucks", 6, 384).config()["sizes"]
    assert all(isinstance(s, list) and len(s) == 2 for s in sizes)
