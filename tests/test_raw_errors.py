"""No raw library text (issue 61, item 5): every kind of bad value a user can give is answered in the toolkit's words,
one line `matryoshka2d CMD: error: ...` naming the option, file, line or field, never a traceback or a library's own
message. Each test walks what exists, so that a command, an option, a reader or a record field added later is
covered without being listed:

- every typed option of every command, by the kind of its converter (a huge number, a number past 2**32 for a seed,
  a range of a billion layers, whole or in pieces, a cell of ten-digit numbers, an empty value, nan and inf);
- every reader of an input file (the public functions of matryoshka2d.files, result_files, beir and training.data
  that take a path), with each kind of bad content (empty, a lone surrogate in a string or a key, a number where a
  string belongs, bytes that are not UTF-8, a number of thousands of digits, nesting deeper than a parser follows);
- every field of a result file (results.json, cascade.json) and of the records that hold checksums (a model folder's
  exit heads, a query encoder's distill record), replaced by a value of another kind;
- what no reader can name (running out of memory, a number past a library's limit, a text that is no Unicode),
  said by `main` itself.
"""

import inspect
import json
import sys
import types

import numpy as np
import pytest
import torch

from helpers.cli import error_line, every_command, exit_code
from helpers.data import grid
from matryoshka2d import beir, cli, files, result_files
from matryoshka2d.cli import args as converters
from matryoshka2d.cli import build_parser
from matryoshka2d.training import data as training_data

# ---- every typed option, by the kind of its converter --------------------------------------------------------------

HUGE = "9" * 30
ANY_WHOLE = [[HUGE], [str(2**63)], ["-" + HUGE], [""]]
WHOLE = [*ANY_WHOLE, [str(converters.LARGEST_COUNT + 1)]]  # past a C int: faiss's efSearch setter overflows
REAL = [["nan"], ["inf"], ["1e999"], ["-1e999"], [""]]
# 200,000 layers in two ranges of 100,000, each short enough alone: the total is what no model has
PIECES = [f"{k * 100_000}-{k * 100_000 + 99_999}" for k in range(2)]
NUMBER_LISTS = [["1-1000000000"], ["0-999999999"], [",".join(PIECES)], [""]]
CELLS = [["1000000000x8"], ["8x1000000000"], [HUGE + "x8"], [""]]
BAD_VALUES = {
    converters.positive_int: WHOLE,
    converters.count: WHOLE,
    converters.token_length: WHOLE,
    converters.port: WHOLE,
    converters.seed: [*ANY_WHOLE, [str(converters.LARGEST_SEED + 1)]],  # numpy's RandomState takes 2**32 - 1
    converters.number: REAL,
    converters.positive_float: REAL,
    converters.non_negative_float: REAL,
    converters.at_least_one: REAL,
    converters.fraction: REAL,
    converters.layer_list: NUMBER_LISTS,
    converters.width_list: NUMBER_LISTS,
    converters.exit_list: NUMBER_LISTS,
    converters.cell_list: CELLS,
    converters.grid_cells: CELLS,
    converters.one_cell: CELLS,
    converters.cascade_cells: CELLS,
    converters.named_folder: [[""]],
}


def typed_options():
    """(command words, its parser, the option) of every option of every command that has a converter."""
    for words, parser in every_command(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.type not in (None, str):
                yield words, parser, action


def refusal(parser, action, values, capsys) -> str | None:
    """None when the parser stops at `values` for `action` with exit 2 and one line naming the option, else what it
    did instead."""
    name = "/".join(action.option_strings)
    try:
        parser.parse_args([action.option_strings[0], *values])
    except SystemExit as stopped:
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if "error:" in line]
        expected = f"{parser.prog}: error: argument {name}: "
        if stopped.code == 2 and "Traceback" not in err and len(said) == 1 and said[0].startswith(expected):
            return None
        return f"exit {stopped.code}: {err.strip()[-300:]}"
    return "accepted"


def test_every_typed_option_of_every_command_refuses_each_bad_value_of_its_kind_in_one_line(capsys):
    """A converter added later without bad values of its kind here fails the first assertion; an option whose
    converter lets one through (a count past what the libraries take, a billion layers) fails the second."""
    options = list(typed_options())
    assert len(options) > 100
    unknown = sorted({action.type.__name__ for _, _, action in options if action.type not in BAD_VALUES})
    assert not unknown, f"give the converters {unknown} their kinds of bad values in BAD_VALUES"
    wrong = []
    for words, parser, action in options:
        kinds = BAD_VALUES[action.type]
        if action.nargs == "+" and action.type in (converters.layer_list, converters.width_list):
            kinds = [*kinds, PIECES]  # the pieces as separate items: --layers 0-99999 100000-199999
        for values in kinds:
            if problem := refusal(parser, action, values, capsys):
                wrong.append(f"{' '.join(words)} {action.option_strings[0]} {values!r}: {problem}")
    assert not wrong, "\n".join(wrong)


def test_every_seed_takes_what_numpy_scikit_learn_and_torch_take():
    """Was: `--seed` took any count, and a seed past 2**32 was numpy's or torch's error after the model loaded
    ('Seed must be between 0 and 2**32 - 1', 'Overflow when unpacking long long'), naming no option."""
    seeds = [(words, action) for words, _, action in typed_options() if action.dest.endswith("seed")]
    assert len(seeds) >= 5  # train, two-step, pretrain, distill, report compression
    assert all(action.type is converters.seed for _, action in seeds), seeds
    largest = converters.seed(str(converters.LARGEST_SEED))
    np.random.RandomState(largest)  # scikit-learn's random_state is one
    torch.manual_seed(largest * 1_000_003 + 10**9)  # as the trainers derive a step's seed from it


def test_a_huge_number_stops_the_command_before_anything_loads(tmp_path, capsys):
    """Through `main`, before the (missing) model or input is looked at: was a run with it (`search --top-k 1e12`
    a MemoryError traceback), torch's 'Overflow when unpacking long long' for `--seed 1e23` after the model loaded,
    and a list of 200,000 layers made before anything said no model has that many."""
    argv = ["encode", "--model", tmp_path / "no-model", "--input", tmp_path / "none.txt", "--output", tmp_path / "v"]
    assert exit_code([*argv, "--batch-size", HUGE]) == 2
    error_line(capsys, "argument --batch-size: must be at most 2,147,483,647, got a number of 30 digits")
    assert exit_code(["train", "--data", "x", "--output", tmp_path / "o", "--seed", str(2**32)]) == 2
    error_line(capsys, "argument --seed: must be at most 4,294,967,295, got 4294967296")
    assert exit_code(["eval", "sts", "--output", tmp_path / "o", "--layers", *PIECES]) == 2
    error_line(capsys, "argument --layers: more than 100,000 numbers in all; no model has that many")


def test_a_seed_past_what_numpy_takes_in_a_config_file_is_named(tmp_path, capsys):
    """A --config file's seed is checked as the flag is (was torch's 'Overflow when unpacking long long')."""
    config = tmp_path / "run.yaml"
    config.write_text(f"seed: {2**64}\n")
    assert exit_code(["train", "--data", tmp_path / "none.tsv", "--config", config, "--output", tmp_path / "o"]) == 2
    error_line(capsys, f"--seed must be at most 4294967295, got {2**64}")


# ---- every reader of an input file, with each kind of bad content --------------------------------------------------

BAD_CONTENTS = {
    "empty": b"",
    "lone surrogate": b'{"_id": "d1", "title": "", "text": "a \\ud800 b", "task": "x\\udfff"}\n',
    "lone surrogate in a key": b'{"\\udc80": 1, "text": "fine"}\n',
    "number where a string belongs": b'{"_id": 5, "title": 6, "text": 7, "task": 8, "rows": 9, "model": 10}\n',
    "not UTF-8": b"caf\xe9\tsecond\n\xff\xfe\x00\x01\n",
    "cut inside a character": "café".encode()[:-1],
    "thousands of digits": b'{"text": "x", "n": ' + b"9" * 5000 + b"}\n",
    "nested deeper than a parser follows": b"[" * 100_000 + b"]" * 100_000,
}
SUFFIXES = (".json", ".jsonl", ".tsv", ".txt")
REQUIRED = {"titles": True}  # a reader's other parameters without a default, as its callers pass them


def readers():
    """Every public function of the modules that read input files whose first parameter is the file (`path` or
    `source`): what each command reads its inputs through."""
    found = []
    for module in (files, result_files, beir, training_data):
        for name, function in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            parameters = list(inspect.signature(function).parameters.values())
            if parameters and parameters[0].name in ("path", "source"):
                found.append(function)
    return found


def read_through(reader, path):
    """Call `reader` on `path` as its callers do: an iterator is read to its end, a file it opens is closed; what it
    gave back."""
    parameters = list(inspect.signature(reader).parameters.values())[1:]
    missing = [p.name for p in parameters if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    result = reader(str(path), **{name: REQUIRED[name] for name in missing})
    if isinstance(result, tuple) and result and hasattr(result[0], "close"):
        result[0].close()
        return None
    return list(result) if hasattr(result, "__next__") else result


def texts_in(value):
    """Every string in what a reader gave back (containers and dataclasses walked)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from texts_in(key)
            yield from texts_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from texts_in(item)
    elif hasattr(value, "__dataclass_fields__"):
        yield from texts_in(vars(value))


def not_text(value) -> str | None:
    """The first string in `value` that is no Unicode text (a lone surrogate cannot be written as UTF-8)."""
    for text in texts_in(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return text
    return None


def test_every_reader_names_the_file_of_each_kind_of_bad_content(tmp_path):
    """Was: a lone surrogate in a corpus reached the tokenizer ('TextEncodeInput must be Union[...]'), in a result
    file matplotlib ('set_text(): incompatible function arguments', several lines); a JSON line of a 5,000-digit
    number was Python's 'Exceeds the limit (4300 digits)' naming no file."""
    found = readers()
    assert {f.__name__ for f in found} >= {"read_json", "read_jsonl", "read_tsv", "read_result_record", "read_lines"}
    wrong = []
    for kind, content in BAD_CONTENTS.items():
        for suffix in SUFFIXES:
            path = tmp_path / f"bad{suffix}"
            path.write_bytes(content)
            for reader in found:
                try:
                    if (bad := not_text(read_through(reader, path))) is not None:
                        wrong.append(f"{reader.__name__}({path.name}), {kind}: gave back {bad!r}, which is no text")
                except ValueError as exc:  # every reader's error is one (DataFormatError, ResultFileError, ...)
                    if str(path) not in str(exc) or "\n" in str(exc):
                        wrong.append(f"{reader.__name__}({path.name}), {kind}: {str(exc)[:200]!r}")
                except Exception as exc:  # what this test is for: anything else is raw
                    wrong.append(f"{reader.__name__}({path.name}), {kind}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not wrong, "\n".join(wrong)


def test_a_lone_surrogate_in_a_result_file_is_named_with_its_field(tmp_path, capsys):
    """Through `main`: the record is refused where it is read, naming the file and the field."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(grid(datasets=["a", "b\ud800"])))
    assert exit_code(["report", tmp_path / "a", tmp_path / "b", "--output", tmp_path / "out"]) == 2
    error_line(capsys, f"{tmp_path / 'a' / 'results.json'}: datasets[1]: holds '\\ud800', half of a surrogate pair")


# ---- every field of a result file and of the records holding checksums ---------------------------------------------

OTHER_KINDS = (12345, "12345", None, [], {}, "a\ud800")


def leaves(value, place=()):
    """The path of every item of a JSON document (containers included), the first of each list only."""
    yield place
    items = value.items() if isinstance(value, dict) else list(enumerate(value))[:1] if isinstance(value, list) else ()
    for key, item in items:
        yield from leaves(item, (*place, key))


def replaced(document, place, value):
    copy = json.loads(json.dumps(document))
    if not place:
        return value
    inner = copy
    for key in place[:-1]:
        inner = inner[key]
    inner[place[-1]] = value
    return copy


def full_grid():
    """A results.json as `eval` writes it: every field its readers use."""
    from matryoshka2d.evaluate.results import summarize

    model = {"model": "tiny", "location": "/models/tiny", "architecture": "bert", "layers": 2, "hidden_size": 32}
    model |= {"pooling": "mean", "max_length": 128, "backend": "torch", "precision": "float32"}
    model |= {"weights_sha256": "ab" * 32}
    settings, provenance = {"batch_size": 64}, {"date": "2026-11-29 03:33 UTC", "command": "eval sts"}
    record = grid(model=model, settings=settings, provenance=provenance, seconds={"total": 1.5})
    record["summary"] = summarize(record["scores"], record["metric"], model["layers"])
    return record


def full_cascade():
    rows = [{"dataset": "scifact", "mode": "flat (2,32)", "ndcg@10": 50.0}]
    rows.append({"dataset": "scifact", "mode": "cascade (1,8) top 100 -> (2,32)", "ndcg@10": 48.0})
    return {"task": "retrieval-cascade", "rows": rows, "model": full_grid()["model"]}


def read_as_pick_and_report_do(path):
    """What `pick --results` and `report A B` do with a result file before they measure or write anything."""
    from matryoshka2d.evaluate.report import build_report, check_comparable, default_names
    from matryoshka2d.evaluate.results import load_result
    from matryoshka2d.pick.quality import load_quality

    load_quality([str(path)])
    if result_files.read_result_record(path)[0] == "grid":
        results, paths = [load_result(path), load_result(path)], [path, path]
        check_comparable(results, paths)
        build_report(results, default_names(results, paths), paths)


@pytest.mark.parametrize("document", [full_grid(), full_cascade()], ids=["results.json", "cascade.json"])
def test_every_field_of_a_result_file_of_another_kind_is_named_or_read(document, tmp_path):
    """Was: a number where the model's weights checksum belongs was `'int' object is not subscriptable` in pick."""
    read_as_pick_and_report_do(_written(tmp_path, document))  # the file as written reads
    wrong = []
    for place in leaves(document):
        for value in OTHER_KINDS:
            path = _written(tmp_path, replaced(document, place, value))
            try:
                read_as_pick_and_report_do(path)
            except ValueError as exc:
                if str(path) not in str(exc):
                    wrong.append(f"{place} = {value!r}: {str(exc)[:200]!r} names no file")
            except Exception as exc:  # anything else is raw
                wrong.append(f"{place} = {value!r}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not wrong, "\n".join(wrong)


def _written(tmp_path, document):
    """The document as a hand edit leaves it (json writes a lone surrogate as its escape, \\ud800)."""
    cascade = isinstance(document, dict) and document.get("task") == "retrieval-cascade"
    path = tmp_path / ("cascade.json" if cascade else "results.json")
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def test_a_number_where_the_checksum_belongs_is_named_by_pick(tiny_dir, tmp_path, capsys):
    from helpers.data import result_file

    folder = result_file(tmp_path / "r", tiny_dir)
    record = json.loads((folder / "results.json").read_text())
    record["model"]["weights_sha256"] = 12345
    (folder / "results.json").write_text(json.dumps(record))
    assert exit_code(["pick", "--results", folder, "--model", tiny_dir, "--output", tmp_path / "out"]) == 2
    error_line(capsys, f"{folder / 'results.json'}: model.weights_sha256: '12345' is not a sha256 checksum")


def test_every_field_of_the_exit_heads_record_of_another_kind_is_named_or_read(heads_folder, tmp_path):
    """The record a model folder keeps of its heads, each field replaced: the heads load, or a ValueError names the
    folder's matryoshka2d.json (was: a number for the backbone checksum, `'int' object is not subscriptable`)."""
    import shutil

    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.heads_on_disk import load_heads, read_record

    encoder = ElasticEncoder(str(heads_folder), heads=False)
    folder = shutil.copytree(heads_folder, tmp_path / "model")
    meta = folder / "matryoshka2d.json"
    document = json.loads(meta.read_text())
    wrong = []
    for place in leaves(document["exit_heads"], ("exit_heads",)):
        for value in OTHER_KINDS:
            meta.write_text(json.dumps(replaced(document, place, value)))
            try:
                record = read_record(folder)
                if record is not None:
                    load_heads(folder, record, encoder)
            except ValueError as exc:
                if str(folder) not in str(exc):
                    wrong.append(f"{place} = {value!r}: {str(exc)[:200]!r} names no file")
            except Exception as exc:  # anything else is raw
                wrong.append(f"{place} = {value!r}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not wrong, "\n".join(wrong)


def test_every_field_of_a_query_encoders_record_of_another_kind_is_refused_by_name():
    """A query encoder's distill record meets the documents' identity (search, eval retrieval, serve, a pair):
    each field of another kind is an IdentityError, never the TypeError of whatever read it."""
    from matryoshka2d.models.identity import IdentityError
    from matryoshka2d.models.query_record import check_query_encoder

    documents = {"model": "teacher", "weights_sha256": "ab" * 32, "pooling": "mean", "layers": 4, "hidden_size": 32}
    record = {"mode": "query", "teacher": "teacher", "teacher_weights_sha256": "ab" * 32, "teacher_pooling": "mean"}
    record |= {"teacher_layers": 4, "weights_sha256": "cd" * 32, "width": 32}
    check_query_encoder(record, "student", documents, "here")  # as written, it may search them
    wrong = []
    for place in list(leaves(record))[1:]:  # its fields (the record itself is a dict: query_encoder_record)
        for value in OTHER_KINDS:
            try:
                check_query_encoder(replaced(record, place, value), "student", documents, "here")
            except IdentityError:
                pass
            except Exception as exc:  # anything else is raw
                wrong.append(f"{place} = {value!r}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not wrong, "\n".join(wrong)


# ---- what no reader names: said by main in one line ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (MemoryError(), "not enough memory for what was asked (the largest number given: --top-k 2000000000)"),
        (OverflowError("Python int too large to convert to C long"), "a number past what the libraries underneath"),
        (UnicodeEncodeError("utf-8", "ab\ud800cd", 2, 3, "surrogates not allowed"), "a text holds '\\ud800'"),
        (UnicodeDecodeError("utf-8", b"ab\xffcd", 2, 3, "invalid start byte"), "is not UTF-8 text (byte 0xff)"),
    ],
    ids=["memory", "overflow", "surrogate", "not-utf8"],
)
def test_what_no_reader_named_is_one_line_in_the_toolkits_words(monkeypatch, capsys, failure, said):
    """A throw-away command raising each: was a traceback (MemoryError, OverflowError) or the codec's own words."""

    def fail(args):
        raise failure

    def register(sub, model_args):
        p = sub.add_parser("fail", help="raises what the test gives it (a throw-away command)")
        p.add_argument("--top-k", type=converters.positive_int)
        p.set_defaults(func=fail)

    module = types.ModuleType("throwaway_failing")
    module.register = register
    monkeypatch.setitem(sys.modules, "throwaway_failing", module)
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "throwaway_failing"))
    assert exit_code(["fail", "--top-k", "2000000000"]) == 2
    line = error_line(capsys, "matryoshka2d fail: error: ", said)
    if str(failure):
        assert str(failure) not in line  # not the library's own words
