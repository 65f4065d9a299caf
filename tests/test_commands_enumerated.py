"""The rules of docs/reliability.md hold by construction (issue 52, item 4), shown by tests that enumerate what exists
rather than a list of cases:

(a) every command of `matryoshka2d --help` (the parsers walked) has an invocation here, or the test fails; for
    every output option a command declares, the output pointed at each of the command's input files (every file of
    an input folder included), at a symbolic link to one, at a hard link to one, and at each input folder ends in
    exit 2 naming the option, with every input byte for byte intact; and a clean run of the command leaves only
    files that came from the one writer (`matryoshka2d.outputs`: no write-mode `open` outside its temporary names,
    and every file new or changed in the workspace announced by its `matryoshka2d.write` audit event).
(b) every folder kind the toolkit writes is tampered with (each file replaced by a link out; each name a JSON file
    in it gives pointed out by `..`, an absolute path and a link) and loaded by its readers under a Python audit
    hook that fails the test on any open of the decoy outside the folder.
(c) the cache key: tests/test_cache_keys.py.

A throw-away command that writes with plain `open()` makes (a) fail: the tests bite.
"""

import contextlib
import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

from helpers.audit import announced, opened_for_writing, opened_under, recording
from helpers.cli import every_command, exit_code
from helpers.data import beir, sts_tree, write_triplets
from helpers.mounts import bind_mount
from matryoshka2d import cli
from matryoshka2d.cli import build_parser
from matryoshka2d.cli.args import input_paths, reads_and_writes
from matryoshka2d.outputs import TEMPORARY_MARK, is_writer_temporary


def state(root: Path) -> dict[str, tuple]:
    """Every file and link under `root`: its bytes' identity (size, mtime, inode) or the link's target."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            st = path.stat()
            out[str(path)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def contents(paths) -> dict[str, bytes]:
    return {str(p): Path(p).read_bytes() for p in paths}


def writes_outside_the_writer(events, before: dict, after: dict, root: Path) -> list[str]:
    """What a command did that the one writer did not: write-mode opens under `root` outside its temporary names
    (or an append it announced), and files new or changed under `root` that no commit of the writer covers."""
    appended = {Path(p) for p in announced(events, "append")}
    committed = [Path(p) for p in announced(events, "write")] + list(appended)
    problems = [
        f"opened for writing outside the writer: {path}"
        for path in opened_for_writing(events)
        if path.is_relative_to(root) and not is_writer_temporary(path) and path not in appended
    ]
    for path, value in after.items():
        if before.get(path) == value or is_writer_temporary(path):
            continue
        if not any(Path(path) == c or Path(path).is_relative_to(c) for c in committed):
            problems.append(f"left by no commit of the writer: {path}")
    return problems


class Work:
    def __init__(self, root: Path):
        self.root = root
        self.inputs = root / "in"
        self.out = root / "out"


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_dir, files, text_file):
    root = tmp_path_factory.mktemp("rules-by-construction")
    w = Work(root)
    i = w.inputs
    i.mkdir()
    w.model = shutil.copytree(tiny_dir, i / "model")
    w.texts = Path(shutil.copy(text_file, i / "texts.txt"))
    w.triplets = write_triplets(i / "triplets.tsv", 16)
    w.dev = Path(shutil.copy(files / "dev.tsv", i / "dev.tsv"))
    w.data = sts_tree(i / "data")
    shutil.copy(w.dev, w.data / "sts" / "raw" / "stsb_dev.tsv")
    env = pytest.MonkeyPatch()
    env.setenv("MATRYOSHKA2D_DATA", str(w.data))  # the default STS dev and test sets: the workspace's tiny ones
    env.setenv("MATRYOSHKA2D_CACHE", str(root / "cache"))  # caches the commands keep are watched too
    classification = w.data / "classification"
    classification.mkdir(parents=True)
    rows = [f"{'red cat' if k % 2 else 'blue dog'} {k}\t{k % 2}" for k in range(24)]
    (classification / "toy_train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:16]) + "\n")
    (classification / "toy_test.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[16:]) + "\n")
    corpus = [{"_id": f"d{k}", "title": "", "text": f"text {k} about {c}"} for k, c in enumerate("abcdefghijklmnop")]
    queries = [{"_id": f"q{k}", "text": f"about {c}"} for k, c in enumerate("abcdefghijkl")]
    w.beir = beir(i / "beir", corpus, queries, [(f"q{k}", f"d{k}", 1) for k in range(12)], split="test")
    w.corpus = w.beir / "corpus.jsonl"
    build = ["index", "build", "--model", w.model, "--pooling", "mean", "--corpus", w.corpus, "--cells", "4:32"]
    assert exit_code([*build, "--output", i / "index"]) == 0
    w.index = i / "index"
    evaluate = ["eval", "sts", "--model", w.model, "--pooling", "mean", "--data-dir", w.data, "--layers", "2,4"]
    assert exit_code([*evaluate, "--dims", "16,32", "--quiet", "--output", i / "results"]) == 0
    w.results = i / "results"
    w.results2 = shutil.copytree(w.results, i / "results2")
    train = ["train", "--model", w.model, "--pooling", "mean", "--data", w.triplets, "--eval-file", w.dev]
    assert exit_code([*train, "--steps", "1", "--batch-size", "4", "--quiet", "--output", i / "run"]) == 0
    w.run = i / "run"
    w.run2 = shutil.copytree(w.run, i / "run2")
    w.out.mkdir()
    yield w
    env.undo()


# Every command of the parser, as a user runs it on the workspace; OUT is the output under test. A command added
# later without an entry here fails `test_every_command_has_an_invocation`. None: the command writes nothing
# (its clean run is still watched); serve is a long-running process (tests/test_serve*.py).
def invocations(w: Work) -> dict[tuple[str, ...], list | None]:
    tiny = ["--pooling", "mean"]
    quick = ["--steps", "1", "--batch-size", "4", "--quiet"]
    cell = ["--layers", "4", "--dims", "32", "--quiet"]
    return {
        ("info",): ["info", w.model, *tiny],
        ("encode",): ["encode", "--model", w.model, *tiny, "--input", w.texts, "--output", "OUT"],
        ("models",): None,  # a group: `models list` or `models prepare`
        ("models", "list"): ["models", "list"],
        ("models", "prepare"): None,  # unpacks the mpnet-base wheels, which tests do not install
        ("eval", "sts"): ["eval", "sts", "--model", w.model, *tiny, "--data-dir", w.data, *cell, "--output", "OUT"],
        ("eval", "classification"): [
            *["eval", "classification", "--model", w.model, *tiny, "--data-dir", w.data, "--folds", "2"],
            *[*cell, "--output", "OUT"],
        ],
        ("eval", "retrieval"): [
            *["eval", "retrieval", "--model", w.model, *tiny, "--dataset-dir", w.beir, *cell, "--output", "OUT"]
        ],
        ("eval", "mteb"): [
            *["eval", "mteb", "--model", w.model, *tiny, "--task-dir", w.beir, "--cells", "4x32", "--quiet"],
            *["--output", "OUT"],
        ],
        ("report",): ["report", w.results, w.results2, "--output", "OUT"],
        ("train",): [
            *["train", "--model", w.model, *tiny, "--data", w.triplets, "--eval-file", w.dev, *quick, "--output", "OUT"]
        ],
        ("merge",): ["merge", "--models", w.run, w.run2, "--output", "OUT"],
        ("two-step",): [
            *["two-step", "--model", w.model, *tiny, "--data", w.texts, "--loss", "simcse", "--target-dim", "8"],
            *["--candidate-dims", "8", "--steps", "1", "--pooler-steps", "1", "--batch-size", "8", "--save-steps", "0"],
            *["--validation-file", w.dev, "--report-file", w.dev, "--quiet", "--output", "OUT"],
        ],
        ("pretrain",): [
            *["pretrain", "--model", w.model, *tiny, "--data", w.texts, "--eval-file", w.dev, *quick, "--output", "OUT"]
        ],
        ("heads", "fit"): [
            *["heads", "fit", "--model", w.model, *tiny, "--data", w.texts, "--select", "mse", "--max-sentences"],
            *["60", "--quiet", "--output", "OUT"],
        ],
        ("distill",): [
            *["distill", "--teacher", w.model, *tiny, "--data", w.texts, "--eval-file", w.dev, "--steps", "1"],
            *["--no-exclude-sts-test", "--quiet", "--output", "OUT"],
        ],
        ("export",): ["export", "--model", w.model, *tiny, "--layer", "2", "--dim", "16", "--output", "OUT"],
        ("serve",): None,
        ("index", "build"): [
            *["index", "build", "--model", w.model, *tiny, "--corpus", w.corpus, "--cells", "4:32", "--output", "OUT"]
        ],
        ("search",): ["search", "--index", w.index, "--queries", w.texts, "--top-k", "3", "--output", "OUT"],
        ("pick",): ["pick", "--results", w.results, "--model", w.model, "--batch", "4", "--output", "OUT"],
        ("demo",): None,  # tests/test_demo.py runs the whole loop; its outputs are checked by (a)'s refusals below
    }


# Commands not run here still have their refusals checked (the command itself never runs: see `never_run`).
REFUSAL_ONLY = {
    ("demo",): lambda w: ["demo", "--model", w.model, "--pooling", "mean", "--data-dir", w.data],
    ("serve",): lambda w: ["serve", "--model", w.model, "--pooling", "mean", "--backend", "onnx"],
}


def commands_of(parser):
    """(words, parser) of every command under `parser` that runs something (a group that only holds others
    does not)."""
    return [(words, sub) for words, sub in every_command(parser) if "func" in sub._defaults]


def commands():
    return [words for words, _ in commands_of(build_parser())]


def test_every_command_has_an_invocation(work):
    table = invocations(work)
    missing = [" ".join(words) for words in commands() if words not in table]
    assert not missing, f"commands with no invocation in {__name__}.invocations: {missing}"


def output_options(argv) -> list[str]:
    """The options through which the command writes: its output and its cache folders (reads_and_writes)."""
    args = build_parser().parse_args([str(a) for a in argv])
    option = getattr(args, "output_option", None)
    return ([option] if option else []) + list(getattr(args, "caches", ()))


def input_files(argv) -> tuple[list[Path], list[Path]]:
    """(the files, the folders) the command reads, as its options declare them (a folder: every file in it)."""
    args = build_parser().parse_args([str(a) for a in argv])
    found, folders = [], []
    for _, path in input_paths(args):
        path = Path(path)
        if path.is_dir():
            folders.append(path)
            found += [p for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()]
        elif path.is_file():
            found.append(path)
    return sorted(set(found)), folders


def with_output(argv, option: str, target) -> list:
    argv = [str(a) for a in argv]
    if option in argv:
        at = argv.index(option)
        argv = argv[:at] + argv[at + 2 :]
    return [*argv, option, str(target)]


def refusal_cases(links: Path, argv):
    """(label, option, output) for every output option: each input file, a link to it, a hard link to it, and each
    input folder; the links are made in `links` (on the inputs' file system, for the hard links)."""
    files, folders = input_files(argv)
    assert files, f"{argv[:2]} declares no input the test can find"
    links.mkdir(exist_ok=True)
    for option in output_options(argv):
        for n, file in enumerate(files):
            yield f"{option} = input {file.name}", option, file
            link = links / f"sym-{option.strip('-')}-{n}"
            if not link.is_symlink():
                link.symlink_to(file)
            yield f"{option} = a link to {file.name}", option, link
            hard = links / f"hard-{option.strip('-')}-{n}"
            if not hard.exists():
                os.link(file, hard)
            yield f"{option} = a hard link to {file.name}", option, hard
        for folder in folders:
            yield f"{option} = input folder {folder.name}", option, folder


def refusal_argvs(work):
    table = invocations(work)
    for words, argv in table.items():
        if argv is not None:
            yield words, argv
    for words, make in REFUSAL_ONLY.items():
        yield words, make(work)


@pytest.fixture
def never_run(monkeypatch):
    """Every command's function replaced by one that fails the test: a refusal must come before any work."""
    real = cli.build_parser

    def stubbed():
        parser = real()
        for words, sub in commands_of(parser):
            sub.set_defaults(func=lambda args, words=words: pytest.fail(f"{' '.join(words)} ran: not refused first"))
        return parser

    monkeypatch.setattr(cli, "build_parser", stubbed)


@pytest.mark.parametrize("words", [w for w in commands()], ids=" ".join)
def test_an_output_over_any_input_is_refused_with_every_input_intact(work, words, tmp_path, never_run, capsys):
    argv = dict(refusal_argvs(work)).get(words)
    if argv is None or not output_options(argv):
        pytest.skip(f"{' '.join(words)} writes nothing: no output option")
    files, _ = input_files(argv)
    before = contents(files)
    for label, option, target in refusal_cases(tmp_path / "links", argv):
        code = exit_code(with_output(argv, option, target))
        err = capsys.readouterr().err
        assert code == 2, f"{' '.join(words)}: {label}: exit {code}\n{err}"
        assert "Traceback" not in err and option in err, (label, err)
        assert TEMPORARY_MARK not in err, (label, err)  # the user's path, never the writer's temporary one
        assert contents(files) == before, f"{' '.join(words)}: {label} changed an input"


def second_name_cases(alias: Path, inputs: Path, argv):
    """(label, option, output by its own path, output by a second name) for every output option, the second name
    through `alias`, a second name of the folder `inputs` that holds every input (a bind mount: no link anywhere,
    another path): each input folder, a new folder inside it, and the folder holding every input."""
    _, folders = input_files(argv)
    for option in output_options(argv):
        for folder in folders:
            other = alias / folder.relative_to(inputs)
            yield f"{option} = input folder {folder.name}", option, folder, other
            yield f"{option} = a new folder inside input folder {folder.name}", option, folder / "x", other / "x"
        yield f"{option} = the folder holding every input", option, inputs, alias


@pytest.fixture
def runs_recorded(monkeypatch):
    """Every command's function replaced by one that records that it ran (and does nothing)."""
    ran: list[str] = []
    real = cli.build_parser

    def stubbed():
        parser = real()
        for words, sub in commands_of(parser):
            sub.set_defaults(func=lambda args, words=words: ran.append(" ".join(words)) or 0)
        return parser

    monkeypatch.setattr(cli, "build_parser", stubbed)
    return ran


@pytest.mark.parametrize("words", [w for w in commands()], ids=" ".join)
def test_an_output_seen_under_a_second_name_is_judged_as_under_its_own(work, words, tmp_path, runs_recorded, capsys):
    """Was: a bind mount of the model's folder (or of its parent) is neither the same resolved path nor a file's
    inode, so `export --overwrite` through it deleted the model. Folders are compared by device and inode along the
    whole chain (is, holds, lies inside): every output and cache option of every command, pointed at an input
    folder, inside one and at the folder holding them by a second name, is refused exactly when it is by its own
    path, naming the option and the second name."""
    argv = dict(refusal_argvs(work)).get(words)
    if argv is None or not output_options(argv):
        pytest.skip(f"{' '.join(words)} writes nothing: no output option")
    files, _ = input_files(argv)
    before = contents(files)
    with bind_mount(work.inputs, tmp_path / "alias") as alias:
        for label, option, own, second in second_name_cases(alias, work.inputs, argv):
            expected = exit_code(with_output(argv, option, own))
            capsys.readouterr()
            code = exit_code(with_output(argv, option, second))
            err = capsys.readouterr().err
            assert code == expected, (
                f"{' '.join(words)}: {label}: exit {code} by a second name, {expected} by its own\n{err}"
            )
            if code == 2:
                assert "Traceback" not in err and option in err and "another name" in err, (label, err)
            assert contents(files) == before, f"{' '.join(words)}: {label} changed an input"


def no_file_cases(place: Path):
    """Destinations that are neither a file nor a folder, as a user may give them: a FIFO, the system's /dev/null
    (which the command must never run to reach: `never_run`), a link to /dev/stdout (standard output, whatever it
    leads to under the test's capture)."""
    fifo = place / "fifo"
    os.mkfifo(fifo)
    stdout = place / "stdout"
    stdout.symlink_to("/dev/stdout")
    return [("a FIFO", fifo), ("/dev/null", Path("/dev/null")), ("a link to /dev/stdout", stdout)]


def what_stands_at(path: Path):
    st = os.lstat(path)
    return (st.st_mode, st.st_rdev, st.st_ino, os.readlink(path) if path.is_symlink() else None)


@pytest.mark.parametrize("words", [w for w in commands()], ids=" ".join)
def test_an_output_that_is_no_file_or_folder_is_refused_and_left_as_it_is(work, words, tmp_path, never_run, capsys):
    """Was: a character device, a FIFO or a link to /dev/stdout given as an output was replaced by a regular file
    (as root, `--output /dev/null` would have replaced the system's). Every output and cache option of every
    command: exit 2 naming the option and what stands there, and it stands there unchanged."""
    argv = dict(refusal_argvs(work)).get(words)
    if argv is None or not output_options(argv):
        pytest.skip(f"{' '.join(words)} writes nothing: no output option")
    cases = no_file_cases(tmp_path)
    before = {str(path): what_stands_at(path) for _, path in cases}
    for option in output_options(argv):
        for label, target in cases:
            code = exit_code(with_output(argv, option, target))
            err = capsys.readouterr().err
            assert code == 2, f"{' '.join(words)}: {option} = {label}: exit {code}\n{err}"
            assert "Traceback" not in err and f"{option} {target}" in err and "not a file or folder" in err, err
    assert {str(path): what_stands_at(path) for _, path in cases} == before


def check_clean_run(work, argv) -> list[str]:
    """Run the command into a fresh output under the audit hook; what it did outside the one writer."""
    out = work.out / f"run-{len(list(work.out.iterdir()))}"
    out.mkdir()
    single_file = build_parser().parse_args([str(a) for a in argv]).__dict__.get("output_files") == ("",)
    argv = [a if a != "OUT" else out / ("result.txt" if single_file else "result") for a in argv]
    before = state(work.root)
    with recording() as events:
        code = exit_code(argv)
    assert code == 0, f"{argv[:2]}: exit {code}"
    return writes_outside_the_writer(events, before, state(work.root), work.root)


@pytest.mark.parametrize("words", [w for w in commands()], ids=" ".join)
def test_a_clean_run_writes_only_through_the_one_writer(work, words, monkeypatch, capsys):
    argv = invocations(work).get(words)
    if argv is None:
        pytest.skip(f"{' '.join(words)}: not run here (see invocations)")
    problems = check_clean_run(work, argv)
    assert not problems, f"{' '.join(words)}:\n" + "\n".join(problems)


def scribble(args):
    Path(args.output).write_text(Path(args.input).read_text())  # a write that bypasses the one writer
    return 0


def register_scribble(sub, model_args):
    p = sub.add_parser("scribble", help="copies a file without the one writer (a test's throw-away command)")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.set_defaults(func=scribble)
    reads_and_writes(p, ("--input",), files=("",))


def test_a_command_writing_with_plain_open_fails_the_enumerating_tests(work, monkeypatch):
    module = types.ModuleType("throwaway_scribble")
    module.register = register_scribble
    monkeypatch.setitem(sys.modules, "throwaway_scribble", module)
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "throwaway_scribble"))
    assert ("scribble",) in commands()
    with pytest.raises(AssertionError, match="scribble"):
        test_every_command_has_an_invocation(work)  # (a) names the command nobody gave an invocation
    problems = check_clean_run(work, ["scribble", "--input", work.texts, "--output", "OUT"])
    assert problems and all("outside the writer" in p or "no commit of the writer" in p for p in problems)
    assert any("opened for writing outside the writer" in p for p in problems), problems


def json_names(folder: Path):
    """(file, path in it, value) of every JSON string value in the folder's JSON files that names an entry of the
    folder (a file or folder that exists there, relative to the folder or to the JSON file's own folder)."""

    def walk(value, where):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, (*where, key))
        elif isinstance(value, list):
            for n, item in enumerate(value):
                yield from walk(item, (*where, n))
        elif isinstance(value, str) and value and len(value) < 200:
            yield where, value

    for file in sorted(folder.rglob("*.json")):
        if is_writer_temporary(file) or file.is_symlink():
            continue
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        for where, value in walk(record, ()):
            plain = "/" not in value and value not in (".", "..")
            candidates = [file.parent / value, folder / value] if plain else []
            if any(c.exists() and c != folder and c.resolve().is_relative_to(folder.resolve()) for c in candidates):
                yield file, where, value


def set_at(record, where, value):
    for key in where[:-1]:
        record = record[key]
    record[where[-1]] = value


def tampered_copies(folder: Path, decoy: Path, scratch: Path):
    """(label, tampered copy) of `folder`: each file a link to its twin in `decoy`; each name a JSON file gives
    pointed at the decoy by '..', by an absolute path, and by a link inside the folder."""
    n = 0

    def fresh():
        nonlocal n
        n += 1
        return Path(shutil.copytree(folder, scratch / f"t{n}", symlinks=True))

    for file in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = file.relative_to(folder)
        if is_writer_temporary(rel):
            continue
        copy = fresh()
        (copy / rel).unlink()
        (copy / rel).symlink_to(decoy / rel)
        yield f"{rel} a link out", copy
    for file, where, value in json_names(folder):
        rel = file.relative_to(folder)
        base = (file.parent / value) if (file.parent / value).exists() else (folder / value)
        target = decoy / base.relative_to(folder)
        for how in ("..", "absolute", "link"):
            copy = fresh()
            record = json.loads((copy / rel).read_text(encoding="utf-8"))
            if how == "..":
                named = os.path.relpath(target, (copy / rel).parent)
            elif how == "absolute":
                named = str(target)
            else:
                (copy / rel).parent.joinpath("planted-link").symlink_to(target)
                named = "planted-link"
            set_at(record, where, named)
            (copy / rel).write_text(json.dumps(record), encoding="utf-8")
            yield f"{rel}:{'.'.join(map(str, where))} by {how}", copy
    # the folder as a Hugging Face cache snapshot (each file a link into ../../blobs) whose blobs/ is itself a link
    # to the decoy: a snapshot is read as a folder, its links only into its repository's own blobs (issue 61)
    snapshot = Path(shutil.copytree(folder, scratch / "hub" / "models--org--kind" / "snapshots" / "rev"))
    for file in sorted(p for p in snapshot.rglob("*") if p.is_file() and not p.is_symlink()):
        file.unlink()
        file.symlink_to(os.path.relpath(snapshot.parent.parent / "blobs" / file.relative_to(snapshot), file.parent))
    (snapshot.parent.parent / "blobs").symlink_to(decoy, target_is_directory=True)
    yield "a snapshot whose blobs/ is a link out", snapshot


def read_model(folder):
    from matryoshka2d.models.encoder import ElasticEncoder

    ElasticEncoder(str(folder), pooling="mean").encode(["red cat"], layer=1)


def read_index(folder):
    assert exit_code(["search", "--index", folder, "--query", "red cat", "--top-k", "2"]) in (0, 2)


def read_with_cli(argv_of):
    return lambda folder: exit_code(argv_of(folder)) in (0, 2)


# Every kind of folder the toolkit writes, with the command that makes it and the readers that load it. A folder
# kind is the output of a whole-folder command (reads_and_writes without files): a command added later that
# writes a folder fails `test_every_folder_kind_is_tampered_with` until it has an entry here.
def folder_kinds(w: Work):
    return {
        ("train",): (invocations(w)[("train",)], [read_model]),
        ("merge",): (invocations(w)[("merge",)], [read_model]),
        ("two-step",): (invocations(w)[("two-step",)], [read_model]),
        ("pretrain",): (invocations(w)[("pretrain",)], [read_model]),
        ("heads", "fit"): (invocations(w)[("heads", "fit")], [read_model]),
        ("distill",): (invocations(w)[("distill",)], [read_model]),
        ("export",): (invocations(w)[("export",)], [read_model]),
        ("index", "build"): (invocations(w)[("index", "build")], [read_index]),
        ("demo",): None,  # its folders are the kinds above (a run, heads, an export, an index)
    }


def whole_folder_commands():
    for words, parser in commands_of(build_parser()):
        d = parser._defaults
        if d.get("output_option") and d.get("output_files") is None:
            yield words


def test_every_folder_kind_is_tampered_with(work):
    kinds = folder_kinds(work)
    missing = [" ".join(w) for w in whole_folder_commands() if w not in kinds]
    assert not missing, f"folder-writing commands with no entry in {__name__}.folder_kinds: {missing}"


@pytest.mark.parametrize("words", list(whole_folder_commands()), ids=" ".join)
def test_a_tampered_folder_is_never_read_outside_itself(work, words, tmp_path, capsys):
    entry = folder_kinds(work).get(words)
    if entry is None:
        pytest.skip("its folders are other kinds' (see folder_kinds)")
    argv, readers = entry
    folder = tmp_path / "made"
    assert exit_code([a if a != "OUT" else folder for a in argv]) == 0
    leaks = reads_outside(folder, readers, tmp_path, capsys)
    assert not leaks, f"{' '.join(words)}:\n" + "\n".join(leaks)


def reads_outside(folder: Path, readers, tmp_path: Path, capsys) -> list[str]:
    """Load every tampered copy of `folder` with every reader under the audit hook: the opens of the decoy (the
    copy outside the folder that the tampered names lead to), and any traceback printed."""
    decoy = Path(shutil.copytree(folder, tmp_path / "decoy", symlinks=True))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    leaks = []
    for label, copy in tampered_copies(folder, decoy, scratch):
        for reader in readers:
            with recording() as events, contextlib.suppress(ValueError, OSError):
                reader(copy)
            if opened := opened_under(events, decoy):
                leaks.append(f"{label}: {reader.__name__} opened {opened}")
            if "Traceback" in capsys.readouterr().err:
                leaks.append(f"{label}: {reader.__name__} printed a traceback")
        shutil.rmtree(copy)
    return leaks


def test_a_reader_that_follows_links_out_fails_the_tamper_test(tiny_dir, tmp_path, capsys):
    def naive_reader(folder):  # what every reader did before the confined reader: open what the folder names
        json.loads((folder / "config.json").read_text())
        (folder / "tokenizer.json").read_bytes()

    leaks = reads_outside(Path(tiny_dir), [naive_reader], tmp_path, capsys)
    assert any(leak.startswith("config.json a link out: naive_reader opened") for leak in leaks), leaks
