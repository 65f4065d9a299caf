"""`eval mteb` (issue 54): mteb's encoder for a cell, a pair (query model, query cell) and layer 0; local mteb tasks
read from our files; the command's files (mteb's per cell, our grid); its refusals; mteb missing.

Offline: HF_HUB_OFFLINE is set (conftest) and mteb's cache is the test's own; every task is a local one on tiny files,
every model a tiny random one.
"""

import json
import re
import shlex
import sys

import numpy as np
import pytest

from helpers.cli import error_line, exit_code
from helpers.data import WORDS, beir, sts_tree

pytestmark = pytest.mark.usefixtures("one_thread", "offline_mteb")
mteb = pytest.importorskip("mteb")

from matryoshka2d.beir import load_beir  # noqa: E402
from matryoshka2d.cells import unit_rows  # noqa: E402
from matryoshka2d.evaluate import mteb_encoder, mteb_tasks  # noqa: E402  (mteb is there: importorskip above)
from matryoshka2d.evaluate.grid import EncoderCells  # noqa: E402
from matryoshka2d.evaluate.retrieval import DEPTH, rank_metrics, search  # noqa: E402
from matryoshka2d.evaluate.sts import evaluate_sts  # noqa: E402


@pytest.fixture
def offline_mteb(monkeypatch, tmp_path):
    """No network, and mteb's default cache (which it creates on import) in the test's folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The shared data's layout in small: the seven STS test sets, a BEIR folder (toy) and a classification set."""
    root = sts_tree(tmp_path_factory.mktemp("mteb-data"))
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, 5)) for _ in range(24)]
    corpus = [{"_id": f"d{k}", "title": WORDS[k % 5], "text": text} for k, text in enumerate(docs)]
    queries = [{"_id": f"q{k}", "text": " ".join(docs[k].split()[:3])} for k in range(12)]
    beir(root / "beir" / "toy", corpus, queries, [(f"q{k}", f"d{k}", 1) for k in range(12)], split="test")
    rows = [f"{' '.join(rng.choice(WORDS[:6], 3))} {'happy' if k % 2 else 'sad'}\t{k % 2}" for k in range(40)]
    (root / "classification").mkdir()
    (root / "classification" / "toy_train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:28]) + "\n")
    (root / "classification" / "toy_test.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[28:]) + "\n")
    return root


def run(encoder, task) -> float:
    """mteb's main score x 100 of one task through one of our encoders, no cache."""
    result = mteb.evaluate(encoder, task, cache=None, co2_tracker=False, show_progress_bar=False)
    return 100 * result.task_results[0].get_score()


def loader(texts):
    from torch.utils.data import DataLoader

    return DataLoader([{"text": t} for t in texts], batch_size=4, collate_fn=lambda b: {"text": [r["text"] for r in b]})


def encode(encoder, texts, prompt_type=None):
    task = mteb.get_task("STSBenchmark").metadata
    return encoder.encode(
        loader(texts), task_metadata=task, hf_split="test", hf_subset="default", prompt_type=prompt_type
    )


# ---- the encoder: a cell, layer 0, a pair ----------------------------------------------------------------------


def test_a_cell_scores_in_mteb_as_eval_sts_scores_it(tiny_bert, data):
    """mteb's cosine Spearman of a local STS task equals `eval sts`'s on the same file, at two cells of one pass."""
    documents = mteb_encoder.SharedPass(tiny_bert, [(2, 16), (4, 32)])
    task = mteb_tasks.LocalSTS(data / "sts" / "raw" / "stsb_test.tsv", "STSBenchmark")
    ours = evaluate_sts(EncoderCells(tiny_bert, [2, 4], [16, 32]), data, datasets=["stsb"], log=lambda m: None)
    ours = {(r["layer"], r["dim"]): r["spearman"] for r in ours.scores}
    for cell in [(2, 16), (4, 32)]:
        assert run(mteb_encoder.CellEncoder(documents, cell), task) == pytest.approx(ours[cell], abs=1e-4)
    assert task.metadata.main_score == "cosine_spearman"  # mteb's own metadata of the task of that name


def test_layer_zero_is_the_static_cell(tokenizer, data):
    from helpers.models import tiny_transformer
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.static import StaticCell

    encoder = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean")
    table = np.random.default_rng(0).normal(size=(tokenizer.vocab_size, 32)).astype(np.float32)
    encoder.set_static_cell(StaticCell.build(tokenizer.backend_tokenizer, table, 32))
    cell = mteb_encoder.CellEncoder(mteb_encoder.SharedPass(encoder, [(0, 16)]), (0, 16))
    texts = ["red cat runs", "blue dog sleeps", "red cat runs"]
    np.testing.assert_allclose(encode(cell, texts), encoder.encode(texts, layer=0, dim=16, normalize=True), atol=1e-6)
    ours = evaluate_sts(EncoderCells(encoder, [0], [16]), data, datasets=["sts12"], log=lambda m: None)
    task = mteb_tasks.LocalSTS(data / "sts" / "raw" / "sts12_test.tsv")
    assert run(cell, task) == pytest.approx(ours.scores[0]["spearman"], abs=1e-4)


@pytest.fixture(scope="module")
def query_model(teacher_dir, text_file, tmp_path_factory):
    """A 2-layer query encoder distilled (3 steps) from the 4-layer tiny teacher (as tests/test_pair.py makes it)."""
    from matryoshka2d.training.config import TrainConfig
    from matryoshka2d.training.distill import DistillTrainer

    out = tmp_path_factory.mktemp("mteb-student") / "q2"
    config = TrainConfig(
        model=str(teacher_dir),
        pooling="mean",
        method="distill",
        loss="cos",
        data=[str(text_file)],
        output=str(out),
        batch_size=16,
        steps=3,
        lr=1e-3,
        save_steps=0,
        exclude_sts_test=False,
        method_options={"mode": "query", "layer": 2},
    )
    return DistillTrainer(config).run(progress=False)


def test_a_pair_by_query_model_sends_queries_through_it(teacher_dir, query_model, data):
    from matryoshka2d.models.encoder import ElasticEncoder

    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    student = ElasticEncoder(str(query_model), device="cpu")
    cell = (4, 32)
    side = mteb_encoder.query_model_side(teacher, student, [cell])
    pair = mteb_encoder.CellEncoder(mteb_encoder.SharedPass(teacher, [cell]), cell, side)
    texts = ["red cat runs", "blue dog sleeps"]
    from mteb.types import PromptType

    np.testing.assert_allclose(
        encode(pair, texts, PromptType.query), student.encode(texts, normalize=True)[:, :32], atol=1e-6
    )
    np.testing.assert_allclose(
        encode(pair, texts, PromptType.document), teacher.encode(texts, normalize=True), atol=1e-6
    )
    np.testing.assert_allclose(encode(pair, texts), teacher.encode(texts, normalize=True), atol=1e-6)  # STS, ...
    pair.routed.clear()
    score = run(pair, mteb_tasks.LocalRetrieval(data / "beir" / "toy"))
    toy = load_beir(data / "beir" / "toy")
    assert pair.routed["query side"] == len(toy.query_ids) and pair.routed["cell"] == len(toy.doc_ids)
    queries = unit_rows(student.encode(toy.query_texts)[:, :32])
    ranking = search(queries, unit_rows(teacher.encode(toy.doc_texts)), DEPTH)
    # eval retrieval's nDCG@10; mteb rounds retrieval scores to 5 decimals (retrieval_metrics.make_score_dict)
    assert score == pytest.approx(rank_metrics(ranking, toy.qrels)["ndcg@10"], abs=1e-3)


def test_a_pair_by_query_cell_sends_queries_to_the_shallow_layer(tiny_bert):
    from mteb.types import PromptType

    side = mteb_encoder.query_cell_side(tiny_bert, (2, 16), [(4, 16)])
    pair = mteb_encoder.CellEncoder(mteb_encoder.SharedPass(tiny_bert, [(4, 16)]), (4, 16), side)
    texts = ["red cat runs", "blue dog sleeps"]
    shallow = tiny_bert.encode(texts, layer=2, dim=16, normalize=True)
    np.testing.assert_allclose(encode(pair, texts, PromptType.query), shallow, atol=1e-6)
    np.testing.assert_allclose(encode(pair, texts), tiny_bert.encode(texts, layer=4, dim=16, normalize=True), atol=1e-6)
    assert pair.routed == {"query side": 2, "cell": 2}
    with pytest.raises(ValueError, match=r"--query-cell 2x16 pairs queries of 16 numbers .* cell 4x32 has 32"):
        mteb_encoder.query_cell_side(tiny_bert, (2, 16), [(4, 32)])
    with pytest.raises(ValueError, match=r"cell 1x16's documents are at layer 1, shallower than the queries' layer 2"):
        mteb_encoder.query_cell_side(tiny_bert, (2, 16), [(1, 16)])


def test_a_local_classification_task_reads_our_rows_and_scores_with_mteb(tiny_bert, data):
    from matryoshka2d.evaluate.classification import load_split

    task = mteb_tasks.local_catalogue(data).find("toy")()
    assert isinstance(task, mteb_tasks.LocalClassification) and task.metadata.main_score == "accuracy"
    task.load_data()
    train = load_split(data / "classification" / "toy_train.tsv")
    assert task.dataset["train"]["text"] == train.texts
    assert [task.label_names[i] for i in task.dataset["train"]["label"]] == train.labels
    cell = mteb_encoder.CellEncoder(mteb_encoder.SharedPass(tiny_bert, [(4, 32)]), (4, 32))
    result = mteb.evaluate(cell, task, cache=None, co2_tracker=False, show_progress_bar=False).task_results[0]
    (scores,) = result.scores["test"]
    assert scores["main_score"] == scores["accuracy"] and len(scores["scores_per_experiment"]) == task.n_experiments


# ---- the command ------------------------------------------------------------------------------------------------


def eval_mteb(model, out, *more):
    return exit_code(["eval", "mteb", "--model", model, "--pooling", "mean", "--quiet", "--output", out, *more])


def test_the_command_writes_mteb_files_per_cell_and_our_grid(tiny_dir, data, tmp_path, capsys):
    from mteb.results import TaskResult

    from matryoshka2d.evaluate.results import load_result

    out = tmp_path / "out"
    tasks = ["--data-dir", data, "--task-dir", data / "beir" / "toy"]
    assert eval_mteb(tiny_dir, out, "--cells", "2x16", "4x32", *tasks, "--tasks", "STSBenchmark", "toy") == 0
    grid = load_result(out)  # the one reader of result files: `report`, `pick` and the card read it
    assert (
        grid.task == "mteb"
        and grid.datasets == ["STSBenchmark", "toy"]
        and (grid.layers, grid.dims) == ([2, 4], [16, 32])
    )
    assert grid.settings["tasks"]["toy"]["main_score"] == "ndcg_at_10"
    assert sorted(p.name for p in out.iterdir()) == [
        "2x16",
        "4x32",
        "heatmap.png",
        "results.csv",
        "results.json",
        "results.md",
    ]
    assert grid.metrics == ["cosine_spearman", "ndcg_at_10"]  # each task's main score under its own name
    for row in grid.scores:
        files = list((out / f"{row['layer']}x{row['dim']}" / "results").glob(f"*/*/{row['dataset']}.json"))
        assert len(files) == 1, files
        metric = grid.settings["tasks"][row["dataset"]]["main_score"]
        assert 100 * TaskResult.from_disk(files[0]).get_score() == pytest.approx(row[metric], abs=1e-3)
    assert (next((out / "2x16" / "results").glob("*/*/model_meta.json"))).is_file()
    assert "STSBenchmark at 2x16: cosine_spearman x 100" in capsys.readouterr().err


def test_an_existing_output_is_refused_unless_overwrite(tiny_dir, data, tmp_path, capsys):
    out = tmp_path / "out"
    stsb = data / "sts" / "raw" / "stsb_test.tsv"
    assert eval_mteb(tiny_dir, out, "--cells", "4x8", "--task-dir", stsb) == 0
    before = (out / "results.json").read_bytes()
    capsys.readouterr()
    assert eval_mteb(tiny_dir, out, "--cells", "4x8", "--task-dir", stsb) == 2
    assert f"--output {out} already exists and is not empty; pass --overwrite" in error_line(capsys)
    assert (out / "results.json").read_bytes() == before
    assert eval_mteb(tiny_dir, out, "--cells", "4x16", "--task-dir", stsb, "--overwrite") == 0
    assert json.loads((out / "results.json").read_text())["dims"] == [16]


@pytest.mark.parametrize(
    ("more", "said"),
    [
        (["--tasks", "NoSuchTask"], "--tasks NoSuchTask: no local task of that name (local tasks: STS12,"),
        (["--task-dir", "{tmp}/missing"], "--task-dir {tmp}/missing: no such file or folder"),
        (["--task-dir", "{tmp}/no-qrels"], "{tmp}/no-qrels/qrels: no qrels file (none); a BEIR folder needs"),
        (["--cells", "4y8"], "--cells '4y8': give LAYERxDIM, e.g. 6x384"),
        (["--cells", "0x8"], "layers [0] out of range: the model has layers 1..4 (layer 0 is a static cell"),
        (["--query-cell", "2x8", "--query-model", "{tmp}"], "--query-model and --query-cell are each a pair's"),
    ],
    ids=["unknown task", "missing task dir", "no qrels", "bad cell", "no static cell", "two query sides"],
)
def test_bad_tasks_and_cells_are_named(tiny_dir, data, tmp_path, capsys, more, said):
    (tmp_path / "no-qrels").mkdir()
    (tmp_path / "no-qrels" / "queries.jsonl").write_text('{"_id": "q", "text": "a"}\n')
    more = [m.replace("{tmp}", str(tmp_path)) for m in more]
    assert eval_mteb(tiny_dir, tmp_path / "out", "--data-dir", data, *more) == 2
    assert said.replace("{tmp}", str(tmp_path)) in error_line(capsys)
    assert not (tmp_path / "out" / "results.json").exists()


def test_an_mteb_task_whose_hub_cannot_be_reached_is_named_before_any_encoding(tiny_dir, tmp_path, capsys):
    """SciFact is no local task here (a data folder without it): mteb's SciFact loads from the hub, offline."""
    empty = tmp_path / "data"
    empty.mkdir()
    assert eval_mteb(tiny_dir, tmp_path / "out", "--data-dir", empty, "--tasks", "SciFact") == 2
    line = error_line(capsys)
    assert "task SciFact: its data (mteb/scifact) could not be loaded" in line and "--task-dir" in line, line


def test_without_mteb_the_command_says_how_to_install_it(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mteb", None)  # `import mteb` raises ImportError, as when it is not installed
    assert eval_mteb(tiny_dir, tmp_path / "out") == 2
    assert "`eval mteb` needs mteb, which is not installed" in (line := error_line(capsys))
    from matryoshka2d.evaluate.mteb_run import ROOT

    assert f"-m pip install -e {shlex.quote(f'{ROOT}[mteb]')}" in line  # the checkout's extra: we are on no index


def test_only_the_mteb_modules_import_mteb_and_only_eval_mteb_imports_them():
    """mteb stays optional: two modules import it at their top, and nothing imports those two at its top (the command
    imports them inside cmd_mteb), so `import matryoshka2d` and every other command run without it."""
    import ast
    from pathlib import Path

    import matryoshka2d

    mteb_modules = {"matryoshka2d.evaluate.mteb_encoder", "matryoshka2d.evaluate.mteb_tasks"}
    root = Path(matryoshka2d.__file__).parent
    top_level = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        names = set()
        for node in ast.parse(path.read_text()).body:  # the module's top only, not its functions
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        top_level[module] = names
    importing_mteb = {m for m, names in top_level.items() if any(n == "mteb" or n.startswith("mteb.") for n in names)}
    assert importing_mteb == mteb_modules
    assert not [m for m, names in top_level.items() if names & mteb_modules and m not in mteb_modules]


def test_a_query_model_that_is_no_query_encoder_is_refused(tiny_bert):
    with pytest.raises(ValueError, match=r"--query-model tiny-bert: not a query encoder \(its folder has no `distill`"):
        mteb_encoder.query_model_side(tiny_bert, tiny_bert, [(4, 32)])


def test_a_classification_set_of_sentence_pairs_is_named(tmp_path):
    rows = "sentence1\tsentence2\tlabel\na cat\ta dog\t1\nred\tblue\t0\n"
    (tmp_path / "pairs_train.tsv").write_text(rows)
    (tmp_path / "pairs_test.tsv").write_text(rows)
    task = mteb_tasks.local_catalogue(None, [tmp_path]).find("pairs")()
    with pytest.raises(ValueError, match=r"pairs_train.tsv: sentence pairs \(sentence1, sentence2\); a classification"):
        task.load_data()


def test_a_pair_folder_as_model_sends_queries_through_its_query_route(tiny_bert, tokenizer):
    """A pair folder (`export --query-model/--query-cell`) loads with its query route as `query_encoder`
    (models.encoder); the route stands in here as a second tiny model, set as ElasticEncoder sets it."""
    from mteb.types import PromptType

    from helpers.models import tiny_transformer
    from matryoshka2d.models.encoder import ElasticEncoder

    documents = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, pooling="mean")
    route = ElasticEncoder.from_modules(tiny_transformer("distilbert", tokenizer.vocab_size), tokenizer, pooling="mean")
    object.__setattr__(documents, "query_encoder", route)
    side = mteb_encoder.pair_folder_side(documents, [(4, 16)])
    cell = mteb_encoder.CellEncoder(mteb_encoder.SharedPass(documents, [(4, 16)]), (4, 16), side)
    texts = ["red cat runs", "blue dog sleeps"]
    queries = route.encode(texts, dim=16, normalize=True)
    np.testing.assert_allclose(encode(cell, texts, PromptType.query), queries, atol=1e-6)
    np.testing.assert_allclose(encode(cell, texts), documents.encode(texts, dim=16, normalize=True), atol=1e-6)
    assert not np.allclose(queries, documents.encode(texts, dim=16, normalize=True), atol=1e-3)  # two models
    assert mteb_encoder.pair_folder_side(tiny_bert, [(4, 16)]) is None  # any other model: no query side


# ---- what the output says: metrics apart, each cell's own time, the model's metadata, the weights' folder ----------


def test_a_grid_of_two_metrics_averages_each_over_its_own_tasks_only(tiny_dir, data, tmp_path):
    """Two STS tasks and a retrieval task: the cell's cosine_spearman is the mean of the two STS scores, its
    ndcg_at_10 the retrieval score; no number mixes the two metrics, in results.json or results.md."""
    from matryoshka2d.evaluate.results import load_result

    out = tmp_path / "out"
    tasks = ["--data-dir", data, "--task-dir", data / "beir" / "toy", "--tasks", "STSBenchmark", "STS12", "toy"]
    assert eval_mteb(tiny_dir, out, "--cells", "4x32", *tasks) == 0
    grid = load_result(out)
    (average,) = grid.average
    sts = [r["cosine_spearman"] for r in grid.scores if r["dataset"] in ("STSBenchmark", "STS12")]
    (toy,) = [r["ndcg_at_10"] for r in grid.scores if r["dataset"] == "toy"]
    assert average["cosine_spearman"] == pytest.approx(np.mean(sts)) and average["ndcg_at_10"] == pytest.approx(toy)
    assert all(len(set(r) & {"cosine_spearman", "ndcg_at_10"}) == 1 for r in grid.scores)
    assert grid.summary["average"] == pytest.approx(np.mean(sts)) and grid.summary["metric"] == "cosine_spearman"
    report = (out / "results.md").read_text()
    assert "## cosine_spearman: average over 2 datasets" in report and "## ndcg_at_10: toy" in report
    assert "average of cosine_spearman at layer 4, dim 32" in report


def test_layer_0_is_no_shallow_layer_of_a_grid():
    """ESE's shallow average is over layers 1..N-1: a grid of the static cell (layer 0) and the last layer has none."""
    from matryoshka2d.evaluate.results import grid_result

    rows = [{"dataset": "s", "layer": n, "dim": 8, "cosine_spearman": 10.0 * n + 1} for n in (0, 2, 4)]

    def grid(rows):
        cells = [(r["layer"], r["dim"]) for r in rows]
        return grid_result("mteb", ["cosine_spearman"], ["s"], rows, cells, {"layers": 4}, {}, {}, {})

    assert grid(rows).summary["shallow_layers"] == [2] and grid(rows).summary["shallow_average"] == 21.0
    only_static = grid(rows[::2])
    assert "shallow_average" not in only_static.summary


def test_each_cells_files_carry_its_own_time_the_models_size_and_the_weights_sha256(tiny_dir, data, tmp_path):
    from mteb.results import TaskResult

    from matryoshka2d.evaluate.results import load_result

    out = tmp_path / "out"
    stsb = data / "sts" / "raw" / "stsb_test.tsv"
    assert eval_mteb(tiny_dir, out, "--cells", "2x16", "4x32", "--task-dir", stsb) == 0
    grid = load_result(out)
    timing = grid.seconds["tasks"]["stsb_test"]
    for cell, dim in (("2x16", 16), ("4x32", 32)):
        (revision,) = (out / cell / "results").glob("*/*")
        assert revision.name == grid.model["weights_sha256"] and len(revision.name) == 64  # as the guide shows it
        took = TaskResult.from_disk(revision / "stsb_test.json").evaluation_time
        assert took == pytest.approx(timing["encoding"] + timing["scoring"][cell], abs=1e-6)  # the pass + its scoring
        meta = json.loads((revision / "model_meta.json").read_text())
        assert meta["n_parameters"] == grid.model["parameters"] and meta["embed_dim"] == dim
        assert meta["memory_usage_mb"] > 0 and 0 < meta["n_embedding_parameters"] < meta["n_parameters"]


# ---- local tasks: the user's named like a shared one, names alike, a | in a name, one label -----------------------


def test_a_task_dir_file_named_like_a_shared_task_is_the_task_run(tiny_dir, data, tmp_path):
    from matryoshka2d.evaluate.results import load_result

    mine = tmp_path / "mine" / "sts12.tsv"  # the shared data has sts12 (mteb's STS12) too: this one must run
    mine.parent.mkdir()
    mine.write_text((data / "sts" / "raw" / "stsb_test.tsv").read_text())
    for tasks in ([], ["--tasks", "sts12"]):
        out = tmp_path / f"out{len(tasks)}"
        assert eval_mteb(tiny_dir, out, "--cells", "4x8", "--data-dir", data, "--task-dir", mine, *tasks) == 0
        grid = load_result(out)
        assert grid.datasets == ["sts12"] and grid.settings["tasks"]["sts12"]["source"] == str(mine)


def test_two_task_dir_items_of_one_name_are_refused_naming_both(tiny_dir, data, tmp_path, capsys):
    first, second = tmp_path / "a" / "same.tsv", tmp_path / "b" / "Same.tsv"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text((data / "sts" / "raw" / "stsb_test.tsv").read_text())
    assert eval_mteb(tiny_dir, tmp_path / "out", "--task-dir", first, second) == 2
    assert f"--task-dir {first} and {second} are both task 'Same'" in error_line(capsys)


def test_a_bar_in_a_task_name_leaves_the_tables_whole(tiny_dir, data, tmp_path):
    barred = tmp_path / "a|b.tsv"
    barred.write_text((data / "sts" / "raw" / "stsb_test.tsv").read_text())
    out = tmp_path / "out"
    assert eval_mteb(tiny_dir, out, "--cells", "4x8", "--task-dir", barred) == 0
    table = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| layer |")]
    assert table and "a\\|b" in table[-1]
    rows = (out / "results.md").read_text().split(table[-1])[1].strip().splitlines()[:3]
    assert len({len(re.findall(r"(?<!\\)\|", line)) for line in [table[-1], *rows]}) == 1  # as many cells per row


def test_a_classification_set_of_one_label_is_named_before_any_encoding(tiny_dir, tmp_path, capsys):
    (tmp_path / "sets").mkdir()
    for split in ("train", "test"):
        (tmp_path / "sets" / f"one_{split}.tsv").write_text("sentence\tlabel\na cat\tx\na dog\tx\nred\tx\n")
    assert eval_mteb(tiny_dir, tmp_path / "out", "--task-dir", tmp_path / "sets") == 2
    line = error_line(capsys)
    assert f"task one: {tmp_path / 'sets' / 'one_train.tsv'} has one label ('x'); a classification task" in line
    assert not (tmp_path / "out" / "results.json").exists()


def test_the_docs_install_extras_from_the_checkout():
    """The package is on no index: every install line of the docs installs from the checkout."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    bad = [f"{p.name}: {m}" for p in pages for m in re.findall(r"pip install '?matryoshka2d\[", p.read_text())]
    assert not bad
