"""STS evaluation: hand-computed Spearman, the one-pass grid equals per-cell encoding, outputs, bad files."""

import json

import numpy as np
import pytest
from scipy.stats import spearmanr

from helpers.data import sts_tree, write_tsv
from helpers.models import tiny_transformer
from matryoshka2d.cells import parse_numbers
from matryoshka2d.cli import main
from matryoshka2d.evaluate.grid import EncoderCells, default_dims
from matryoshka2d.evaluate.sts import STS_SETS, evaluate_sts, load_pairs, sts_file
from matryoshka2d.files import DataFormatError


class TableEmbedder:
    """A CellEmbedder with fixed vectors per layer: {layer: {text: vector}}; dims slice the vectors."""

    def __init__(self, by_layer, dims):
        self.by_layer, self.dims = by_layer, dims

    def cells(self):
        return [(n, d) for n in sorted(self.by_layer) for d in self.dims]

    def embed(self, texts):
        assert len(set(texts)) == len(texts), "evaluators must pass distinct texts"
        return {
            (n, d): np.array([self.by_layer[n][t] for t in texts], dtype=np.float32)[:, :d] for n, d in self.cells()
        }

    def info(self):
        return {"model": "table", "layers": max(self.by_layer), "hidden_size": max(self.dims)}


def test_hand_computed_spearman_on_four_rows(tmp_path):
    # Cosines at dim 2 are 1.0, 0.0, 0.8, 0.6 -> ranks 4, 1, 3, 2; gold ranks 4, 1, 2, 3 -> d^2 = 0+0+1+1.
    # rho = 1 - 6 * 2 / (4 * 15) = 0.8.
    vectors = {
        "a": [1, 0],
        "b": [1, 0],
        "c": [1, 0],
        "d": [0, 1],
        "e": [1, 0],
        "f": [0.8, 0.6],
        "g": [1, 0],
        "h": [0.6, 0.8],
    }
    write_tsv(
        tmp_path / "sts" / "raw" / "four_test.tsv",
        ["sentence1", "sentence2", "score"],
        [("a", "b", 5), ("c", "d", 0), ("e", "f", 3), ("g", "h", 3.5)],
    )
    result = evaluate_sts(TableEmbedder({1: vectors}, [2]), tmp_path, datasets=["four"], log=lambda m: None)
    (row,) = result.scores
    assert (row["dataset"], row["layer"], row["dim"]) == ("four", 1, 2)
    assert row["spearman"] == pytest.approx(80.0)
    assert result.summary["average"] == pytest.approx(80.0)


def test_grid_equals_per_cell_encoding_and_summary(tmp_path, tiny_bert):
    sts_tree(tmp_path)
    embedder = EncoderCells(tiny_bert, layers=[1, 2, 3, 4], dims=[8, 32])
    result = evaluate_sts(embedder, tmp_path, log=lambda m: None)
    assert len(result.scores) == 7 * 4 * 2 and result.datasets == list(STS_SETS)
    pairs = load_pairs(tmp_path / "sts" / "raw" / "stsb_test.tsv")
    for layer, dim in [(2, 8), (4, 32)]:
        a = tiny_bert.encode(pairs.sentences1, layer=layer, dim=dim, normalize=True)
        b = tiny_bert.encode(pairs.sentences2, layer=layer, dim=dim, normalize=True)
        expected = 100 * spearmanr(pairs.gold, (a * b).sum(1)).statistic
        got = next(r for r in result.scores if (r["dataset"], r["layer"], r["dim"]) == ("stsb", layer, dim))
        assert got["spearman"] == pytest.approx(expected, abs=1e-4)
    avg = {(r["layer"], r["dim"]): r["spearman"] for r in result.average}
    per = [r["spearman"] for r in result.scores if (r["layer"], r["dim"]) == (4, 32)]
    assert avg[(4, 32)] == pytest.approx(np.mean(per))
    summary = result.summary
    assert summary["cell"] == [4, 32] and summary["average"] == pytest.approx(avg[(4, 32)])
    assert summary["shallow_layers"] == [1, 2, 3]
    assert summary["shallow_average"] == pytest.approx(np.mean([avg[(n, 32)] for n in (1, 2, 3)]))


def test_cli_writes_json_markdown_csv_heatmap(tmp_path, tokenizer, capsys):
    model_dir = tmp_path / "model"
    tiny_transformer("bert", tokenizer.vocab_size).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sts_tree(tmp_path / "data")
    out = tmp_path / "out"
    args = ["eval", "sts", "--model", str(model_dir), "--pooling", "mean", "--data-dir", str(tmp_path / "data")]
    assert main([*args, "--layers", "1,3-4", "--dims", "8", "32", "--output", str(out), "--quiet"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["layers"] == [1, 3, 4] and result["dims"] == [8, 32] and result["settings"]["variant"] == "raw"
    assert result["model"]["layers"] == 4 and result["seconds"]["total"] > 0 and result["provenance"]["command"]
    markdown = (out / "results.md").read_text()
    assert "| layer \\ dim | 8 | 32 |" in markdown and "## Per dataset at dim 32" in markdown
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0] == "dataset,layer,dim,spearman" and len(csv_lines) == 1 + 7 * 6 + 6
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sts spearman:" in capsys.readouterr().out


def test_senteval_tok_reads_sickr_from_raw_as_senteval(tmp_path):
    sts_tree(tmp_path, "senteval_tok", STS_SETS[:-1])
    sts_tree(tmp_path, "raw", ["sickr"])
    assert sts_file(tmp_path, "senteval_tok", "sickr") == tmp_path / "sts" / "raw" / "sickr_test.tsv"
    assert sts_file(tmp_path, "senteval_tok", "stsb") == tmp_path / "sts" / "senteval_tok" / "stsb_test.tsv"
    with pytest.raises(DataFormatError, match=r"sts/raw/sts12_test.tsv: file not found"):
        sts_file(tmp_path / "nowhere", "raw", "sts12")
    with pytest.raises(ValueError, match="unknown STS variant 'tok'"):
        sts_file(tmp_path, "tok", "stsb")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("sentence1\tsentence2\tscore\na\tb\t1\nc\td\n", r"bad.tsv line 3: 2 tab-separated columns, the header has 3"),
        ("sentence1\tsentence2\tscore\na\tb\t1\nc\td\tn/a\n", r"bad.tsv line 3: score 'n/a' is not a finite number"),
        ("sentence1\tsentence2\tscore\na\tb\tnan\n", r"bad.tsv line 2: score 'nan' is not a finite number"),
        ("", r"bad.tsv: empty file"),
        ("sentence1\tsentence2\tscore\n", r"bad.tsv: no data rows"),
        ("sentence1\tsentence2\tlabel\na\tb\t1\n", r"bad.tsv line 1: no column 'score' in the header"),
        ("sentence1\tsentence2\tscore\na\tb\t2\nc\td\t2\n", r"bad.tsv: every score is 2.0"),
        ('sentence1\tsentence2\tscore\n"quoted\tb\t1\nc"\td\t2\n', None),  # quotes are ordinary characters
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_text(content, encoding="utf-8")
    if message is None:
        assert load_pairs(path).sentences1 == ['"quoted', 'c"']
        return
    with pytest.raises(DataFormatError, match=message):
        load_pairs(path)


def test_missing_file_fails_before_encoding_and_cli_exit_code(tmp_path, capsys):
    sts_tree(tmp_path, names=["stsb"])
    calls = []

    class Spy(TableEmbedder):
        def embed(self, texts):
            calls.append(texts)
            return super().embed(texts)

    with pytest.raises(DataFormatError, match=r"sts12_test.tsv: file not found"):
        evaluate_sts(Spy({1: {}}, [2]), tmp_path, log=lambda m: None)
    assert calls == []
    args = ["eval", "sts", "--data-dir", str(tmp_path), "--datasets", "sts13", "--output", str(tmp_path / "o")]
    assert main(args) == 2
    assert "sts13_test.tsv: file not found" in capsys.readouterr().err


def test_default_dims_and_cell_parsing():
    assert default_dims(384) == [8, 16, 32, 64, 128, 256, 384]
    assert default_dims(768) == [8, 16, 32, 64, 128, 256, 512, 768]
    assert default_dims(32) == [8, 16, 32]
    assert parse_numbers("1-3,6,4,5", "--layers") == [1, 2, 3, 6, 4, 5]
    with pytest.raises(ValueError, match="--dims: 'x' is not a whole number"):
        parse_numbers("8,x", "--dims")


def test_cells_out_of_range(tiny_bert):
    with pytest.raises(ValueError, match=r"layers \[5\] out of range: the model has layers 1..4"):
        EncoderCells(tiny_bert, layers=[1, 5])
    with pytest.raises(ValueError, match=r"dims \[64\] out of range"):
        EncoderCells(tiny_bert, dims=[64])


def test_matches_sentence_transformers_evaluator_on_stsb(minilm, tmp_path):
    """Layer 6, dim 384 of minilm-l6 on STS-B test equals sentence-transformers' own evaluator within 0.01: on every
    third pair of the test set (460 of 1,379, every genre and year in it; the whole set took 27 s of the suite for
    the same comparison)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from matryoshka2d.models.backbones import minilm_dir
    from matryoshka2d.paths import data_dir

    try:
        root = data_dir()
    except FileNotFoundError as exc:  # the shared data lives beside the checkout, not in it
        pytest.skip(f"shared STS data not available here: {exc}")
    header, *rows = (root / "sts" / "raw" / "stsb_test.tsv").read_text(encoding="utf-8").splitlines()
    (tmp_path / "sts" / "raw").mkdir(parents=True)
    (tmp_path / "sts" / "raw" / "stsb_test.tsv").write_text("\n".join([header, *rows[::3]]) + "\n", encoding="utf-8")
    ours = evaluate_sts(EncoderCells(minilm, layers=[6], dims=[384]), tmp_path, datasets=["stsb"], log=lambda m: None)
    pairs = load_pairs(tmp_path / "sts" / "raw" / "stsb_test.tsv")
    assert len(pairs.gold) == 460
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    evaluator = EmbeddingSimilarityEvaluator(
        pairs.sentences1, pairs.sentences2, pairs.gold.tolist(), batch_size=64, main_similarity="cosine"
    )
    theirs = evaluator(model)["spearman_cosine"] * 100
    assert ours.scores[0]["spearman"] == pytest.approx(theirs, abs=0.01)
    assert 80 < theirs < 85, theirs  # all-MiniLM-L6-v2: 82.3 on these pairs, about 82 on the whole set
