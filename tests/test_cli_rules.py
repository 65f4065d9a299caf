"""Issue 52, the command line's part (src/matryoshka2d/cli/):

- every file a command of cli/ writes goes through the one writer (matryoshka2d.outputs): encode's streamed .npy,
  search --output, eval --cascade's cascade.json/.md, report compression's files, the demo's corpus; an audit hook
  fails a test on any write-mode open there that is not one of the writer's temporary files;
- rule 4, options that would do nothing in the combination given are refused before any work, naming them:
  exit-head options with distill --mode static, --pooling at layer 0, a --max-length that leaves no token of text,
  reversed ranges (--layers 3-1), and a --query-model NAME=FOLDER written so that its real cause must be named;
- an output folder that cannot be written is refused before any work, for every command of the parser that
  declares an output (and every cache folder it writes into);
- Ctrl-C during a command's work: one line, no traceback, exit 130, no half-written file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from audit import opened_for_writing, recording
from conftest import WORDS
from matryoshka2d import cli
from matryoshka2d.cli import build_parser
from matryoshka2d.outputs import is_writer_temporary
from test_eval_retrieval import beir
from test_rules_outputs_options_results import error_line, every_command, exit_code

# ---- what a command opens for writing ------------------------------------------------------------------------------


@contextlib.contextmanager
def plain_writes_under(root: Path):
    """Yields a list that, once the block ends, holds every file under `root` opened for writing that was not a
    temporary file of the one writer (which renames its files into place); tests/audit.py's hook."""
    found: list[str] = []
    with recording() as events:
        yield found
    root = root.resolve()
    written = opened_for_writing(events)
    found += [str(p) for p in written if p.resolve().is_relative_to(root) and not is_writer_temporary(p)]


@pytest.fixture
def texts(tmp_path):
    path = tmp_path / "in" / "texts.txt"
    path.parent.mkdir()
    path.write_text("red cat\nblue dog\nold fish swims\n", encoding="utf-8")
    return path


# ---- 1. every write of cli/ goes through the one writer --------------------------------------------------------------


def test_encode_streams_its_array_through_the_one_writer(tiny_dir, texts, tmp_path):
    """Was: the rows streamed into OUTPUT's `.partial` file with plain open(), left behind by an error."""
    out = tmp_path / "out"
    victim = tmp_path / "victim.npy"
    victim.write_bytes(b"another array")
    out.mkdir()
    (out / "vectors.npy").symlink_to(victim)  # replaced, never written through
    argv = ["encode", "--model", tiny_dir, "--pooling", "mean", "--input", texts, "--output", out / "vectors"]
    with plain_writes_under(tmp_path) as plain:
        assert exit_code(argv) == 0
    assert plain == []
    assert victim.read_bytes() == b"another array"
    assert not (out / "vectors.npy").is_symlink() and np.load(out / "vectors.npy").shape == (3, 32)
    assert sorted(os.listdir(out)) == ["vectors.npy"]


def test_encode_refuses_an_array_name_that_is_its_input_before_any_work(tiny_dir, tmp_path, capsys, monkeypatch):
    """--output X writes X.npy: that name is checked, not only X (the input X.npy was replaced by its vectors)."""
    from matryoshka2d.cli import encode

    source = tmp_path / "texts.npy"  # a text file that happens to be named .npy
    source.write_text("red cat\nblue dog\n")
    monkeypatch.setattr(encode, "_encoder", lambda args: pytest.fail("the model was loaded"))
    argv = ["encode", "--model", tiny_dir, "--pooling", "mean", "--input", source, "--output", tmp_path / "texts"]
    assert exit_code(argv) == 2
    line = error_line(capsys)
    assert f"--output {source} is --input {source}" in line and "nothing was written" in line
    assert source.read_text() == "red cat\nblue dog\n"


@pytest.fixture
def toy_beir(tmp_path):
    pairs = zip(WORDS[:12], WORDS[3:15], strict=True)
    corpus = [{"_id": f"d{k}", "title": "", "text": f"{w} {v} text"} for k, (w, v) in enumerate(pairs)]
    queries = [{"_id": f"q{k}", "text": f"{w} text"} for k, w in enumerate(WORDS[:6])]
    return beir(tmp_path / "beir", corpus, queries, [(f"q{k}", f"d{k}", 1) for k in range(6)])


def test_search_writes_its_rows_through_the_one_writer_and_never_through_a_link(tiny_dir, toy_beir, texts, tmp_path):
    """Was: open(--output, "w"), which wrote through a link in its place into the file it pointed at."""
    index = tmp_path / "index"
    build = ["index", "build", "--model", tiny_dir, "--pooling", "mean", "--corpus", toy_beir / "corpus.jsonl"]
    assert exit_code([*build, "--cells", "4:32", "--output", index]) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's notes\n")
    hits = tmp_path / "out" / "hits.jsonl"
    hits.parent.mkdir()
    hits.symlink_to(victim)
    with plain_writes_under(tmp_path) as plain:
        assert exit_code(["search", "--index", index, "--queries", texts, "--top-k", "2", "--output", hits]) == 0
    assert plain == []
    assert victim.read_text() == "someone's notes\n"
    rows = [json.loads(line) for line in hits.read_text().splitlines()]
    assert not hits.is_symlink() and [r["query"] for r in rows] == ["red cat", "blue dog", "old fish swims"]


def test_eval_cascade_writes_its_files_through_the_one_writer(tiny_dir, toy_beir, tmp_path):
    """Was: Path.write_text, through a link in cascade.json's place."""
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.json"
    victim.write_text("{}\n")
    (out / "cascade.json").symlink_to(victim)
    argv = ["eval", "retrieval", "--model", tiny_dir, "--pooling", "mean", "--dataset-dir", toy_beir, "--quiet"]
    with plain_writes_under(tmp_path) as plain:
        assert exit_code([*argv, "--cascade", "2:16,4:32", "--shortlist", "10", "--output", out]) == 0
    assert plain == []
    assert victim.read_text() == "{}\n"
    assert not (out / "cascade.json").is_symlink() and "rows" in json.loads((out / "cascade.json").read_text())
    assert (out / "cascade.md").is_file()


@pytest.fixture
def stsb_data(tmp_path):
    """A data folder with an STS-B test file of 30 pairs (what report compression reads)."""
    root = tmp_path / "data"
    (root / "sts" / "raw").mkdir(parents=True)
    rng = np.random.default_rng(2)
    rows = ["sentence1\tsentence2\tscore"]
    rows += [f"{' '.join(rng.choice(WORDS, 4))}\t{' '.join(rng.choice(WORDS, 3))}\t{i % 6}" for i in range(30)]
    (root / "sts" / "raw" / "stsb_test.tsv").write_text("\n".join(rows) + "\n")
    return root


def test_report_compression_writes_through_the_one_writer(tiny_dir, stsb_data, tmp_path, capsys, monkeypatch):
    """Was: mkdir and Path.write_text (through a link in compression.md's place); and an earlier report in --output
    was refused only after every model was loaded and every t-SNE computed."""
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.md"
    victim.write_text("notes\n")
    (out / "compression.md").symlink_to(victim)
    argv = ["report", "compression", "--model", tiny_dir, "--pooling", "mean", "--data-dir", stsb_data, "--quiet"]
    argv += ["--device", "cpu", "--dims", "8", "32", "--sentences", "20", "--output", out]
    with plain_writes_under(tmp_path) as plain:
        assert exit_code([*argv, "--overwrite"]) == 0
    assert plain == []
    assert victim.read_text() == "notes\n" and not (out / "compression.md").is_symlink()
    assert sorted(os.listdir(out)) == ["compression.json", "compression.md", "compression.png"]
    capsys.readouterr()
    from matryoshka2d.cli import args as cli_args

    monkeypatch.setattr(cli_args, "load_encoder", lambda *a, **k: pytest.fail("a model was loaded"))
    assert exit_code(argv) == 2
    assert "already holds compression.json; pass --overwrite" in error_line(capsys)


def test_the_demo_writes_its_small_corpus_through_the_one_writer(toy_beir, tmp_path):
    from matryoshka2d.cli.demo import small_scifact

    out = tmp_path / "demo" / "scifact-small"
    with plain_writes_under(tmp_path) as plain:
        _, keep, split = small_scifact(toy_beir, out, 3, 8)
    assert plain == []
    assert split == "test" and len(keep) == 8
    assert len((out / "corpus.jsonl").read_text().splitlines()) == 8


def test_a_model_record_is_read_inside_its_folder_only(tmp_path, monkeypatch):
    """merge and heads fit copy the model's matryoshka2d.json: it was read through a link out of the folder, and,
    for a model with no folder here, from the current folder."""
    from types import SimpleNamespace

    from matryoshka2d.cli.args import folder_metadata

    (tmp_path / "matryoshka2d.json").write_text('{"method": "someone else\'s"}')
    monkeypatch.chdir(tmp_path)
    assert folder_metadata(SimpleNamespace(location=None)) == {}
    model = tmp_path / "model"
    model.mkdir()
    assert folder_metadata(SimpleNamespace(location=str(model))) == {}
    (model / "matryoshka2d.json").symlink_to(tmp_path / "matryoshka2d.json")
    with pytest.raises(ValueError, match="leaves the model folder"):
        folder_metadata(SimpleNamespace(location=str(model)))
    (model / "matryoshka2d.json").unlink()
    (model / "matryoshka2d.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="matryoshka2d.json: not a JSON object"):
        folder_metadata(SimpleNamespace(location=str(model)))


# ---- 2. rule 4: options that would do nothing are refused, naming them -------------------------------------------


@pytest.mark.parametrize(
    "option",
    [
        ["--exit-heads", "fit"],
        ["--exit-heads-lr", "1e-3"],
        ["--exit-heads-inputs", "stack"],
        ["--exit-heads-sentences", "100"],
    ],
    ids=lambda o: o[0],
)
def test_distill_static_refuses_exit_head_options(tiny_dir, texts, tmp_path, capsys, option):
    """--mode static trains the static cell alone (the teacher's heads are kept): an exit-head option did nothing,
    or (--exit-heads) was refused only after the teacher and the texts were read."""
    out = tmp_path / "student"
    argv = ["distill", "--teacher", tiny_dir, "--pooling", "mean", "--mode", "static", "--data", texts]
    assert exit_code([*argv, *option, "--steps", "1", "--quiet", "--no-exclude-sts-test", "--output", out]) == 2
    line = error_line(capsys)
    assert f"{option[0]} would do nothing with --mode static" in line, line
    assert not out.exists()


def test_distill_static_names_every_exit_head_option_given(tiny_dir, texts, tmp_path, capsys):
    argv = ["distill", "--teacher", tiny_dir, "--mode", "static", "--data", texts, "--output", tmp_path / "s"]
    assert exit_code([*argv, "--exit-heads-lr", "1e-3", "--exit-heads-inputs", "exit"]) == 2
    assert "--exit-heads-lr and --exit-heads-inputs would do nothing with --mode static" in error_line(capsys)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["encode", "--layer", "0", "--input", "{texts}", "--output", "{out}/v.npy"], "with --layer 0 would do"),
        (["eval", "sts", "--layers", "0", "--output", "{out}"], "with --layers 0 would do"),
        (["eval", "classification", "--layers", "0,0", "--output", "{out}"], "with --layers 0 would do"),
        (["eval", "retrieval", "--layers", "0", "--dims", "8", "--output", "{out}"], "with --layers 0 would do"),
    ],
    ids=lambda a: a if isinstance(a, str) else " ".join(a[:2]),
)
def test_pooling_at_the_static_cell_is_refused(tiny_dir, texts, tmp_path, capsys, monkeypatch, argv, needle):
    """Layer 0 is the static cell, which averages its token table and has no pooling to choose: --pooling did
    nothing (or the error was another one, found after the model loaded)."""
    from matryoshka2d.cli import args as cli_args

    monkeypatch.setattr(cli_args, "load_encoder", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    argv = [a.format(texts=texts, out=out) for a in argv]
    assert exit_code([*argv, "--model", tiny_dir, "--pooling", "cls"]) == 2
    line = error_line(capsys)
    assert f"--pooling cls {needle} nothing: layer 0 is the model's static cell" in line, line
    assert not out.exists()


def test_only_layer_0_makes_pooling_idle():
    from matryoshka2d.cli.args import only_static_layers

    assert only_static_layers(["0"]) and only_static_layers(["0,0"]) and only_static_layers(["0", "0-0"])
    assert not only_static_layers(["0", "2"]) and not only_static_layers(["0-1"]) and not only_static_layers(None)


def max_length_options():
    return [
        (" ".join(words), action)
        for words, parser in every_command(build_parser())
        for action in parser._actions
        if "--max-length" in action.option_strings
    ]


def test_every_max_length_leaves_room_for_a_token_of_text():
    """Every --max-length of every command: 2 leaves only [CLS] and [SEP] (every text the same vector), and 1 is
    ignored by the tokenizer (texts go in whole); both are refused where they are parsed."""
    options = max_length_options()
    assert len(options) >= 7  # eval x3, train, two-step, pretrain, distill, index build, serve
    accepted = []
    for command, action in options:
        for value in ("1", "2"):
            try:
                action.type(value)
                accepted.append(f"{command} --max-length {value}")
            except argparse.ArgumentTypeError as refused:
                assert "must be at least 3" in str(refused) and "[CLS] and [SEP]" in str(refused), command
        assert action.type("3") == 3, command
    assert not accepted, f"give these --max-length options type=matryoshka2d.cli.args.token_length: {accepted}"


def test_a_max_length_of_2_stops_at_parse_time_naming_the_option(tiny_dir, capsys):
    assert exit_code(["eval", "sts", "--model", tiny_dir, "--max-length", "2", "--output", "o"]) == 2
    line = error_line(capsys)
    assert "argument --max-length: must be at least 3, got 2" in line and "no token of text" in line
    assert exit_code(["eval", "sts", "--max-length", "-5", "--output", "o"]) == 2
    assert "argument --max-length: must be at least 1, got -5" in error_line(capsys)  # as before


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["eval", "sts", "--output", "o", "--layers", "3-1"], "--layers", "3-1"),
        (["eval", "classification", "--output", "o", "--layers", "1", "4-2"], "--layers", "4-2"),
        (["eval", "retrieval", "--output", "o", "--dims", "8,32-16"], "--dims", "32-16"),
        (["eval", "retrieval", "--output", "o", "--query-layer", "3-1"], "--query-layer", "3-1"),
        (["heads", "fit", "--data", "d", "--output", "o", "--layers", "3-1"], "--layers", "3-1"),
        (["report", "compression", "--output", "o", "--dims", "32-8", "64"], "--dims", "32-8"),
    ],
    ids=lambda a: a if isinstance(a, str) else " ".join(a[:2]),
)
def test_a_reversed_range_stops_at_parse_time(capsys, argv, flag, value):
    """A range LOW-HIGH with LOW > HIGH held no number: the option fell back to its default, silently."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2
    line = error_line(capsys)
    low, high = value.split("-")
    assert f"argument {flag}: '{value}' is a reversed range" in line and f"write {high}-{low}" in line, line


def test_a_malformed_layer_list_stops_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "sts", "--output", "o", "--layers", "a"])
    assert "argument --layers: 'a' is not a whole number or a range like 1-6" in error_line(capsys)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "sts", "--output", "o", "--layers", "-1"])
    assert "argument --layers: '-1': layers start at 0, got -1" in error_line(capsys)


def test_ranges_still_read_as_before():
    from matryoshka2d.evaluate.grid import parse_ints

    args = build_parser().parse_args(["eval", "sts", "--output", "o", "--layers", "1,3-4", "6", "--dims", "8-8"])
    assert parse_ints(args.layers, "layers") == [1, 3, 4, 6] and parse_ints(args.dims, "dims") == [8]
    args = build_parser().parse_args(["eval", "retrieval", "--output", "o", "--query-layer", "0", "2"])
    assert parse_ints(args.query_layer, "query-layer") == [0, 2]  # 0: the static cell's queries


def test_a_query_model_written_the_wrong_way_round_names_the_real_cause(tiny_dir, capsys):
    """--query-model DIR/tiny=q (the name after the folder) and =q (no name) were read as folders named so and
    refused as "not a query encoder"; a path holding '=' still reads whole (see test_rules_outputs_options_results)."""
    from matryoshka2d.cli.args import named_folder

    with pytest.raises(argparse.ArgumentTypeError, match=f"the name goes before the folder: write q={tiny_dir}"):
        named_folder(f"{tiny_dir}=q")
    with pytest.raises(argparse.ArgumentTypeError, match="no name before '='"):
        named_folder("=q")
    serve = ["serve", "--model", tiny_dir, "--pooling", "mean", "--port", "0", "--query-model"]
    assert exit_code([*serve, f"{tiny_dir}=q"]) == 2
    line = error_line(capsys)
    assert f"--query-model '{tiny_dir}=q': no folder of that name; the name goes before the folder" in line, line
    assert exit_code([*serve, "=q"]) == 2
    assert "--query-model '=q': no name before '='" in error_line(capsys)


def test_a_folder_whose_name_holds_an_equals_sign_is_still_a_folder(tmp_path, monkeypatch):
    from matryoshka2d.cli.args import named_folder

    (tmp_path / "=q").mkdir()
    (tmp_path / "runs" / "tiny=q").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert named_folder("=q") == ("", "=q")
    assert named_folder("runs/tiny=q") == ("", "runs/tiny=q")


# ---- 3. an output folder that cannot be written is refused before any work ---------------------------------------

# Arguments of every command that declares an output (cli.args.reads_and_writes), its output under RO, a folder that
# cannot be written. A command added later without an entry here fails the test: add one.
OUTPUT_UNDER_RO = {
    ("encode",): ["--model", "{model}", "--input", "{texts}", "--output", "{ro}/vectors.npy"],
    ("eval", "sts"): ["--model", "{model}", "--output", "{ro}/results"],
    ("eval", "classification"): ["--model", "{model}", "--output", "{ro}/results"],
    ("eval", "retrieval"): ["--model", "{model}", "--output", "{ro}/results"],
    ("eval", "mteb"): ["--model", "{model}", "--output", "{ro}/results"],
    ("report",): ["{results}", "--output", "{ro}/report"],
    ("train",): ["--model", "{model}", "--data", "{texts}", "--output", "{ro}/run"],
    ("merge",): ["--models", "{model}", "{model}", "--output", "{ro}/merged"],
    ("two-step",): ["--model", "{model}", "--data", "{texts}", "--target-dim", "8", "--output", "{ro}/two-step"],
    ("pretrain",): ["--model", "{model}", "--data", "{texts}", "--output", "{ro}/pretrained"],
    ("heads", "fit"): ["--model", "{model}", "--data", "{texts}", "--output", "{ro}/heads"],
    ("distill",): ["--teacher", "{model}", "--data", "{texts}", "--output", "{ro}/student"],
    ("export",): ["--model", "{model}", "--layer", "2", "--dim", "16", "--output", "{ro}/export"],
    ("index", "build"): ["--model", "{model}", "--corpus", "{texts}", "--cells", "2:16", "--output", "{ro}/index"],
    ("search",): ["--index", "{results}", "--query", "red cat", "--output", "{ro}/hits.jsonl"],
    ("pick",): ["--results", "{results}", "--output", "{ro}/pick"],
    ("demo",): ["--model", "{model}", "--output", "{ro}/demo"],
}


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` as a user finds a folder they cannot write: chattr +i as root (whom permission bits do not stop),
    mode 555 otherwise; skipped where neither stops a write."""
    as_root = os.geteuid() == 0
    if as_root:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
            pytest.skip("cannot make a folder read-only here (chattr +i)")
    else:
        folder.chmod(0o555)
    try:
        try:
            os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT, 0o644))
            os.unlink(folder / "probe")
            pytest.skip("the folder could still be written")
        except OSError:
            pass
        yield folder
    finally:
        if as_root:
            subprocess.run(["chattr", "-i", str(folder)])
        else:
            folder.chmod(0o755)


def writing_commands():
    return [(words, p) for words, p in every_command(build_parser()) if p.get_default("output_option")]


def cases_under_ro():
    """(words, option, argv template) for every output option and every cache option of every writing command."""
    for words, parser in writing_commands():
        argv = OUTPUT_UNDER_RO.get(words)
        if argv is None:
            yield words, None, None
            continue
        yield words, parser.get_default("output_option"), [*words, *argv]
        for cache in parser.get_default("caches") or ():  # the output writable, the cache folder not
            yield words, cache, [*words, *[a.replace("{ro}", "{rw}") for a in argv], cache, "{ro}/cache"]


def test_every_writing_command_has_arguments_for_the_read_only_test():
    missing = [" ".join(words) for words, _ in writing_commands() if words not in OUTPUT_UNDER_RO]
    assert not missing, f"add the command's arguments to {__name__}.OUTPUT_UNDER_RO: {missing}"
    assert set(OUTPUT_UNDER_RO) <= {words for words, _ in writing_commands()}
    undeclared = [
        f"{' '.join(words)} {cache}"
        for words, parser in writing_commands()
        for cache in parser.get_default("caches") or ()
        if not any(cache in action.option_strings for action in parser._actions)
    ]
    assert not undeclared, f"caches declared (reads_and_writes) that are no option of the command: {undeclared}"


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tiny_dir, texts, tmp_path, capsys, monkeypatch):
    """Was: nine commands did their work and then printed a raw "[Errno 1] Operation not permitted"."""
    ran = []
    real_parser = cli.build_parser

    def parser_without_work():
        parser = real_parser()
        for _, p in every_command(parser):
            if p.get_default("func") is not None:
                p.set_defaults(func=lambda args: ran.append(args.command) or 0)
        return parser

    monkeypatch.setattr(cli, "build_parser", parser_without_work)
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "rw").mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    cases = list(cases_under_ro())
    assert all(option is not None for _, option, _ in cases), "a writing command has no OUTPUT_UNDER_RO entry"
    assert len(cases) >= len(OUTPUT_UNDER_RO) + 2  # index build --path and eval --doc-cache
    values = {"model": tiny_dir, "texts": texts, "results": results, "ro": ro, "rw": tmp_path / "rw"}
    with read_only(ro):
        for words, option, template in cases:
            argv = [a.format(**values) for a in template]
            assert exit_code(argv) == 2, argv
            line = error_line(capsys)
            assert line.startswith(f"matryoshka2d {words[0]}: error: {option} "), line
            assert "cannot be written" in line and "nothing was done" in line and "Errno" not in line, line
            assert os.listdir(ro) == []
    assert ran == []


# ---- 4. Ctrl-C: one line, exit 130, no half-written file ---------------------------------------------------------


def test_ctrl_c_during_encode_is_one_line_and_leaves_no_half_file(tiny_dir, texts, tmp_path, capsys, monkeypatch):
    """Was: a KeyboardInterrupt traceback, and OUTPUT's `.partial` file left behind."""
    from matryoshka2d.cli import encode

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(encode, "encode_chunk", interrupted)
    out = tmp_path / "out"
    argv = ["encode", "--model", tiny_dir, "--pooling", "mean", "--input", texts, "--output", out / "v.npy"]
    assert exit_code(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    said = [line for line in err.splitlines() if line.startswith("matryoshka2d")]
    assert len(said) == 1 and said[0].startswith("matryoshka2d encode: interrupted (Ctrl-C)"), err
    assert not out.exists() or os.listdir(out) == []
