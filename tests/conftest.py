"""Shared fixtures: tiny random models built in code, so tests run offline and fast. What they are built from
(the tiny models, the data builders) lives in the package tests/helpers/, which test modules import too."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core (pyproject.toml's addopts): a worker that also spread torch over every
    # core would oversubscribe them. Set before torch is imported, so the `serve`, `train` and Ray processes that the
    # tests start inherit it too.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch

from helpers.data import WORDS, write_triplets
from helpers.models import TINY, tiny_transformer
from helpers.suite import HEAVY_FIRST
from matryoshka2d.models.backbones import minilm_dir
from matryoshka2d.models.encoder import ElasticEncoder


def pytest_collection_modifyitems(config, items):
    """Move the files of HEAVY_FIRST (helpers/suite.py) to the front, in its order, so that `--dist loadfile` starts
    them first; every other file keeps its place after them, and every test its place in its file (a stable sort)."""
    rank = {name: place for place, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_dir()))


@pytest.fixture(scope="session")
def tiny_bert(tokenizer):
    return ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", name="tiny-bert"
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random BERT saved as a plain Hugging Face folder (no sentence-transformers config)."""
    path = tmp_path_factory.mktemp("tiny-bert")
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def no_dropout_dir(tmp_path_factory, tokenizer):
    """A tiny random BERT without dropout, as a folder: runs that see the same rows compute the same numbers."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **TINY
    )
    path = tmp_path_factory.mktemp("tiny-no-dropout")
    tf.AutoModel.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def minilm():
    return ElasticEncoder("minilm-l6", device="cpu")


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on busy cores torch's thread pool makes them much slower
    (a module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """Tiny training data in one folder, drawn from WORDS: triplets.tsv (24 rows), nli.tsv (12 labelled pairs),
    corpus.txt (64 sentences of 3 to 7 words) and dev.tsv (an STS file of 5 scored pairs)."""
    root = tmp_path_factory.mktemp("tiny-data")
    write_triplets(root / "triplets.tsv", 24)
    rng = np.random.default_rng(1)
    nli = ["premise\thypothesis\tlabel"] + [
        f"{' '.join(rng.choice(WORDS, 4))}\t{' '.join(rng.choice(WORDS, 3))}\t{label}"
        for label in ["entailment", "neutral", "contradiction"] * 4
    ]
    (root / "nli.tsv").write_text("\n".join(nli) + "\n")
    sentences = (" ".join(rng.choice(WORDS, rng.integers(3, 8))) for _ in range(64))
    (root / "corpus.txt").write_text("\n".join(sentences) + "\n")
    dev = ["sentence1\tsentence2\tscore", "red cat\tred cat\t5", "red cat\tblue dog\t1", "big bird\tbig bird runs\t4"]
    (root / "dev.tsv").write_text("\n".join([*dev, "old dog\thappy cat\t0", "sad bird\tsad bird\t5"]) + "\n")
    return root


@pytest.fixture(scope="session")
def triplets(files):
    return files / "triplets.tsv"


@pytest.fixture(scope="session")
def sts_dev(files):
    return files / "dev.tsv"


@pytest.fixture(scope="session")
def corpus(files):
    return files / "corpus.txt"


@pytest.fixture(scope="module")
def text_file(tokenizer, tmp_path_factory):
    """160 distinct short 'sentences' of real word pieces (more than a tiny head's 33 inputs)."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:400]
    rng = np.random.default_rng(3)
    texts = list(dict.fromkeys(" ".join(rng.choice(words, rng.integers(3, 9))) for _ in range(180)))[:160]
    path = tmp_path_factory.mktemp("distill-text") / "sentences.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def teacher_dir(tokenizer, tmp_path_factory):
    """A tiny random BERT without dropout whose layers differ (weights ~ N(0, 0.2): at BERT's 0.02 every layer of a
    random model pools to nearly the same vector, and there would be nothing to distill)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.2,
        **TINY,
    )
    path = tmp_path_factory.mktemp("distill-teacher")
    tf.AutoModel.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def model(tiny_dir, tmp_path):
    """A copy of the tiny model: a folder the commands under test must never change."""
    import shutil

    return shutil.copytree(tiny_dir, tmp_path / "model")


@pytest.fixture
def texts(tmp_path):
    """Three short lines in `in/texts.txt`, a file a command reads."""
    path = tmp_path / "in" / "texts.txt"
    path.parent.mkdir()
    path.write_text("red cat\nblue dog\nold fish swims\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def other_weights_dir(tiny_dir, tmp_path_factory):
    """tiny_dir's model with one weight changed: the same shape, other weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-other")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    tensors = load_file(str(path / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("encoder.layer.0.attention.self.query.weight"))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def heads_folder(tokenizer, tmp_path_factory):
    """A tiny model with closed-form exit heads, saved; tests copy it (`planted`) before they plant anything."""
    from matryoshka2d.models.heads_fit import fit_heads

    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:300]
    rng = np.random.default_rng(5)
    texts = list(dict.fromkeys(" ".join(rng.choice(words, rng.integers(3, 8))) for _ in range(120)))
    encoder = ElasticEncoder.from_modules(
        tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean", device="cpu"
    )
    heads, _ = fit_heads(encoder, [texts])
    encoder.set_exit_heads(heads)
    return encoder.save(tmp_path_factory.mktemp("with-heads"))


@pytest.fixture
def planted(heads_folder, tmp_path):
    """A copy of heads_folder that a test may tamper with."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(heads_folder, folder)
    return folder


@pytest.fixture
def quick_timing(tmp_path, monkeypatch):
    """pick's timings from a fixed table (ms = the layer), in a cache of the test's own: for tests of where pick
    writes and what it reads, not of how it measures (test_pick measures for real)."""
    from matryoshka2d.pick import cost

    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost, "measure_latency", lambda backend, layers, repeats=3: {n: float(n) for n in layers})
