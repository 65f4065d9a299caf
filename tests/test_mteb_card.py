"""A model card lists `eval mteb`'s results in the Hub's model-index (issue 54): `eval mteb --output MODEL/mteb`
refreshes MODEL's card, and a later save of the model keeps them; huggingface_hub reads them back."""

import json

import pytest
import yaml

from test_eval_retrieval import beir
from test_eval_sts import sts_tree
from test_rules_outputs_options_results import exit_code

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("mteb")


def front_matter(card) -> dict:
    text = card.read_text()
    assert text.startswith("---\n"), text[:80]
    return yaml.safe_load(text[4:].split("\n---", 1)[0])


def test_eval_mteb_inside_a_model_folder_puts_its_results_on_the_card(tiny_bert, tmp_path, monkeypatch):
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))
    model = tiny_bert.save(tmp_path / "model")
    assert "model-index" not in front_matter(model / "README.md")
    stsb = sts_tree(tmp_path / "data", names=["stsb"]) / "sts" / "raw" / "stsb_test.tsv"
    corpus = [{"_id": f"d{k}", "title": "", "text": f"text {k} about {c}"} for k, c in enumerate("abcdefgh")]
    queries = [{"_id": f"q{k}", "text": f"about {c}"} for k, c in enumerate("abcdef")]
    toy = beir(tmp_path / "data" / "toy", corpus, queries, [(f"q{k}", f"d{k}", 1) for k in range(6)])
    argv = ["eval", "mteb", "--model", model, "--cells", "2x16", "4x32", "--task-dir", stsb, toy, "--quiet"]
    assert exit_code([*argv, "--output", model / "mteb"]) == 0

    grid = json.loads((model / "mteb" / "results.json").read_text())
    want = {(r["dataset"], f"{r['layer']}x{r['dim']}"): r["main_score"] for r in grid["scores"]}
    card = ModelCard.load(model / "README.md")
    assert "## Picking a cell" in card.text  # the body of the card is kept
    name, results = model_index_to_eval_results(front_matter(model / "README.md")["model-index"])
    assert name == "model" and len(results) == len(want) == 4
    got = {}
    for result in results:
        task, cell = result.dataset_name.removeprefix("MTEB ").split(" (matryoshka2d cell ")
        got[(task, cell.rstrip(")"))] = result.metric_value
        assert result.dataset_config == f"default, matryoshka2d cell {cell.rstrip(')')}"  # cells stay apart on the Hub
        assert result.metric_type == {"stsb_test": "cosine_spearman", "toy": "ndcg_at_10"}[task]
        assert result.task_type == {"stsb_test": "STS", "toy": "Retrieval"}[task] and result.dataset_split == "test"
    assert got == pytest.approx(want, abs=1e-4)
    assert len(card.data.eval_results) == 4  # huggingface_hub's own parse of the card's front matter

    tiny_bert.save(model)  # a later save of the model writes the card again, from the results in the folder
    assert len(model_index_to_eval_results(front_matter(model / "README.md")["model-index"])[1]) == 4
