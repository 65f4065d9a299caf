"""`eval retrieval --cascade / --query-layer`: flat full-cell search next to the cascade and shallow queries."""

import json

from helpers.cli import error_line
from helpers.data import LETTER_CORPUS, beir
from matryoshka2d.cli import main


def test_cascade_and_query_layer_rows(tiny_dir, tmp_path, capsys):
    queries = [{"_id": f"q{i}", "text": f"about {w}"} for i, w in enumerate("abcdefghijkl")]
    root = beir(tmp_path / "toy", LETTER_CORPUS, queries, [(f"q{i}", f"d{i}", 1) for i in range(12)], split="train")
    out = tmp_path / "out"
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    code = main([*args, "--cascade", "1:8,4:32", "--shortlist", "16", "--query-layer", "2", "--output", str(out)])
    assert code == 0
    result = json.loads((out / "cascade.json").read_text())
    modes = [r["mode"] for r in result["rows"]]
    assert modes == [
        "flat (4,32)",
        "cascade (1,8) top 16 -> (4,32)",
        "queries at layer 2 -> docs (4,32)",
        "flat (2,32) (queries and docs at layer 2)",
    ]
    flat, cascade = result["rows"][:2]
    # q0's id is not a document id here, so nothing is excluded; a shortlist of the whole corpus equals flat
    assert cascade["overlap@10_with_flat"] == 100 and cascade["ndcg@10"] == flat["ndcg@10"]
    assert all(r["query_encode_ms"] > 0 and r["search_ms"] > 0 for r in result["rows"])
    assert "| toy | cascade (1,8) top 16 -> (4,32) |" in (out / "cascade.md").read_text()
    assert "nDCG@10" in capsys.readouterr().out


def test_cascade_errors(tiny_dir, tmp_path, capsys):
    root = beir(tmp_path / "toy", LETTER_CORPUS, [{"_id": "q1", "text": "a"}], [("q1", "d1", 1)])
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    assert main([*args, "--cascade", "1:8,9:32", "--output", str(tmp_path / "o")]) == 2
    assert "layer 9 is out of range" in capsys.readouterr().err
    assert main([*args, "--cascade", "1:8,4:32", "--shortlist", "5", "--output", str(tmp_path / "o")]) == 2
    assert "--shortlist 5 is below the 10" in capsys.readouterr().err


def test_several_query_layers_give_their_rows_from_one_document_pass(tiny_dir, tmp_path):
    queries = [{"_id": f"q{i}", "text": f"about {w}"} for i, w in enumerate("abcdefghijkl")]
    root = beir(tmp_path / "toy", LETTER_CORPUS, queries, [(f"q{i}", f"d{i}", 1) for i in range(12)], split="train")
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    assert main([*args, "--query-layer", "3,1", "--output", str(tmp_path / "both")]) == 0
    both = json.loads((tmp_path / "both" / "cascade.json").read_text())
    assert both["query_layers"] == [1, 3]
    assert [r["mode"] for r in both["rows"]] == [
        "flat (4,32)",
        "queries at layer 1 -> docs (4,32)",
        "flat (1,32) (queries and docs at layer 1)",
        "queries at layer 3 -> docs (4,32)",
        "flat (3,32) (queries and docs at layer 3)",
    ]
    assert main([*args, "--query-layer", "3", "--output", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "cascade.json").read_text())
    assert [r["ndcg@10"] for r in one["rows"]] == [both["rows"][i]["ndcg@10"] for i in (0, 3, 4)]


def test_query_layer_out_of_range_is_refused(tiny_dir, tmp_path, capsys):
    root = beir(tmp_path / "toy", LETTER_CORPUS, [{"_id": "q1", "text": "a"}], [("q1", "d1", 1)])
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    assert main([*args, "--query-layer", "1,7", "--output", str(tmp_path / "o")]) == 2
    assert "layer 7 is out of range" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_eval_retrieval_reads_corpus_queries_and_qrels_files_wherever_they_are(tiny_dir, tmp_path, capsys):
    """Issue 32, case 17: three files instead of one BEIR folder; the same numbers as the folder gives."""
    queries = [{"_id": f"q{i}", "text": f"about {w}"} for i, w in enumerate("abcdefghijkl")]
    root = beir(tmp_path / "toy", LETTER_CORPUS, queries, [(f"q{i}", f"d{i}", 1) for i in range(12)], split="train")
    (tmp_path / "apart").mkdir()
    qrels = tmp_path / "apart" / "judged.tsv"
    qrels.write_text((root / "qrels" / "train.tsv").read_text())
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--pooling", "mean", "--layers", "4", "--dims", "32"]
    assert main([*args, "--dataset-dir", str(root), "--output", str(tmp_path / "a")]) == 0
    files = ["--corpus", str(root / "corpus.jsonl"), "--queries", str(root / "queries.jsonl"), "--qrels", str(qrels)]
    assert main([*args, *files, "--output", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / x / "results.json").read_text()) for x in "ab")
    assert a["average"] == b["average"] and b["settings"]["split"] == "judged"
    assert main([*args, *files[:4], "--output", str(tmp_path / "c")]) == 2
    assert "--qrels missing" in capsys.readouterr().err


def test_eval_retrieval_refuses_a_query_layer_deeper_than_the_documents(tiny_dir, tmp_path, capsys):
    from helpers.data import beir

    corpus = [{"_id": f"d{i}", "title": "", "text": f"text {i} about {w}"} for i, w in enumerate("abcdefghijklmnop")]
    root = beir(tmp_path / "toy", corpus, [{"_id": "q1", "text": "a"}], [("q1", "d1", 1)])
    args = ["eval", "retrieval", "--model", str(tiny_dir), "--pooling", "mean", "--dataset-dir", str(root)]
    assert main([*args, "--cascade", "1:8,3:32", "--query-layer", "4", "--output", str(tmp_path / "o")]) == 2
    error_line(capsys, "--query-layer 4 is deeper than the documents of the full cell 3:32")
    assert not (tmp_path / "o").exists()
