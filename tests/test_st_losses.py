"""Our methods as sentence-transformers losses (matryoshka2d.st_losses): the same loss as our trainer on the same
batch, the library's own Matryoshka2dLoss reproduced through the wrapping path, a run of SentenceTransformerTrainer
whose folder our commands take, and the errors a user can meet."""

import inspect
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    Matryoshka2dLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)

from helpers.models import tiny_run
from matryoshka2d.cells import nested_dims
from matryoshka2d.cli import main
from matryoshka2d.methods import METHODS
from matryoshka2d.models.backbones import minilm_dir
from matryoshka2d.paths import data_dir
from matryoshka2d.st_losses import ESELoss, StarbucksLoss, TaskLoss, TwoDMSELoss
from matryoshka2d.st_losses.task_loss import batch_kind
from matryoshka2d.training.data import read_training_data
from matryoshka2d.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

LOSSES = {"ese": ESELoss, "starbucks": StarbucksLoss, "2dmse": TwoDMSELoss}


@pytest.fixture(scope="module")
def st_model_dir(no_dropout_dir):
    """The tiny dropout-free BERT as sentence-transformers loads it: Transformer, mean Pooling."""
    return no_dropout_dir


def st_model(folder) -> SentenceTransformer:
    return SentenceTransformer(str(folder), device="cpu")


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("ese", {"k": 16}),  # below the tiny model's width, 32, which ESE's default k takes
        ("ese", {"k": 16, "beta": 1.0}),  # learn-to-compress on: the PCA target and its MSE + KL
        ("starbucks", {}),
        ("2dmse", {}),
    ],
    ids=["ese", "ese-compress", "starbucks", "2dmse"],
)
def test_the_loss_equals_our_trainers_on_the_same_batch(method, options, st_model_dir, triplets, sts_dev, tmp_path):
    """No dropout, the same rows: `train --method M`'s loss of step 1 and the loss's value of its second call."""
    config = tiny_run(st_model_dir, triplets, sts_dev, tmp_path / "run", method=method, method_options=options)
    trainer = Trainer(config)
    ours, _ = trainer.compute_loss(1)
    columns, _ = trainer.data.rows(trainer.batch_indices(1))

    model = st_model(st_model_dir)
    loss = LOSSES[method](model, TaskLoss(model, "angle"), seed=config.seed, **options)
    features = [model.tokenize(column) for column in columns]
    loss(features, None)  # step 0
    theirs = loss(features, None)  # step 1: the same draws as the trainer's step 1
    assert loss.steps == 2
    assert theirs.item() == pytest.approx(ours.item(), rel=1e-5, abs=1e-6)
    theirs.backward()
    assert all(p.grad is not None for p in model[0].auto_model.encoder.layer[-1].parameters())


def test_twodmse_with_the_library_preset_is_the_librarys_matryoshka2dloss():
    """The wrapping path (compute_loss_from_embeddings, the unit vectors of a Normalize model, the feature KL):
    TwoDMSELoss(preset="st-matryoshka2d") over MultipleNegativesRankingLoss gives sentence-transformers'
    Matryoshka2dLoss step for step, its draws taken from random.Random(seed) in the library's order."""
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    model.eval()  # no dropout: the two losses must see the same vectors
    columns = [
        ["a man plays a guitar", "the cat sleeps", "rain falls today"],
        ["a person plays music", "a cat naps", "it rains"],
        ["a dog runs", "stocks fell", "a sunny day"],
    ]
    features = [model.tokenize(column) for column in columns]
    library = Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), sorted(nested_dims(384), reverse=True))
    ours = TwoDMSELoss(model, MultipleNegativesRankingLoss(model), preset="st-matryoshka2d", seed=42)
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    random.seed(42)
    theirs = [library(features, None).item() for _ in range(4)]
    mine = [ours(features, None).item() for _ in range(4)]
    assert len(set(np.round(theirs, 4))) > 1  # the draws changed the cells from step to step
    assert mine == pytest.approx(theirs, rel=1e-5)


def test_a_wrapped_loss_without_embeddings_entry_goes_through_the_forward(st_model_dir):
    """A loss that only knows `forward(features, labels)` sees each view through the model's forward."""

    class Forwarded(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.widths = model, []

        def forward(self, sentence_features, labels):
            anchors, positives = (self.model(f)["sentence_embedding"] for f in sentence_features)
            self.widths.append(anchors.shape[-1])
            return (1 - torch.nn.functional.cosine_similarity(anchors, positives)).mean()

    model = st_model(st_model_dir)
    inner = Forwarded(model)
    loss = StarbucksLoss(model, inner, sizes=[(1, 8), (2, 16), (4, 32)])
    features = [model.tokenize(["red cat", "blue dog"]), model.tokenize(["red cat runs", "blue dog eats"])]
    value = loss(features, None)
    assert inner.widths == [8, 16, 32] and torch.isfinite(value)
    assert model(features[0])["sentence_embedding"].shape[-1] == 32  # the forward is the model's again


def test_a_model_trained_in_sentence_transformers_trainer_is_a_folder_our_commands_take(
    st_model_dir, tmp_path, monkeypatch
):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from helpers.data import data_root

    model = st_model(st_model_dir)
    rows = {
        "anchor": ["red cat runs", "blue dog eats", "big bird sleeps", "old fish swims"] * 2,
        "positive": ["red cat", "blue dog", "big bird", "old fish"] * 2,
        "negative": ["sad dog jumps", "happy cat", "small fish", "new bird runs"] * 2,
    }
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "checkpoints"), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
        save_strategy="no", report_to="none", use_cpu=True, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    loss = ESELoss(model, TaskLoss(model, "angle"), k=16)
    SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_dict(rows), loss=loss).train()
    assert loss.steps == 2
    folder = tmp_path / "st-ese"
    model.save(str(folder))
    data = data_root(tmp_path / "data")
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    sts = ["eval", "sts", "--model", str(folder), "--data-dir", str(data), "--datasets", "stsb", "--quiet"]
    assert main([*sts, "--output", str(tmp_path / "sts")]) == 0
    assert main(["pick", "--results", str(tmp_path / "sts"), "--output", str(tmp_path / "pick")]) == 0
    cell = ["export", "--model", str(folder), "--layer", "2", "--dim", "16", "--output", str(tmp_path / "cell")]
    assert main(cell) == 0
    exported = SentenceTransformer(str(tmp_path / "cell"), device="cpu")
    assert exported.encode(["red cat"]).shape == (1, 16)

    from fastapi.testclient import TestClient

    from helpers.server import app_of
    from matryoshka2d.models.encoder import ElasticEncoder

    served = ElasticEncoder(str(folder), device="cpu")
    with TestClient(app_of(served, "st-ese")) as client:
        body = {"model": "st-ese", "input": ["red cat"], "layer": 2, "dimensions": 16}
        reply = client.post("/v1/embeddings", json=body)
    assert reply.status_code == 200
    got = np.array(reply.json()["data"][0]["embedding"], dtype=np.float32)
    np.testing.assert_allclose(got, exported.encode(["red cat"], normalize_embeddings=True)[0], atol=1e-5)


def test_the_defaults_are_train_methods_and_a_preset_gives_its_options(st_model_dir):
    from matryoshka2d.methods import make_method
    from matryoshka2d.training import presets

    model = st_model(st_model_dir)
    for name, cls in LOSSES.items():
        narrow = {"k": 16} if name == "ese" else {}  # ESE's default k fits the model: tested on its own below
        assert cls(model, **narrow).method.config() == make_method(name, 4, 32, **narrow).config()
        assert isinstance(cls(model, **narrow).loss, TaskLoss) and cls(model, **narrow).loss.name == "angle"
    authors = ESELoss(model, preset="ese-angle-emb", k=16)
    expected = {**presets.load("ese-angle-emb")["method_options"], "k": 16}
    assert {key: authors.method.config()[key] for key in ("layers", "pca", "pca_sign", "k")} == {
        "layers": expected["layers"], "pca": expected["pca"], "pca_sign": expected["pca_sign"], "k": 16
    }  # fmt: skip
    assert authors.get_config_dict()["preset"] == "ese-angle-emb"
    assert "ESE: Espresso" in authors.citation


def test_twodmse_draws_step_by_step_and_evaluation_leaves_the_count(st_model_dir):
    model = st_model(st_model_dir)
    loss = TwoDMSELoss(model, seed=7)
    features = [model.tokenize(["red cat", "blue dog"]) for _ in range(3)]
    model.train()
    loss(features, None)
    with torch.no_grad():
        loss(features, None)
    assert loss.steps == 1
    expected = loss.method.plan(loss.method.generator(7, 1)).info
    drawn = []
    original = loss.method.plan
    loss.method.plan = lambda rng: drawn.append(original(rng)) or drawn[-1]
    loss(features, None)
    assert drawn[0].info == expected and loss.steps == 2


def test_our_softmax_loss_has_its_classifiers_before_the_optimizer_is_built(st_model_dir):
    model = st_model(st_model_dir)
    loss = TwoDMSELoss(model, TaskLoss(model, "softmax"))
    widths = {int(w) for w in loss.loss.objective.heads}
    assert widths == {*loss.method.dims, 32}
    assert any(name.startswith("loss.objective.heads") for name, _ in loss.named_parameters())


def test_batch_kinds_follow_the_columns_and_labels():
    assert batch_kind(3, None) == "triplets" and batch_kind(2, torch.tensor([])) == "pairs"
    assert batch_kind(2, torch.tensor([0.5, 1.0])) == "scored" and batch_kind(2, torch.tensor([0, 2])) == "nli"
    with pytest.raises(ValueError, match="4 columns without labels"):
        batch_kind(4, None)
    with pytest.raises(ValueError, match="3 columns with labels"):
        batch_kind(3, torch.tensor([1.0]))


def test_errors_name_what_was_wrong(st_model_dir):
    model = st_model(st_model_dir)
    with pytest.raises(ValueError, match="preset 'starbucks-paper' trains method 'starbucks', not 'ese'"):
        ESELoss(model, preset="starbucks-paper")
    with pytest.raises(ValueError, match="gradient caching"):
        ESELoss(model, CachedMultipleNegativesRankingLoss(model))
    with pytest.raises(ValueError, match="unknown loss 'anglee'"):
        TaskLoss(model, "anglee")
    with pytest.raises(ValueError, match="kind must be one of"):
        TaskLoss(model, kind="quadruplets")
    with pytest.raises(ValueError, match=r"starbucks size \(3,8\) is narrower"):
        StarbucksLoss(model, CoSENTLoss(model), sizes=[(2, 16), (3, 8)])
    from sentence_transformers.base.modules import Normalize

    normalize_first = SentenceTransformer(modules=[Normalize()], device="cpu")
    with pytest.raises(ValueError, match="first module is Normalize, not a Transformer"):
        TwoDMSELoss(normalize_first)


@pytest.mark.parametrize("method", ["starbucks", "2dmse"])
def test_exit_heads_train_along_as_in_our_trainer_and_save_into_a_model_folder(
    method, st_model_dir, triplets, sts_dev, tmp_path
):
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.st_losses import exit_heads_for, save_with_exit_heads

    config = tiny_run(st_model_dir, triplets, sts_dev, tmp_path / "run", method=method, exit_heads="identity")
    trainer = Trainer(config)
    with torch.no_grad():  # heads away from the identity, the same in both
        for n, head in trainer.encoder.exit_heads.heads.items():
            head.linear.weight.add_(0.01 * int(n))
    ours, _ = trainer.compute_loss(0)
    columns, _ = trainer.data.rows(trainer.batch_indices(0))

    model = st_model(st_model_dir)
    heads = exit_heads_for(model)
    heads.load_state_dict(trainer.encoder.exit_heads.state_dict())
    loss = LOSSES[method](model, TaskLoss(model, "angle"), seed=config.seed, exit_heads=heads)
    theirs = loss([model.tokenize(column) for column in columns], None)
    assert theirs.item() == pytest.approx(ours.item(), rel=1e-5, abs=1e-6)
    assert any(name.startswith("exit_heads.") for name, _ in loss.named_parameters())  # the trainer trains them
    theirs.backward()
    assert any(h.linear.weight.grad is not None and h.linear.weight.grad.abs().sum() > 0 for h in heads.heads.values())

    folder = save_with_exit_heads(model, heads, tmp_path / "with-heads")
    loaded = ElasticEncoder(str(folder), device="cpu")
    assert loaded.exit_heads.layers == [1, 2, 3]
    assert torch.equal(loaded.exit_heads.heads["2"].linear.weight, heads.heads["2"].linear.weight)
    with pytest.raises(FileExistsError, match="with-heads exists"):
        save_with_exit_heads(model, heads, folder)
    with pytest.raises(ValueError, match=r"exit heads at layers \[4\]"):
        StarbucksLoss(model, exit_heads=type(heads).identity([4], 32, 32))


# ---- documented where Python looks; errors that name the loss -------------------------------------------------


@pytest.mark.parametrize("cls", [ESELoss, StarbucksLoss, TwoDMSELoss, TaskLoss])
def test_each_loss_documents_itself_as_sentence_transformers_losses_do(cls):
    """The class docstring (what help() and the API pages show): its arguments, inputs, an example, references."""
    doc = inspect.getdoc(cls)
    for section in ("Args:", "Inputs:", "Example:", "References:"):
        assert section in doc, f"{cls.__name__}: no {section}"
    documented = set(re.findall(r"^    \*{0,2}(\w+):", doc, re.M))  # the Args entries
    assert set(inspect.signature(cls).parameters) <= documented


@pytest.mark.parametrize("name", ["ese", "starbucks", "2dmse"])
def test_a_losss_signature_shows_the_methods_options_with_train_methods_defaults(name):
    """Explicit keyword arguments, each with `matryoshka2d train --method`'s default (ESE's k follows the model)."""
    ours = inspect.signature(LOSSES[name]).parameters
    method = inspect.signature(METHODS[name]).parameters
    options = {key for key in method if key not in ("num_layers", "hidden_size")}
    assert options <= set(ours) and not any(p.kind is p.VAR_KEYWORD for p in ours.values())
    defaults = {key: ours[key].default for key in options}
    if name == "ese":
        assert defaults.pop("k") is None and method["k"].default == 128
    assert defaults == {key: method[key].default for key in defaults}


def test_a_misspelt_argument_and_a_bad_value_name_the_loss(st_model_dir):
    model = st_model(st_model_dir)
    with pytest.raises(TypeError, match=r"ESELoss\.__init__\(\) got an unexpected keyword argument 'kk'"):
        ESELoss(model, kk=3)
    with pytest.raises(ValueError, match=r"^ESELoss: compression size k=64 must be within 1\.\.32$"):
        ESELoss(model, k=64)
    with pytest.raises(ValueError, match=r"^TwoDMSELoss: kl_widths must be one of both, full, got 'half'$"):
        TwoDMSELoss(model, kl_widths="half")
    with pytest.raises(TypeError, match=r"TaskLoss\('cosent'\): unknown option 'scal'; cosent takes scale"):
        TaskLoss(model, "cosent", scal=20.0)
    with pytest.raises(ValueError, match=r"^StarbucksLoss: unknown preset 'starbucks'; choose one of"):
        StarbucksLoss(model, preset="starbucks")
    with pytest.raises(TypeError, match=r"^ESELoss: loss must be a loss module, .* got str 'angle'"):
        ESELoss(model, "angle")


def test_eses_default_width_fits_the_model(st_model_dir):
    """k = 128 (the paper's) where the model is that wide; the model's own width where it is narrower."""
    from matryoshka2d.st_losses.ese import PAPER_K

    assert PAPER_K == 128
    assert ESELoss(st_model(st_model_dir)).method.k == 32  # the tiny model: 32 numbers


def test_a_preset_fills_the_arguments_not_given_and_never_one_given(st_model_dir):
    model = st_model(st_model_dir)
    paper = ESELoss(model, preset="ese-paper", k=16).method
    assert (paper.full_loss, paper.beta, paper.compress_target) == (False, 1.0, "dependency")  # the preset's
    given = ESELoss(model, preset="ese-paper", k=16, full_loss=True, beta=0.0).method  # the defaults' values, given
    assert (given.full_loss, given.beta, given.compress_target) == (True, 0.0, "dependency")


@pytest.mark.parametrize("inner", ["matryoshka", "matryoshka2d", "ours"])
def test_a_loss_that_picks_widths_or_layers_itself_is_refused_as_the_wrapped_loss(inner, st_model_dir):
    model = st_model(st_model_dir)
    wrapped = {
        "matryoshka": lambda: MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [32, 16]),
        "matryoshka2d": lambda: Matryoshka2dLoss(model, MultipleNegativesRankingLoss(model), [32, 16]),
        "ours": lambda: StarbucksLoss(model, MultipleNegativesRankingLoss(model)),
    }[inner]()
    said = rf"ESELoss picks the layer and width of each view itself; {type(wrapped).__name__} picks widths or layers"
    with pytest.raises(
        ValueError, match=said + r" too .* e\.g\. ESELoss\(model, MultipleNegativesRankingLoss\(model\)\)"
    ):
        ESELoss(model, wrapped)


@pytest.mark.parametrize("cls", [ESELoss, TaskLoss])
def test_an_empty_batch_is_named(cls, st_model_dir):
    model = st_model(st_model_dir)
    loss = cls(model)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: a batch without text columns"):
        loss([], None)
    empty = model.tokenize([])
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: an empty batch \(column 1 holds no texts\)"):
        loss([empty, empty, empty], None)


# ---- the guide's data: the rows `train` reads ------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "train-with-sentence-transformers.md"
GUIDE_DATA = "../shared/data/nli/train_triplets.tsv"


def guide_triplets(path: Path):
    """The guide's runnable snippet up to its dataset: its st_losses import and its `triplets = ...` line, run on
    `path` in place of the shared triplets."""
    block = re.search(r"<!-- runnable python -->\n```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)[1]
    lines = [line for line in block.splitlines() if line.startswith(("from matryoshka2d.st_losses", "triplets ="))]
    assert len(lines) == 2 and GUIDE_DATA in lines[1], lines
    scope = {}
    exec("\n".join(lines).replace(GUIDE_DATA, str(path)), scope)
    return scope["triplets"]


def test_the_guides_dataset_reads_quotes_as_train_does(tmp_path):
    """train reads with no quoting: a field that starts with a quote keeps it (pandas' csv reading drops it)."""
    path = tmp_path / "triplets.tsv"
    path.write_text(
        'anchor\tpositive\tnegative\n"Quoted" start\tplain\ta "lone quote\nplain\t"two\t"fields"\n', encoding="utf-8"
    )
    triplets = guide_triplets(path)
    assert triplets.column_names == ["anchor", "positive", "negative"]
    assert [triplets[c] for c in triplets.column_names] == read_training_data([str(path)]).columns
    assert triplets[0]["anchor"] == '"Quoted" start' and triplets[1]["positive"] == '"two'


def test_the_guides_batches_are_trains_on_the_shared_triplets(st_model_dir, sts_dev, tmp_path):
    """On the real file: the same number of rows, every row the same, so the batches of the same indices are."""
    path = data_dir() / "nli" / "train_triplets.tsv"
    if not path.is_file():
        pytest.skip(f"{path}: the shared NLI triplets are not on this machine")
    triplets = guide_triplets(path)
    trainer = Trainer(tiny_run(st_model_dir, path, sts_dev, tmp_path / "run", batch_size=32))
    assert len(triplets) == len(trainer.data)
    assert [triplets[c] for c in ("anchor", "positive", "negative")] == trainer.data.columns
    for step in (0, 1):
        indices = trainer.batch_indices(step)
        columns, _ = trainer.data.rows(indices)
        batch = triplets.select(indices)
        assert [batch[c] for c in ("anchor", "positive", "negative")] == columns
