"""Where a command will write is checked before any work: never over one of its inputs, directly or through a
link (docs/reliability.md, rule 1: cli.args.check_outputs, and training.rundir.RunDir.check for a --config
file's output), never the current folder by an empty name, and never a folder it cannot write."""

import os

import pytest

from helpers.cli import error_line, every_command, exit_code, folder_bytes
from helpers.mounts import HOW_A_FOLDER_REFUSES, refusing
from matryoshka2d import cli
from matryoshka2d.cli import build_parser, main
from matryoshka2d.cli.args import check_outputs
from matryoshka2d.outputs import TEMPORARY_MARK

# ---- never over an input (rule 1) ------------------------------------------------------------------------------------


def test_distill_never_replaces_its_teacher_directly_or_through_a_link(model, text_file, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)
    before = folder_bytes(model)
    base = ["distill", "--pooling", "mean", "--data", str(text_file), "--steps", "1", "--quiet", "--overwrite"]
    base += ["--no-exclude-sts-test"]
    cases = [
        (model, model, "is"),
        (model, link, "is"),  # --output a link to the teacher
        (link, model, "is"),  # --teacher through a link
        (model, model / "student", "is inside"),
        (model, tmp_path, "holds"),
    ]
    for teacher, output, how in cases:
        assert main([*base, "--teacher", str(teacher), "--output", str(output)]) == 2
        line = error_line(capsys)
        assert f"--output {output}" in line and f" {how} --teacher {teacher}" in line, line
        assert "nothing was written" in line
    assert folder_bytes(model) == before
    assert not (model / "student").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--model", "{model}", "--data", "{text}", "--output", "{model}", "--overwrite"],
        ["train", "--model", "{model}", "--data", "{text}", "--output", "{model}/run"],
        ["train", "--model", "{model}", "--data", "{text}", "--output", "{text_dir}", "--overwrite"],
        ["merge", "--models", "{model}", "{model}", "--output", "{model}", "--overwrite"],
        ["heads", "fit", "--model", "{model}", "--data", "{text}", "--output", "{model}", "--overwrite"],
        ["export", "--model", "{model}", "--layer", "1", "--dim", "8", "--output", "{model}", "--overwrite"],
        ["index", "build", "--model", "{model}", "--corpus", "{text}", "--cells", "1:8", "--output", "{model}"],
        ["index", "build", "--model", "{model}", "--corpus", "{text}", "--cells", "1:8", "--output", "{text_dir}"],
        ["pretrain", "--model", "{model}", "--data", "{text}", "--output", "{model}", "--overwrite"],
        ["two-step", "--model", "{model}", "--data", "{text}", "--target-dim", "8", "--output", "{model}"],
        ["eval", "sts", "--model", "{model}", "--reducer", "pca", "--reducer-corpus", "{out}/results.csv"],
        ["eval", "mteb", "--model", "{model}", "--task-dir", "{out}/results.csv"],  # an STS file as a task
        ["search", "--index", "{model}", "--queries", "{text}", "--output", "{text}"],
        ["search", "--index", "{model}", "--queries", "{text}", "--output", "{out}/hard-link.txt"],
        ["index", "build", "--model", "{model}", "--corpus", "{text}", "--backend", "qdrant", "--path", "{model}"],
        ["eval", "retrieval", "--model", "{model}", "--cascade", "1:8,4:32", "--doc-cache", "{model}"],
        ["encode", "--model", "{model}", "--input", "{text}", "--output", "{text}"],
        ["pick", "--results", "{out}/pick.json"],  # pick writes pick.json beside its results
        ["report", "{out}/report.md", "{out}/report.md", "--output", "{out}"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_every_writing_command_refuses_an_output_over_an_input(model, tmp_path, capsys, command):
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    text = text_dir / "texts.txt"
    text.write_text("red cat\nblue dog\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.csv", "pick.json", "report.md"):
        (out / name).write_text("what the command reads\n")
    os.link(text, out / "hard-link.txt")  # the queries under another name
    args = [a.format(model=model, text=text, text_dir=text_dir, out=out) for a in command]
    if args[0] == "eval":
        args += ["--pooling", "mean", "--output", str(out)]
    if args[:2] == ["index", "build"] and "--output" not in args:
        args += ["--cells", "1:8", "--output", str(out / "idx")]
    before = folder_bytes(tmp_path)
    assert exit_code(args) == 2
    line = error_line(capsys)
    assert "nothing was written" in line, line
    assert folder_bytes(tmp_path) == before


def test_export_never_replaces_the_model_it_reads(planted, capsys):
    before = {p.name: p.read_bytes() for p in planted.iterdir() if p.is_file()}
    for output in (planted, planted / "cell", planted.parent):
        args = ["export", "--model", str(planted), "--layer", "2", "--dim", "16", "--output", str(output)]
        assert main([*args, "--overwrite"]) == 2
        assert f"--model {planted}" in capsys.readouterr().err  # rule 1: is, is inside, holds
    assert {p.name: p.read_bytes() for p in planted.iterdir() if p.is_file()} == before
    assert not (planted / "cell").exists()


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


def test_an_empty_output_is_not_the_current_folder(model, text_file, capsys):
    assert main(["heads", "fit", "--model", str(model), "--data", str(text_file), "--output", ""]) == 2
    assert "--output is empty" in error_line(capsys)


def test_a_config_file_cannot_name_an_output_over_an_input(model, text_file, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {model}\ndata: [{text_file}]\noutput: {model}\n")
    before = folder_bytes(model)
    assert main(["train", "--config", str(config), "--pooling", "mean", "--steps", "1", "--overwrite"]) == 2
    assert f"--output {model} is --model {model}" in error_line(capsys)
    assert folder_bytes(model) == before


def test_results_may_be_written_inside_the_model_folder_they_describe(model, tmp_path):
    """`eval --output RUN/sts` is the documented layout (the model card reads it there); it neither is nor holds
    an input, so it is allowed; the model folder itself, or a folder holding it, is not (issue 52)."""
    parser = build_parser()
    check_outputs(parser.parse_args(["eval", "sts", "--model", str(model), "--output", str(model / "sts")]))
    check_outputs(parser.parse_args(["pick", "--results", str(model / "sts"), "--output", str(model / "sts")]))
    with pytest.raises(ValueError, match="is --model"):  # into the model folder itself: its files are inputs
        check_outputs(parser.parse_args(["eval", "sts", "--model", str(model), "--output", str(model)]))
    (model / "no-heads").mkdir()
    with pytest.raises(ValueError, match="no-heads is --model"):  # --compare-heads writes OUTPUT/no-heads
        check_outputs(parser.parse_args(["eval", "sts", "--model", str(model / "no-heads"), "--output", str(model)]))


def test_every_command_with_an_output_says_what_it_reads():
    """A new command with --output cannot skip rule 1: each declares its inputs (cli.args.reads_and_writes)."""

    undeclared = [
        " ".join(path)
        for path, parser in every_command(build_parser())
        if any("--output" in a.option_strings for a in parser._actions) and not parser.get_default("reads")
    ]
    assert undeclared == []


# ---- never into a folder that cannot be written ----------------------------------------------------------------------


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


@pytest.mark.parametrize("how", HOW_A_FOLDER_REFUSES)
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    tiny_dir, texts, tmp_path, capsys, monkeypatch, how
):
    """Was: nine commands did their work and then printed a raw "[Errno 1] Operation not permitted" (an immutable
    folder); an append-only folder got that error naming the probe file `.probe.m2d-tmp-...`, left behind; a full
    file system failed at the first write after the work with "[Errno 28] No space left on device" naming no file.
    Every output and cache option of every command, in a folder that is immutable, append-only or full: refused
    before any work, one line naming the option, and the folder left as it was (no probe file)."""
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
    cases = list(cases_under_ro())
    assert all(option is not None for _, option, _ in cases), "a writing command has no OUTPUT_UNDER_RO entry"
    assert len(cases) >= len(OUTPUT_UNDER_RO) + 2  # index build --path and eval --doc-cache
    values = {"model": tiny_dir, "texts": texts, "results": results, "ro": ro, "rw": tmp_path / "rw"}
    with refusing(ro, how) as left:
        for words, option, template in cases:
            argv = [a.format(**values) for a in template]
            assert exit_code(argv) == 2, argv
            line = error_line(capsys)
            assert line.startswith(f"matryoshka2d {words[0]}: error: {option} "), line
            assert "cannot be written" in line and "nothing was done" in line and "Errno" not in line, line
            assert TEMPORARY_MARK not in line, line
            assert sorted(os.listdir(ro)) == left, (argv, os.listdir(ro))
    assert ran == []
