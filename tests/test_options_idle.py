"""Options that would do nothing in the combination given are refused, naming them, before any work
(docs/reliability.md, rule 4): exit-head options without exit heads or with distill --mode static, --pooling
at layer 0, reducer options without --reducer, and the like."""

import pytest

from helpers.cli import error_line, every_command, exit_code
from matryoshka2d.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["--mode", "query", "--layer", "2", "--eval-cell", "3:16"],
            "--eval-cell 3:16: the query encoder of --layer 2",
        ),
        (
            ["--mode", "query", "--layer", "2", "--eval-cell", "1:16"],
            "--eval-cell 1:16: the query encoder of --layer 2 has 2 layers and is saved as its cell at layer 2",
        ),
        # the static cell (layer 0) is what trains; --eval-cell evaluated the teacher's frozen layers, every time alike
        (["--mode", "static", "--eval-cell", "2:16"], "--eval-cell 2:16 would evaluate the teacher's frozen layers"),
        (
            ["--exit-heads", "identity", "--exit-heads-sentences", "50"],
            "--exit-heads identity starts from the identity",
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


# ---- what the save refuses is refused before the first step ----------------------------------------------------------


@pytest.fixture(scope="module")
def stacked_teacher(tmp_path_factory):
    """A tiny random BERT (4 layers of 8 numbers) on a word-piece vocabulary of WORDS (a static cell's table is a few
    rows), with exit heads that read the stacked layers 0..exit, saved as a model folder."""
    import torch
    import transformers as tf

    from helpers.data import WORDS
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.heads import ExitHeads

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    tokenizer = tf.BertTokenizerFast(vocab={piece: i for i, piece in enumerate(vocabulary)})
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=len(vocabulary),
        hidden_size=8,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=16,
        hidden_dropout_prob=0.0,
        initializer_range=0.2,
    )
    encoder = ElasticEncoder.from_modules(tf.AutoModel.from_config(config).eval(), tokenizer, pooling="mean")
    encoder.set_exit_heads(ExitHeads.identity([1, 2, 3], 8, 8, inputs="stack"))
    folder = tmp_path_factory.mktemp("stacked") / "teacher"
    encoder.save(folder)
    return folder


def head_choices(command: str) -> list[list[str]]:
    """Every combination of the values of `command`'s options that shape the exit heads a run saves: each option
    with choices whose flag starts with --exit-heads, not given or at each choice, walked from the parser (an option
    or a choice added later is in it)."""
    import itertools

    parser = dict(every_command(build_parser()))[tuple(command.split())]
    options = [a for a in parser._actions if a.choices and a.option_strings[0].startswith("--exit-heads")]
    values = [[[]] + [[a.option_strings[0], str(choice)] for choice in a.choices] for a in options]
    return [list(itertools.chain(*combination)) for combination in itertools.product(*values)]


def refused_before_work_or_saved(monkeypatch, argv, out) -> str:
    """Run `argv` with its optimizer steps left out: "refused" when it exits 2 before any work (the run folder
    prepared, the teacher's targets computed, heads fitted), "saved" when the model it saved loads; a refusal
    after the work fails."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.training.run_loop import RunLoop

    worked = []
    prepare = RunLoop.prepare_run
    monkeypatch.setattr(RunLoop, "prepare_run", lambda self, *a: (worked.append(1), prepare(self, *a))[1])
    monkeypatch.setattr(RunLoop, "steps", lambda self, log, bar: None)
    code = exit_code([*argv, "--output", out])
    if code == 2:
        assert not worked and not out.exists(), f"refused after the work: {' '.join(map(str, argv))}"
        return "refused"
    assert code == 0, argv
    ElasticEncoder(str(out), device="cpu")
    return "saved"


def test_every_combination_distill_would_refuse_at_its_save_is_refused_before_the_work(
    stacked_teacher, corpus, sts_dev, tmp_path, monkeypatch, capsys
):
    """--mode query --exit-heads-inputs stack (or the teacher's stacked heads kept) trained the whole run and was
    refused at the save: a query encoder is saved cut to its layer with that layer's head as a Dense module, which
    reads one layer. Every mode with every combination of the exit-head options either stops before any work or
    saves a model that loads."""
    parser = dict(every_command(build_parser()))[("distill",)]
    modes = next(a.choices for a in parser._actions if "--mode" in a.option_strings)
    base = ["distill", "--teacher", stacked_teacher, "--data", corpus, "--batch-size", "8"]
    base += ["--steps", "1", "--no-exclude-sts-test", "--eval-file", sts_dev, "--quiet"]
    outcome = {}
    for n, (mode, heads) in enumerate((m, h) for m in modes for h in head_choices("distill")):
        layer = ["--layer", "2"] if mode == "query" else []
        argv = [*base, "--mode", mode, *layer, *heads]
        outcome[(mode, *heads)] = refused_before_work_or_saved(monkeypatch, argv, tmp_path / str(n))
        capsys.readouterr()
    assert outcome[("query", "--exit-heads-inputs", "stack")] == "refused"
    assert outcome[("query", "--exit-heads", "keep")] == "refused"  # the teacher's heads read stacked layers
    assert outcome[("query", "--exit-heads", "fit", "--exit-heads-inputs", "exit")] == "saved"
    assert outcome[("shared", "--exit-heads-inputs", "stack")] == "saved"  # a whole model holds stacked heads


def test_every_combination_train_would_refuse_at_its_save_is_refused_before_the_work(
    stacked_teacher, triplets, sts_dev, tmp_path, monkeypatch, capsys
):
    """The same for `train`'s methods whose model is saved cut to fewer layers (separate --layer n)."""
    from matryoshka2d.methods import METHODS

    cut = [name for name, method in METHODS.items() if isinstance(getattr(method, "keep_layers", None), property)]
    assert cut == ["separate"]
    base = ["train", "--model", stacked_teacher, "--data", triplets, "--batch-size", "8", "--steps", "1"]
    base += ["--eval-file", sts_dev, "--quiet", "--layer", "2"]
    outcome = {}
    for n, (method, heads) in enumerate((m, h) for m in cut for h in head_choices("train")):
        outcome[(method, *heads)] = refused_before_work_or_saved(
            monkeypatch, [*base, "--method", method, *heads], tmp_path / str(n)
        )
        capsys.readouterr()
    assert outcome[("separate", "--exit-heads", "fit", "--exit-heads-inputs", "stack")] == "refused"
    assert outcome[("separate", "--exit-heads", "fit", "--exit-heads-inputs", "exit")] == "saved"
