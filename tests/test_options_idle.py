"""Options that would do nothing in the combination given are refused, naming them, before any work
(docs/reliability.md, rule 4): exit-head options without exit heads or with distill --mode static, --pooling
at layer 0, reducer options without --reducer, and the like."""

import pytest

from helpers.cli import error_line, exit_code
from matryoshka2d.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["--mode", "query", "--layer", "2", "--eval-cell", "3:16"],
            "--eval-cell 3:16: the query encoder of --layer 2",
        ),
        (["--temperature", "0.1"], "--temperature is the softmax temperature of --loss relational; --loss cos"),
        (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
    ],
)
def test_distill_options_that_would_do_nothing_are_refused(teacher_dir, text_file, tmp_path, capsys, extra, needle):
    out = tmp_path / "student"
    base = ["distill", "--teacher", str(teacher_dir), "--pooling", "mean", "--data", str(text_file), "--steps", "1"]
    base += ["--batch-size", "8", "--no-exclude-sts-test", "--quiet", "--output", str(out)]
    assert main([*base, *extra]) == 2
    assert needle in error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "--distill-weight", "0.5"], "--distill-weight would do nothing without --distill-from"),
        (["train", "--lora-alpha", "8", "--lora-dropout", "0.1"], "--lora-alpha and --lora-dropout would do nothing"),
        (["eval", "sts", "--reducer-corpus", "{text}"], "--reducer-corpus and --reducer-samples set how --reducer"),
        (["eval", "sts", "--reducer-samples", "10"], "they need --reducer"),
        (["eval", "retrieval", "--doc-cache", "{tmp}/cache"], "--doc-cache keeps the documents' pooled states"),
        (["heads", "fit", "--data", "{text}", "--select", "mse", "--ridge", "1"], "--select mse chooses the ridge"),
    ],
    ids=lambda a: a if isinstance(a, str) else " ".join(a[:2]),
)
def test_other_options_that_would_do_nothing_are_refused(model, text_file, tmp_path, capsys, args, needle):
    out = tmp_path / "out"
    args = [a.format(text=text_file, tmp=tmp_path) for a in args]
    args += ["--model", str(model), "--pooling", "mean", "--output", str(out)]
    if args[0] == "train":
        args += ["--data", str(text_file), "--steps", "1"]
    assert main(args) == 2
    assert needle in error_line(capsys)
    assert not out.exists()


def test_exit_head_options_without_exit_heads_are_refused(tiny_dir, triplets, tmp_path, capsys):
    base = ["train", "--model", str(tiny_dir), "--pooling", "mean", "--data", str(triplets), "--steps", "1"]
    for flag, value in (("--exit-heads-lr", "1e-3"), ("--exit-heads-inputs", "stack")):
        assert main([*base, "--output", str(tmp_path / flag), flag, value]) == 2
        assert f"{flag} set how exit heads train; they need --exit-heads" in capsys.readouterr().err
        assert not (tmp_path / flag).exists()


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

    assert only_static_layers([0]) and only_static_layers([0, 0])
    assert not only_static_layers([0, 2]) and not only_static_layers([2]) and not only_static_layers(None)
    layers = build_parser().parse_args(["eval", "sts", "--output", "o", "--layers", "0", "0-0"]).layers
    assert layers == [0] and only_static_layers(layers)  # the ranges are read where they are parsed


def test_search_refuses_another_pooling_for_a_query_model(tmp_path, capsys):
    args = ["search", "--index", str(tmp_path / "idx"), "--query", "red cat", "--query-model", str(tmp_path / "q")]
    assert main([*args, "--pooling", "cls"]) == 2
    assert "--pooling cls with --query-model" in error_line(capsys)


def test_eval_refuses_a_reducer_on_the_onnx_backend(model, tmp_path, capsys):
    args = ["eval", "sts", "--model", str(model), "--pooling", "mean", "--backend", "onnx", "--reducer", "pca"]
    assert main([*args, "--output", str(tmp_path / "o")]) == 2
    assert "--reducer pca reduces the vectors torch computes; it does not run on --backend onnx" in error_line(capsys)
    assert not (model / "onnx-serve").exists() and not (tmp_path / "o").exists()
