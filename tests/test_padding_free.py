"""Padding-free training steps: length groups cover every text once, pad little, and give the step the same
loss and gradients as per-column padding (dropout off: the two draw their masks in different shapes)."""

import itertools

import numpy as np
import pytest
import torch

from matryoshka2d.models.batching import length_groups, padded_positions
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.packing import TRAINING_CALL_OVERHEAD_TOKENS, call_overhead
from matryoshka2d.training.trainer import Trainer

WORDS = [
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "bird",
    "runs",
    "sleeps",
    "eats",
    "big",
    "small",
    "old",
    "new",
    "happy",
    "sad",
]


def brute_force(lengths, overhead):
    """The cheapest cut of the sorted lengths into runs, over every set of cut points."""
    ordered = sorted(lengths)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(ordered) - 1):
        bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], len(ordered)]
        best = min(best, sum(overhead + (b - a) * ordered[b - 1] for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("overhead", [0, 3, 12, 100])
def test_length_groups_are_the_cheapest_partition(overhead):
    rng = np.random.default_rng(overhead)
    for _ in range(20):
        lengths = rng.integers(1, 30, rng.integers(1, 10)).tolist()
        groups = length_groups(lengths, overhead)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
        cost = sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)
        assert cost == brute_force(lengths, overhead)
        # runs of the ascending order: every text of a group is at most as long as every text of the next
        assert all(max(np.take(lengths, a)) <= min(np.take(lengths, b)) for a, b in itertools.pairwise(groups))


def test_length_groups_extremes_and_cap():
    lengths = [5, 3, 9, 3, 5, 12]
    free = length_groups(lengths, 0)
    assert padded_positions(lengths, free) == sum(lengths)  # no padding at all: one group per distinct length
    assert [g.tolist() for g in free] == [[1, 3], [0, 4], [2], [5]]  # equal lengths keep their order
    assert len(length_groups(lengths, 1e6)) == 1
    capped = length_groups([4] * 7 + [6], 1e6, max_size=3)
    assert max(len(g) for g in capped) <= 3
    assert sorted(np.concatenate(capped).tolist()) == list(range(8))
    assert length_groups([], 5) == []
    with pytest.raises(ValueError, match="overhead must be at least 0"):
        length_groups([1], -1)


@pytest.fixture(scope="module")
def varied_triplets(tmp_path_factory):
    """Triplets whose texts run from 1 to 20 words, so length groups differ from the columns."""
    rng = np.random.default_rng(3)
    rows = ["anchor\tpositive\tnegative"]
    for _ in range(16):
        a, p, n = (" ".join(rng.choice(WORDS, rng.integers(1, 21))) for _ in range(3))
        rows.append(f"{a}\t{p}\t{n}")
    path = tmp_path_factory.mktemp("data") / "varied.tsv"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def sts_dev(tmp_path_factory):
    rows = ["sentence1\tsentence2\tscore", "red cat\tred cat\t5", "red cat\tblue dog\t1", "old dog\tnew cat\t0"]
    path = tmp_path_factory.mktemp("dev") / "dev.tsv"
    path.write_text("\n".join(rows) + "\n")
    return path


def step_loss_and_grads(tiny_dir, data, sts_dev, out, padding_free, method, loss, overhead=None):
    options = {"k": 8} if method == "ese" else {}
    cfg = TrainConfig(
        model=str(tiny_dir),
        pooling="mean",
        data=[str(data)],
        output=str(out),
        batch_size=16,
        eval_file=str(sts_dev),
        save_steps=0,
        method=method,
        loss=loss,
        method_options=options,
        padding_free=padding_free,
    )
    trainer = Trainer(cfg)
    if overhead is not None:
        trainer._overhead = overhead
    trainer.encoder.eval()  # dropout off: padded and grouped passes would draw different masks
    batch = trainer.prepare_batch(0)[0]
    value, _ = trainer.compute_loss(0, batch)
    value.backward()
    grads = {n: p.grad.clone() for n, p in trainer.encoder.named_parameters() if p.grad is not None}
    return float(value.detach()), grads, batch[0]


@pytest.mark.parametrize(("method", "loss"), [("2dmse", "infonce"), ("ese", "angle"), ("asymmetric", "infonce")])
def test_padded_and_padding_free_steps_give_the_same_loss(tiny_dir, varied_triplets, sts_dev, tmp_path, method, loss):
    padded, padded_grads, columns = step_loss_and_grads(
        tiny_dir, varied_triplets, sts_dev, tmp_path / "p", False, method, loss
    )
    free, free_grads, groups = step_loss_and_grads(
        tiny_dir, varied_triplets, sts_dev, tmp_path / "f", True, method, loss, overhead=0.0
    )
    assert len(columns.groups) == 3 and len(groups.groups) > 3  # the grouping really differs
    tokens = lambda b: sum(g["input_ids"].numel() for g in b.groups)  # noqa: E731
    assert tokens(groups) < tokens(columns)
    assert [groups.column_ids(c) for c in range(3)] == [columns.column_ids(c) for c in range(3)]
    assert abs(free - padded) <= 1e-5
    assert padded_grads.keys() == free_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(free_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_padding_free_is_the_cpu_default_and_can_be_turned_off():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert call_overhead(cpu, None) == TRAINING_CALL_OVERHEAD_TOKENS["cpu"]
    assert call_overhead(cpu, False) is None
    assert call_overhead(cuda, None) is None  # not measured there: per-column padding unless asked
    assert call_overhead(cuda, True) == TRAINING_CALL_OVERHEAD_TOKENS["cpu"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_rows_pads_as_the_tokenizer_does(tokenizer, side):
    from copy import deepcopy

    from matryoshka2d.models.batching import pad_rows

    tok = deepcopy(tokenizer)
    tok.padding_side = side
    texts = ["a", "a much longer sentence than the first one", "two words"]
    encoded = tok(texts, truncation=True, max_length=16)
    names = ["input_ids", "token_type_ids", "attention_mask"]
    for idx in ([0, 1, 2], [2, 0], [1]):
        expected = tok.pad([{k: encoded[k][i] for k in names} for i in idx], return_tensors="pt")
        got = pad_rows(tok, encoded, idx, names)
        assert got.keys() == set(names)
        assert all(torch.equal(got[k], expected[k]) for k in names)


def test_inference_batches_cap_their_size_and_pad_less_than_fixed_runs():
    from matryoshka2d.models.batching import inference_batches

    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(8, 20, 250), [90, 120, 60, 75, 110, 100]]).tolist()
    fixed = inference_batches(lengths, 64, None)
    assert [len(b) for b in fixed] == [64, 64, 64, 64]
    assert lengths[fixed[0][0]] == 120  # longest first, as before
    grouped = inference_batches(lengths, 64, 48.0)
    assert max(len(b) for b in grouped) <= 64
    assert sorted(np.concatenate(grouped).tolist()) == list(range(len(lengths)))
    assert padded_positions(lengths, grouped) < 0.8 * padded_positions(lengths, fixed)


@pytest.mark.parametrize("overhead", [None, 0.0, 48.0, 1e6])
def test_a_token_budget_bounds_every_pass_and_keeps_every_text(overhead):
    from matryoshka2d.models.batching import inference_batches

    rng = np.random.default_rng(7)
    lengths = np.concatenate([rng.integers(5, 40, 300), [256] * 40, [300]]).tolist()  # 300: over the budget alone
    batches = inference_batches(lengths, 64, overhead, token_budget=64 * 64)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) <= 64 and (len(batch) * longest <= 64 * 64 or len(batch) == 1)
    assert max(len(b) for b in batches if max(lengths[i] for i in b) == 256) == 16  # 256-token texts 16 at a time
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        length_groups([1, 2], 0.0, max_tokens=0)
