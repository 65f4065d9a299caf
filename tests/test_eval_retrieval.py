"""Retrieval: toy corpora with known rankings, metric arithmetic, BEIR reading and its errors."""

import json
import math

import numpy as np
import pytest

from helpers.data import beir
from helpers.models import tiny_transformer
from matryoshka2d.beir import load_beir
from matryoshka2d.cli import main
from matryoshka2d.evaluate.retrieval import evaluate_retrieval, rank_metrics, search
from matryoshka2d.files import DataFormatError


class KeywordEmbedder:
    """A CellEmbedder: one axis per keyword; a text's vector counts the keywords it contains."""

    KEYWORDS = ("apple", "river", "stone", "cloud")

    def __init__(self):
        self.seen = []

    def cells(self):
        return [(1, 4)]

    def embed(self, texts):
        self.seen += list(texts)
        x = np.array([[t.lower().count(k) for k in self.KEYWORDS] for t in texts], dtype=np.float32)
        return {(1, 4): x + 0.01}  # the offset keeps keyword-free texts off the zero vector

    def info(self):
        return {"model": "keywords", "layers": 1, "hidden_size": 4}


CORPUS = [
    {"_id": "d1", "title": "Apple", "text": "an apple a day"},
    {"_id": "d2", "title": "", "text": "the river runs"},
    {"_id": "d3", "title": "Stone", "text": "a stone wall"},
]


def test_right_document_first_gives_perfect_scores(tmp_path):
    queries = [{"_id": "q1", "text": "apple pie"}, {"_id": "q2", "text": "river bank"}, {"_id": "q3", "text": "x"}]
    root = beir(tmp_path / "toy", CORPUS, queries, [("q1", "d1", 1), ("q2", "d2", 1), ("q3", "d3", 0)], gz=True)
    embedder = KeywordEmbedder()
    result = evaluate_retrieval(embedder, [root], split="test", log=lambda m: None)
    (row,) = result.scores
    assert row["ndcg@10"] == pytest.approx(100) and row["mrr@10"] == 100 and row["recall@100"] == 100
    assert result.settings["datasets"]["toy"]["queries"] == 2  # q3 has no relevant document: not evaluated
    assert "Apple an apple a day" in embedder.seen and "the river runs" in embedder.seen  # title + " " + text


def test_second_rank_and_graded_relevance_by_hand(tmp_path):
    # q1 mentions apple twice and stone once: d1 first, d3 second. Only d3 is relevant -> nDCG 1/log2(3), MRR 1/2.
    queries = [{"_id": "q1", "text": "apple apple stone"}]
    root = beir(tmp_path / "toy", CORPUS, queries, [("q1", "d3", 1)])
    row = evaluate_retrieval(KeywordEmbedder(), [root], log=lambda m: None).scores[0]
    assert row["ndcg@10"] == pytest.approx(100 / math.log2(3))
    assert row["mrr@10"] == pytest.approx(50) and row["recall@100"] == 100
    # Graded: ranking [a, b, c] with gains 1, 0, 2; ideal order 2, 1.
    metrics = rank_metrics(np.array([[0, 1, 2]]), [{0: 1, 2: 2}])
    dcg, ideal = 1 + 2 / math.log2(4), 2 + 1 / math.log2(3)
    assert metrics["ndcg@10"] == pytest.approx(100 * dcg / ideal)
    assert metrics["mrr@10"] == 100 and metrics["recall@100"] == 100
    assert rank_metrics(np.array([[1, -1, -1]]), [{0: 1}]) == {"ndcg@10": 0.0, "mrr@10": 0.0, "recall@100": 0.0}


def test_search_orders_breaks_ties_and_excludes_identical_ids():
    docs = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.6, 0.8]], dtype=np.float32)
    queries = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    np.testing.assert_array_equal(search(queries, docs, 3), [[0, 2, 3], [1, 3, 0]])
    np.testing.assert_array_equal(search(queries, docs, 10, exclude=np.array([0, -1])), [[2, 3, 1, -1], [1, 3, 0, 2]])
    np.testing.assert_array_equal(search(queries, docs, 2, chunk=1), [[0, 2], [1, 3]])


def test_query_with_its_own_id_in_the_corpus_does_not_find_itself(tmp_path):
    corpus = [*CORPUS, {"_id": "q1", "title": "", "text": "apple apple"}]
    root = beir(tmp_path / "toy", corpus, [{"_id": "q1", "text": "apple apple"}], [("q1", "d1", 1)])
    row = evaluate_retrieval(KeywordEmbedder(), [root], log=lambda m: None).scores[0]
    assert row["mrr@10"] == 100


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda r: (r / "corpus.jsonl").write_text('{"_id": "d1", "text": "a"}\n{"_id": "d2", "text": \n'),
            r"corpus.jsonl line 2: not valid JSON",
        ),
        (lambda r: (r / "corpus.jsonl").write_text('{"text": "a"}\n'), r"corpus.jsonl line 1: no '_id' field"),
        (
            lambda r: (r / "corpus.jsonl").write_text('{"_id": 1, "text": "a"}\n{"_id": "1", "text": "b"}\n'),
            r"corpus.jsonl line 2: _id '1' already used on line 1",
        ),
        (lambda r: (r / "queries.jsonl").write_text('{"_id": "q1"}\n'), r"queries.jsonl line 1: no 'text' string"),
        (lambda r: (r / "queries.jsonl").write_text(""), r"queries.jsonl: empty file"),
        (
            lambda r: (r / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\thigh\n"),
            r"test.tsv line 2: score 'high' is not an integer",
        ),
        (
            lambda r: (r / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq9\td1\t1\n"),
            r"test.tsv line 3: query-id 'q9' is not in queries.jsonl",
        ),
        (
            lambda r: (r / "qrels" / "test.tsv").write_text("query-id\tdoc\tscore\nq1\td1\t1\n"),
            r"test.tsv line 1: no column 'corpus-id'",
        ),
        (
            lambda r: (r / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\n"),
            r"test.tsv line 2: 2 tab-separated columns",
        ),
        (
            lambda r: (r / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tzz\t1\n"),
            r"test.tsv: no query has a relevant document",
        ),
        (lambda r: (r / "corpus.jsonl").unlink(), r"no corpus.jsonl or corpus.jsonl.gz"),
    ],
)
def test_malformed_beir_folders(tmp_path, mutate, message):
    root = beir(tmp_path / "toy", CORPUS, [{"_id": "q1", "text": "apple"}], [("q1", "d1", 1)])
    mutate(root)
    with pytest.raises(DataFormatError, match=message):
        load_beir(root, "test")


def test_missing_split_lists_available_ones(tmp_path):
    root = beir(tmp_path / "toy", CORPUS, [{"_id": "q1", "text": "apple"}], [("q1", "d1", 1)], split="train")
    with pytest.raises(DataFormatError, match=r"qrels/test.tsv: file not found \(splits here: train; see --split\)"):
        load_beir(root, "test")


def test_unknown_corpus_ids_are_counted_not_fatal(tmp_path):
    root = beir(tmp_path / "toy", CORPUS, [{"_id": "q1", "text": "apple"}], [("q1", "d1", 1), ("q1", "gone", 1)])
    assert load_beir(root, "test").unknown_docs == 1


def test_cli_on_tiny_model_picks_the_only_split(tmp_path, tokenizer, capsys):
    model_dir = tmp_path / "model"
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    queries = [{"_id": "q1", "text": "apple pie"}, {"_id": "q2", "text": "river bank"}]
    root = beir(tmp_path / "toy", CORPUS, queries, [("q1", "d1", 1), ("q2", "d2", 2)], split="train")
    out = tmp_path / "out"
    args = ["eval", "retrieval", "--model", str(model_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    assert main([*args, "--layers", "2", "4", "--dims", "16", "32", "--output", str(out), "--quiet"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["settings"]["split"] == "train" and len(result["scores"]) == 4
    assert all(0 < r["ndcg@10"] <= 100 and r["recall@100"] == 100 for r in result["scores"])  # 3 docs: all found
    assert "| layer \\ dim | 16 | 32 |" in (out / "results.md").read_text()
    assert main([*args, "--split", "dev", "--output", str(out)]) == 2
    assert "qrels/dev.tsv: file not found" in capsys.readouterr().err
