"""Shared fixtures: tiny random models built in code, so tests run offline and fast."""

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

from matryoshka2d.models.backbones import minilm_dir
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training.config import TrainConfig

TINY = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 64}

# The vocabulary of the tiny data sets: one word-piece each in the MiniLM tokenizer, but "swims" (swim ##s).
WORDS = ["red", "green", "blue", "cat", "dog", "bird", "runs", "sleeps", "eats", "big", "small", "old", "new", "happy"]
WORDS += ["sad", "fish", "swims", "jumps"]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_dir()))


def tiny_transformer(arch: str, vocab_size: int):
    """A randomly initialised 4-layer model of the given architecture (hidden 32)."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "bert":
        cfg = tf.BertConfig(vocab_size=vocab_size, **TINY)
    elif arch == "roberta":
        cfg = tf.RobertaConfig(vocab_size=vocab_size, pad_token_id=0, max_position_embeddings=130, **TINY)
    elif arch == "mpnet":
        cfg = tf.MPNetConfig(vocab_size=vocab_size, pad_token_id=0, max_position_embeddings=130, **TINY)
    elif arch == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=vocab_size, dim=32, n_layers=4, n_heads=4, hidden_dim=64)
    elif arch == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            pad_token_id=0,
        )
    else:
        raise ValueError(arch)
    return tf.AutoModel.from_config(cfg).eval()


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


SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument on a stage in front of a very large and enthusiastic crowd.",
    "The market fell.",
    "",
    "A man is playing a guitar.",
    "Cats sleep most of the day, waking up only to eat and to look out of the window.",
    "Rain.",
]


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on busy cores torch's thread pool makes them much slower
    (a module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_triplets(path, rows: int, seed: int = 0):
    """anchor, positive, negative rows of WORDS: the positive shares the anchor's first three words."""
    rng = np.random.default_rng(seed)
    lines = ["anchor\tpositive\tnegative"]
    for _ in range(rows):
        a = rng.choice(WORDS, 4)
        lines.append(f"{' '.join(a)}\t{' '.join(a[:3])} {rng.choice(WORDS)}\t{' '.join(rng.choice(WORDS, 4))}")
    path.write_text("\n".join(lines) + "\n")
    return path


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


def tiny_run(model_dir, data, eval_file, out, /, **changes) -> TrainConfig:
    """The options of a few steps on a tiny model: batch 8, lr 1e-3, no warm-up, no checkpoints; `changes`
    override any of them."""
    options = dict(
        model=str(model_dir),
        pooling="mean",
        data=[str(data)],
        output=str(out),
        batch_size=8,
        eval_file=str(eval_file),
        lr=1e-3,
        warmup_ratio=0.0,
        save_steps=0,
    )
    return TrainConfig(**{**options, **changes})


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
