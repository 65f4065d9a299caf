"""A model card lists `eval mteb`'s results in the Hub's model-index (issue 54): `eval mteb --output MODEL/mteb`
refreshes MODEL's card, and a later save of the model keeps them; huggingface_hub reads them back."""

import json

import pytest
import yaml

from helpers.cli import exit_code
from helpers.data import beir, sts_tree

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
    metric = {name: task["main_score"] for name, task in grid["settings"]["tasks"].items()}
    want = {(r["dataset"], f"{r['layer']}x{r['dim']}"): r[metric[r["dataset"]]] for r in grid["scores"]}
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


@pytest.fixture
def model_with_card(tiny_bert, tmp_path, monkeypatch):
    """A saved tiny model (its card written by the save) and an STS task file beside it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))
    model = tiny_bert.save(tmp_path / "model")
    stsb = sts_tree(tmp_path / "data", names=["stsb"]) / "sts" / "raw" / "stsb_test.tsv"
    return model, stsb


def eval_into(model, stsb, output, *cells):
    argv = ["eval", "mteb", "--model", model, "--cells", *cells, "--task-dir", stsb, "--quiet", "--output", output]
    return exit_code(argv)


def test_a_second_run_replaces_its_task_and_cell_on_the_card_and_the_users_entries_stay(model_with_card):
    model, stsb = model_with_card
    card = model / "README.md"
    fields = front_matter(card)
    users = {"name": "model", "results": [{"task": {"type": "STS"}, "dataset": {"name": "my STS", "type": "mine",
             "config": "default", "split": "test"}, "metrics": [{"type": "spearman", "value": 50.0}]}]}  # fmt: skip
    others = {"name": "another model", "results": [{**users["results"][0], "dataset": {"name": "theirs"}}]}
    fields["model-index"] = [users, others]
    body = card.read_text().split("\n---", 1)[1]
    card.write_text("---\n" + yaml.safe_dump(fields, sort_keys=False) + "---" + body)
    assert eval_into(model, stsb, model / "mteb", "2x16", "4x32") == 0
    assert eval_into(model, stsb, model / "mteb-again", "4x32") == 0  # the same task and cell, a newer file
    index = front_matter(card)["model-index"]
    assert [entry["name"] for entry in index] == ["model", "another model"] and index[1] == others
    results = index[0]["results"]
    assert results[0] == users["results"][0]  # the user's own result, kept first
    ours = [r["dataset"]["config"] for r in results[1:]]
    assert sorted(ours) == ["default, matryoshka2d cell 2x16", "default, matryoshka2d cell 4x32"]  # one each
    newer = json.loads((model / "mteb-again" / "results.json").read_text())["scores"][0]["cosine_spearman"]
    (at_4x32,) = [r for r in results if r["dataset"]["config"].endswith("4x32")]
    assert at_4x32["metrics"][0]["value"] == pytest.approx(newer, abs=1e-4)


@pytest.mark.parametrize(
    ("card", "said"),
    [
        (b"---\nlicense: [mit\n---\n# a card\n", "README.md (line 2): the card's front matter is not valid YAML"),
        (b"---\nlicense: mit\n---\n# caf\xe9 card\n", "README.md:4: not UTF-8 text (byte 0xe9 at column 6)"),
        (b"---\n- a\n- b\n---\n# a card\n", "README.md: the card's front matter is a YAML list, not a mapping"),
    ],
    ids=["bad yaml", "not utf-8", "not a mapping"],
)
def test_a_card_that_cannot_be_rewritten_is_refused_before_the_work(model_with_card, card, said, capsys):
    from helpers.cli import error_line

    model, stsb = model_with_card
    (model / "README.md").write_bytes(card)
    assert eval_into(model, stsb, model / "mteb", "4x32") == 2
    assert f"{model / said}" in error_line(capsys)
    assert not (model / "mteb").exists() and (model / "README.md").read_bytes() == card
