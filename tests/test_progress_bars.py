"""Progress bars of long commands: `index build` and `heads fit` show a bar with the total they will reach,
moved by every forward pass; off a terminal, `heads fit` prints count lines instead."""

import io
import json
import sys

import pytest

from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder

pytestmark = pytest.mark.usefixtures("one_thread")


def recording_bar(bars: list):
    """A stand-in for tqdm that records each bar made (into `bars`), its options, its moves and whether it closed."""

    class Bar:
        def __init__(self, **options):
            self.options, self.moves, self.closed = options, [], False
            bars.append(self)

        def update(self, n):
            self.moves.append(n)

        def close(self):
            self.closed = True

    return Bar


def test_index_build_shows_a_bar_over_the_documents_moved_by_every_forward_pass(tiny_dir, tmp_path, monkeypatch):
    """`index build` printed nothing until a shard (2,048 documents) was done: a bar with the corpus's total moves
    after every forward pass (tqdm gives the rate and the time left)."""
    from matryoshka2d.retrieval import index as index_module

    bars = []
    Bar = recording_bar(bars)

    monkeypatch.setattr(index_module, "tqdm", Bar)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"text number {i}"}) + "\n" for i in range(12)))
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    options = dict(batch_size=2, shard_size=8, log=lambda _: None, progress=True)
    index_module.build_index(encoder, corpus, [(4, 32)], tmp_path / "idx", **options)
    (bar,) = bars
    assert (bar.options["total"], bar.options["initial"], bar.options["unit"]) == (12, 0, "doc")
    assert sum(bar.moves) == 12 and len(bar.moves) >= 6  # every pass of at most 2 texts, not every shard of 8
    assert bar.closed


def test_heads_fit_shows_a_bar_over_the_sentences_it_will_use_moved_by_every_forward_pass(
    tiny_dir, text_file, tmp_path, monkeypatch
):
    """`heads fit` showed a count with no total: a bar whose total is the sentences the fit uses (the STS test
    sentences left out, at most --max-sentences) moves after every forward pass; off a terminal, the count lines."""
    from matryoshka2d.evaluate.sts import STS_SETS

    sentences = text_file.read_text().splitlines()  # 160 distinct
    for name in STS_SETS:  # two of them are STS test sentences
        a, b = (sentences[3], sentences[7]) if name == "sickr" else (f"{name} left", f"{name} right")
        path = tmp_path / "data" / "sts" / "raw" / f"{name}_test.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"sentence1\tsentence2\tscore\n{a}\t{b}\t3\n", encoding="utf-8")
    monkeypatch.setenv("MATRYOSHKA2D_DATA", str(tmp_path / "data"))
    bars = []
    Bar = recording_bar(bars)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("tqdm.auto.tqdm", Bar)
    fit = ["heads", "fit", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(text_file), "--select", "mse"]
    for most, total in ((None, 158), (100, 100)):
        monkeypatch.setattr(sys, "stderr", Terminal())
        limit = ["--max-sentences", str(most)] if most else []
        assert main([*fit, *limit, "--output", str(tmp_path / f"bar{most}")]) == 0
        bar = bars.pop()
        assert (bar.options["total"], bar.options["unit"]) == (total, "sentence")
        assert sum(bar.moves) == total and max(bar.moves) <= 64 and len(bar.moves) >= 2  # every pass of 64 at most
        assert bar.closed and "sentences encoded" not in sys.stderr.getvalue()
        assert "2 sentences of the STS test sets were in --data" in sys.stderr.getvalue()  # not counted twice
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar, the count lines
    assert main([*fit, "--output", str(tmp_path / "lines")]) == 0
    assert not bars and "heads fit: 158 sentences encoded" in sys.stderr.getvalue()
