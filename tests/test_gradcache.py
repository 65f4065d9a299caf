"""Gradient accumulation by gradient caching (matryoshka2d.training.gradcache): 4 micro-batches of 8 give the
loss and the gradients of one batch of 32, for every method and every task loss, in-batch negatives included.

Two checks, because dropout cannot draw the same masks for one (32, L) forward pass and four (8, L_i) ones:
- without dropout, accumulation 4 x 8 against one plain batch of 32;
- with dropout, accumulation 4 x 8 against the whole batch's loss backpropagated directly through the same
  four forward passes (same random stream): the replay of each micro-batch must redraw the very masks of its
  first pass, and a replay that does not restore the random state is shown to miss.
"""

import numpy as np
import pytest
import torch

from helpers.data import WORDS
from matryoshka2d.training import gradcache
from matryoshka2d.training.config import TrainConfig
from matryoshka2d.training.trainer import Trainer

# float32 sums in another order: with one torch thread (the suite's workers) a gradient of ~0.6 differs by 2e-5
# between one batch of 32 and four of 8; a real mistake in the cache (a missed micro-batch, a stale embedding)
# moves gradients by orders of magnitude more.
TOLERANCE = {"rtol": 1e-4, "atol": 5e-5}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """40 rows of each kind of training data (a batch of 32, texts of different lengths)."""
    rng = np.random.default_rng(3)
    folder = tmp_path_factory.mktemp("gradcache-data")

    def text():
        return " ".join(rng.choice(WORDS, int(rng.integers(2, 7))))

    files = {
        "triplets": ["anchor\tpositive\tnegative"] + [f"{text()}\t{text()}\t{text()}" for _ in range(40)],
        "nli": ["premise\thypothesis\tlabel"]
        + [f"{text()}\t{text()}\t{rng.choice(['entailment', 'neutral', 'contradiction'])}" for _ in range(40)],
        "scored": ["sentence1\tsentence2\tscore"] + [f"{text()}\t{text()}\t{rng.uniform(0, 5):.2f}" for _ in range(40)],
    }
    for kind, rows in files.items():
        (folder / f"{kind}.tsv").write_text("\n".join(rows) + "\n")
    (folder / "sentences.txt").write_text("\n".join(text() for _ in range(40)) + "\n")
    dev = ["sentence1\tsentence2\tscore", "red cat\tred cat\t5", "red cat\tblue dog\t1", "old dog\tnew cat\t0"]
    (folder / "dev.tsv").write_text("\n".join(dev) + "\n")
    return folder


def trainer(model, data, kind, method, loss, accumulation, method_options=None):
    source = data / ("sentences.txt" if kind == "sentences" else f"{kind}.tsv")
    config = TrainConfig(
        model=str(model),
        pooling="mean",
        data=[str(source)],
        output=str(data / "unused"),
        method=method,
        loss=loss,
        batch_size=32,
        gradient_accumulation=accumulation,
        eval_file=str(data / "dev.tsv"),
        device="cpu",
        save_steps=0,
        method_options=method_options or {},
    )
    t = Trainer(config)
    t.encoder.train()
    return t


def gradients(t):
    """The gradients the step left, which are then cleared: one trainer (same weights) serves several steps."""
    modules = {"encoder": t.encoder, "method": t.method, "task_loss": t.task_loss}
    grads = {
        f"{name}.{key}": p.grad.clone()
        for name, module in modules.items()
        for key, p in module.named_parameters()
        if p.grad is not None
    }
    t.optimizer.zero_grad(set_to_none=True)
    return grads


def one_batch(t, step=0):
    t.config.gradient_accumulation = 1
    (micro,) = t.prepare_batch(step)
    loss, _ = t.compute_loss(step, micro)
    t.backward(loss)
    return loss.detach(), gradients(t)


def accumulated(t, step=0):
    t.config.gradient_accumulation = 4
    micro = t.prepare_batch(step)
    assert [rows for _, _, rows in micro] == [8, 8, 8, 8]
    loss, _ = gradcache.accumulate(t, step, micro)
    return loss.detach(), gradients(t)


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], **TOLERANCE)
    assert a[1].keys() == b[1].keys() and a[1]
    for key in a[1]:
        torch.testing.assert_close(a[1][key], b[1][key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


CASES = [
    # every method, on triplets with the default loss (AnglE: in-batch negatives with hard negatives)
    ("triplets", "plain", "angle", None),
    ("triplets", "mrl", "angle", None),
    ("triplets", "2dmse", "angle", None),  # + the KL of in-batch similarity distributions
    (
        "triplets",
        "2dmse",
        "angle",
        {"kl": "features", "kl_widths": "full", "kl_normalize": True, "views": "st", "min_layer": 0},
    ),
    ("triplets", "ese", "angle", {"k": 16, "beta": 1.0, "compress_target": "dependency"}),  # + PCA of the batch
    ("triplets", "ese", "angle", {"k": 16, "beta": 1.0, "layers": "angle-emb", "dynamic_weights": True}),
    ("triplets", "ese", "angle", {"k": 16, "beta": 1.0, "full_loss": False}),
    ("triplets", "starbucks", "angle", None),
    ("triplets", "starbucks", "infonce", {"kl": "features", "kl_teacher": "full", "kl_detach": False}),
    ("triplets", "asymmetric", "angle", None),
    ("triplets", "separate", "angle", {"layer": 2, "dim": 16}),
    # every task loss
    ("triplets", "2dmse", "infonce", None),
    ("triplets", "2dmse", "cosent", None),
    ("nli", "2dmse", "angle", None),
    ("nli", "2dmse", "infonce", None),
    ("nli", "2dmse", "softmax", None),
    ("scored", "2dmse", "angle", None),
    ("sentences", "2dmse", "simcse", None),
]


@pytest.mark.parametrize(("kind", "method", "loss", "options"), CASES)
def test_accumulating_four_micro_batches_of_8_equals_one_batch_of_32(no_dropout_dir, data, kind, method, loss, options):
    t = trainer(no_dropout_dir, data, kind, method, loss, 4, options)
    assert_same(accumulated(t), one_batch(t))


def direct(t, step=0):
    """The whole batch's loss backpropagated through the four micro-batches' forward passes kept alive."""
    t.config.gradient_accumulation = 4
    micro = t.prepare_batch(step)
    plan = t.start_step(step)
    per_micro = [t.embed(features, plan) for features, _, _ in micro]
    per_column = [
        {layer: torch.cat([p[c][layer] for p in per_micro]) for layer in plan.layers} for c in range(len(per_micro[0]))
    ]
    labels = None if micro[0][1] is None else np.concatenate([labels for _, labels, _ in micro])
    loss, _ = t.objective(plan, per_column, labels)
    t.backward(loss)
    return loss.detach(), gradients(t)


DROPOUT_CASES = [
    ("triplets", "plain", "infonce", None),
    ("triplets", "plain", "angle", None),
    ("triplets", "2dmse", "angle", None),
    ("triplets", "ese", "angle", {"k": 16, "beta": 1.0}),
]


@pytest.mark.parametrize(("kind", "method", "loss", "options"), DROPOUT_CASES)
def test_with_dropout_the_replay_redraws_the_masks_of_the_first_pass(tiny_dir, data, kind, method, loss, options):
    t = trainer(tiny_dir, data, kind, method, loss, 4, options)
    assert_same(accumulated(t), direct(t))


def test_the_replay_is_exact_under_activation_checkpointing(tiny_dir, data):
    """Checkpointing runs each layer's forward again in backward; the replayed masks still match the first pass."""
    t = trainer(tiny_dir, data, "triplets", "2dmse", "angle", 4)
    reference = direct(t)
    t.encoder.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same(accumulated(t), reference)


def test_a_replay_without_the_saved_random_state_would_not_be_exact(tiny_dir, data, monkeypatch):
    """The control: dropout is on in the model above, so restoring the random state is what makes it exact."""
    t = trainer(tiny_dir, data, "triplets", "plain", "infonce", 4)
    reference = direct(t)
    monkeypatch.setattr(gradcache.RandomState, "__enter__", lambda self: None)
    monkeypatch.setattr(gradcache.RandomState, "__exit__", lambda self, *exc: None)
    loss, grads = accumulated(t)
    torch.testing.assert_close(loss, reference[0], **TOLERANCE)  # the loss comes from the first pass
    worst = max(float((grads[k] - reference[1][k]).abs().max()) for k in grads)
    assert worst > 1e-3


def test_accumulated_training_steps_match_whole_batch_steps(no_dropout_dir, data):
    """Three optimizer steps (AdamW, clipping, schedule) land on the same weights and log the same losses."""
    runs = []
    for accumulation in (1, 4):
        t = trainer(no_dropout_dir, data, "triplets", "2dmse", "angle", accumulation)
        t.total_steps = 3
        losses = [t.train_step()["loss"] for _ in range(3)]
        t._prefetch.close()
        runs.append((losses, {k: v.detach().clone() for k, v in t.encoder.state_dict().items()}))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    for key, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][key], value, rtol=1e-4, atol=1e-6)
