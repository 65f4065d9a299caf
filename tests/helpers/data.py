"""Tiny data sets written by the tests: triplets, STS files, BEIR folders, corpora and result files, all small enough
to encode in a blink on a tiny model."""

import gzip
import json

import numpy as np

from matryoshka2d.evaluate.sts import STS_SETS

# The vocabulary of the tiny data sets: one word-piece each in the MiniLM tokenizer, but "swims" (swim ##s).
WORDS = ["red", "green", "blue", "cat", "dog", "bird", "runs", "sleeps", "eats", "big", "small", "old", "new", "happy"]
WORDS += ["sad", "fish", "swims", "jumps"]

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an instrument on a stage in front of a very large and enthusiastic crowd.",
    "The market fell.",
    "",
    "A man is playing a guitar.",
    "Cats sleep most of the day, waking up only to eat and to look out of the window.",
    "Rain.",
]


def write_triplets(path, rows: int, seed: int = 0):
    """anchor, positive, negative rows of WORDS: the positive shares the anchor's first three words."""
    rng = np.random.default_rng(seed)
    lines = ["anchor\tpositive\tnegative"]
    for _ in range(rows):
        a = rng.choice(WORDS, 4)
        lines.append(f"{' '.join(a)}\t{' '.join(a[:3])} {rng.choice(WORDS)}\t{' '.join(rng.choice(WORDS, 4))}")
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- STS test sets ------------------------------------------------------------------------------------------------


def write_tsv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join("\t".join(map(str, r)) for r in [header, *rows]) + "\n", encoding="utf-8")
    return path


PAIRS = [
    ("A man plays a guitar.", "A man is playing guitar."),
    ("A dog runs in the park.", "The stock market fell sharply."),
    ("Two kids ride bikes.", "Children are cycling."),
    ("She is cooking pasta.", "A woman cooks noodles."),
    ("The train was late.", "It rained all day in the city."),
    ("A cat sleeps on a sofa.", "A kitten naps on the couch."),
]
GOLD = [4.8, 0.2, 3.9, 3.5, 1.0, 4.6]


def sts_tree(root, variant="raw", names=STS_SETS):
    """A data folder whose STS test sets (`names`) hold PAIRS scored GOLD, every other set rotated by one pair."""
    for i, name in enumerate(names):
        rows = [(a, b, g) for (a, b), g in zip(PAIRS[i % 2 :] + PAIRS[: i % 2], GOLD, strict=True)]
        write_tsv(
            root / "sts" / variant / f"{name}_test.tsv",
            ["sentence1", "sentence2", "score", "subset"],
            [(*r, "x") for r in rows],
        )
    return root


def write_sts(root, sentences: dict[str, list[tuple[str, str]]], variant="raw"):
    """A data folder whose STS test sets hold the given pairs (a set not given gets one pair of its own)."""
    for name in STS_SETS:
        pairs = sentences.get(name, [(f"{name} left", f"{name} right"), (f"{name} one", f"{name} two")])
        rows = [f"{a}\t{b}\t{i % 5}" for i, (a, b) in enumerate(pairs)]
        path = root / "sts" / variant / f"{name}_test.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("sentence1\tsentence2\tscore\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return root


# ---- retrieval: BEIR folders and corpora -----------------------------------------------------------------------


def beir(root, corpus, queries, qrels, split="test", gz=False):
    """A BEIR folder: corpus.jsonl (or .jsonl.gz), queries.jsonl and qrels/SPLIT.tsv of (query, document, score)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(json.dumps(d) for d in corpus) + "\n"
    if gz:
        with gzip.open(root / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        (root / "corpus.jsonl").write_text(lines, encoding="utf-8")
    (root / "queries.jsonl").write_text("\n".join(json.dumps(q) for q in queries) + "\n", encoding="utf-8")
    (root / "qrels").mkdir(exist_ok=True)
    rows = ["query-id\tcorpus-id\tscore", *("\t".join(map(str, r)) for r in qrels)]
    (root / "qrels" / f"{split}.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return root


# 16 documents, one per letter a..p ("text 3 about d"): queries "about d" find them.
LETTER_CORPUS = [{"_id": f"d{i}", "title": "", "text": f"text {i} about {w}"} for i, w in enumerate("abcdefghijklmnop")]

# 30 titled documents on ten topics, for the index builds.
DOCS = [
    {"_id": f"d{i}", "title": f"Title {i}", "text": f"document number {i} talks about {w}"}
    for i, w in enumerate(["cats", "dogs", "rain", "guitars", "banks", "snow", "bikes", "music", "code", "tea"] * 3)
]


# 60 documents without titles, six of each topic ("document number 3 talks about guitars").
UNTITLED_DOCS = [
    {"_id": f"d{i}", "text": f"document number {i} talks about {w}"}
    for i, w in enumerate(["cats", "dogs", "rain", "guitars", "banks", "snow", "bikes", "music", "code", "tea"] * 6)
]


def write_corpus(path, docs=DOCS, gz=False):
    """`docs` as a JSON-lines corpus (gzipped with `gz`)."""
    lines = "".join(json.dumps(d) + "\n" for d in docs)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def data_root(root):
    """A data folder laid out like the shared data (nli/, sts/raw/, retrieval/scifact/), tiny: what `demo` reads."""
    (root / "nli").mkdir(parents=True)
    rows = ["anchor\tpositive\tnegative"]
    for i in range(16):
        a = [WORDS[(i + k) % len(WORDS)] for k in range(4)]
        rows.append(f"{' '.join(a)}\t{' '.join(a[:3])}\t{' '.join(reversed(a))} {WORDS[i % 5]}")
    (root / "nli" / "train_triplets.tsv").write_text("\n".join(rows) + "\n")
    (root / "sts" / "raw").mkdir(parents=True)
    pairs = ["sentence1\tsentence2\tscore"]
    pairs += [f"{WORDS[i]} {WORDS[i + 1]}\t{WORDS[i]} {WORDS[(i * 3) % 15]}\t{i % 5}" for i in range(12)]
    for name in ("stsb_dev", "stsb_test", "sts12_test", "sts13_test", "sts14_test", "sts15_test", "sts16_test"):
        (root / "sts" / "raw" / f"{name}.tsv").write_text("\n".join(pairs) + "\n")
    leaked = f"{WORDS[0]} {WORDS[1]} {WORDS[2]}\t{WORDS[4]}\t1\n"  # the positive of the first training row
    (root / "sts" / "raw" / "sickr_test.tsv").write_text("\n".join(pairs) + "\n" + leaked)
    corpus = [{"_id": f"d{i}", "title": "", "text": f"{WORDS[i % 15]} {WORDS[(i * 7) % 15]} {i}"} for i in range(40)]
    queries = [{"_id": f"q{i}", "text": WORDS[i]} for i in range(6)]
    beir(root / "retrieval" / "scifact", corpus, queries, [(f"q{i}", f"d{i}", 1) for i in range(6)], split="train")
    return root


# ---- result files ------------------------------------------------------------------------------------------------


def result_file(path, model):
    """An STS results.json of cells (1|2|4, 8|32) of `model` whose scores grow with layer and dim, in folder `path`."""
    rows = [{"layer": n, "dim": d, "spearman": 40 + 5 * n + d / 8} for n in (1, 2, 4) for d in (8, 32)]
    result = {
        "task": "sts",
        "metric": "spearman",
        "metrics": ["spearman"],
        "datasets": ["stsb"],
        "layers": [1, 2, 4],
        "dims": [8, 32],
        "average": rows,
        "model": {"model": "tiny", "location": str(model), "layers": 4, "hidden_size": 32, "pooling": "mean"},
    }
    path.mkdir()
    (path / "results.json").write_text(json.dumps(result))
    return path


def grid(**changes):
    """A well-formed STS results record (datasets a and b, cells (1|2, 8|32)); `changes` replace its fields."""
    scores = [
        {"dataset": ds, "layer": n, "dim": d, "spearman": 40.0 + n + d / 8 + (1 if ds == "a" else -1)}
        for ds in ("a", "b")
        for n in (1, 2)
        for d in (8, 32)
    ]
    average = [{"layer": n, "dim": d, "spearman": 40.0 + n + d / 8} for n in (1, 2) for d in (8, 32)]
    model = {"model": "tiny", "layers": 2, "hidden_size": 32, "pooling": "mean"}
    record = {"task": "sts", "metric": "spearman", "metrics": ["spearman"], "datasets": ["a", "b"]}
    record.update(layers=[1, 2], dims=[8, 32], scores=scores, average=average, model=model)
    record.update(changes)
    return record


# ---- distill's teacher targets -----------------------------------------------------------------------------------


def write_targets(folder, vectors: np.ndarray) -> list[str]:
    """A teacher-targets folder in run folder `folder` holding `vectors` as float16 and a record that vouches for
    them (checksums re-signed, and signed under this machine's key, as only a hand holding that key could); the
    texts they are of ("t0", "t1", ...)."""
    from matryoshka2d.files import file_sha256
    from matryoshka2d.training.targets import FOLDER, RECORD, VECTORS, sign_record, texts_sha256

    (folder / FOLDER).mkdir(parents=True, exist_ok=True)
    (folder / FOLDER / VECTORS).write_bytes(vectors.astype(np.float16).tobytes())
    record = {
        "rows": len(vectors),
        "dim": vectors.shape[1],
        "sha256": file_sha256(folder / FOLDER / VECTORS),
        "texts_sha256": texts_sha256([f"t{i}" for i in range(len(vectors))]),
        "teacher_weights_sha256": "t" * 64,
    }
    (folder / FOLDER / RECORD).write_text(json.dumps(sign_record(record, folder / FOLDER / VECTORS)))
    return [f"t{i}" for i in range(len(vectors))]
