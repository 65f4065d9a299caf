"""Options shared by several commands: the converters every typed option parses through (numbers, cells and
layer lists read by matryoshka2d.cells), the model to load, and what a command reads and writes (rule 1). The
options of a training run are in cli/run_options.py, how --help reads in cli/help.py."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

POOLING_CHOICES = ["mean", "cls", "last-token"]  # models.backbones.POOLING_MODES, without importing torch here

MODEL_HELP = "short name (minilm-l6, mpnet-base), directory or hub id"
POOLING_HELP = "override the model's pooling"
DEVICE_HELP = "cpu, cuda, ... (default: cuda if available)"


# ---- Rule 4: every option is checked where it is parsed -------------------------------------------------------
# Converters for argparse's `type=`: a bad value stops the command at parse time, before anything loads, with
# argparse's one line `matryoshka2d CMD: error: argument --OPTION: WHAT` (exit 2). Each names the value it got.


# The largest count an option takes: a C int, which the libraries underneath hold counts in (2**31 as faiss's
# efSearch is an OverflowError naming no option). No count here (texts, steps, tokens, workers, bytes) comes near it.
LARGEST_COUNT = 2**31 - 1
LARGEST_SEED = 2**32 - 1  # what numpy's RandomState and scikit-learn's random_state take (torch's takes more)


def _whole(text: str, most: int = LARGEST_COUNT, least: int = 0) -> int:
    """A whole number written as one (digits, an optional sign) from `least` to `most`: '1e3', '2.0', '' and 'abc'
    are not; one of more digits than `most` is refused unconverted (int() of thousands of digits names no option)."""
    if not re.fullmatch(r"\s*[+-]?\d+\s*", text or ""):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    negative, digits = text.strip().startswith("-"), text.strip().lstrip("+-")
    shown = text.strip() if len(digits) <= 24 else f"a {'negative ' * negative}number of {len(digits):,} digits"
    if len(digits.lstrip("0")) > len(str(most)):  # out of range whatever its digits: refused unconverted
        raise argparse.ArgumentTypeError(
            f"must be at least {least}, got {shown}" if negative else f"must be at most {most:,}, got {shown}"
        )
    value = int(text)
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {shown}")
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most:,}, got {shown}")
    return value


def positive_int(text: str) -> int:
    """A whole number of at least 1 (a count of steps, texts, workers, a layer, a width)."""
    return _whole(text, least=1)


def count(text: str) -> int:
    """A whole number of at least 0 (0 meaning none or off, as the option's help says)."""
    return _whole(text)


def seed(text: str) -> int:
    """A random seed, 0 to 2**32 - 1: what numpy and scikit-learn take (past it, their error named no option)."""
    return _whole(text, LARGEST_SEED)


def number(text: str) -> float:
    """A finite number ('nan' and 'inf' are not)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (a learning rate, a temperature, a budget)."""
    value = number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0 (a wait that may be none)."""
    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def at_least_one(text: str) -> float:
    """A finite number of at least 1 (a factor that multiplies a count: oversampling)."""
    value = number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    if not re.fullmatch(r"\s*[+-]?\d+\s*", text or ""):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    if not re.fullmatch(r"\s*\+?0*\d{1,5}\s*", text) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535 (0: any free port), got {text.strip()[:24]}")
    return int(text)


def fraction(text: str) -> float:
    """A finite number from 0 to 1."""
    value = number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


# Cells and layer lists are read by matryoshka2d.cells, the one parser of both notations (3x128, 3:128) and of
# ranges (1-6), so that an option means and refuses the same thing in every command and in the server.


def _cells(text: str, least_layer: int) -> list:
    from matryoshka2d.cells import parse_cells

    try:
        cells = parse_cells(text or "", "cells")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("cells: ")) from None
    for cell in cells:
        if cell.layer < least_layer or cell.dim < 1:
            lowest = "a layer and a width are at least 1" if least_layer else "a width is at least 1"
            raise argparse.ArgumentTypeError(f"cell {cell.label}: {lowest}")
    return cells


def cell_list(text: str) -> list:
    """Cells of exits, e.g. 3:128,6:384 or 3x128 6x384 (matryoshka2d.cells.parse_cells), each number at least 1."""
    return _cells(text, 1)


def grid_cells(text: str) -> list:
    """Cells of a grid, e.g. 6x384 3x128 0x384: layer 0 is a model's static cell, a width is at least 1."""
    return _cells(text, 0)


def one_cell(text: str):
    """One cell, 3x128 or 3:128 (matryoshka2d.cells.Cell.parse); layer 0 is a model's static cell."""
    from matryoshka2d.cells import Cell

    try:
        cell = Cell.parse(text, "cell")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("cell: ")) from None
    if cell.dim < 1:
        raise argparse.ArgumentTypeError(f"cell {cell.label}: a width is at least 1")
    return cell


def cascade_cells(text: str) -> tuple:
    """small:full, e.g. 2:128,6:384: the cell that shortlists, then the one that reranks."""
    cells = grid_cells(text)
    if len(cells) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give exactly two cells, small then full (e.g. 2:128,6:384)")
    return cells[0], cells[1]


# A model adds its start and end tokens ([CLS] and [SEP]) to every text: a length of 2 holds only those (every text
# gets the same vector) and a length of 1 is below them (the tokenizer then cuts nothing: texts go in whole).
SHORTEST_TOKENS = 3


def token_length(text: str) -> int:
    """A length in tokens (--max-length): at least 3, so that one token of text fits between [CLS] and [SEP]."""
    value = positive_int(text)
    if value < SHORTEST_TOKENS:
        raise argparse.ArgumentTypeError(
            f"must be at least {SHORTEST_TOKENS}, got {value}: the model's start and end tokens ([CLS] and [SEP]) "
            f"take two, so {value} leaves no token of text (at 1 the tokenizer cuts nothing at all)"
        )
    return value


def _numbers(text: str, least: int, what: str) -> list[int]:
    from matryoshka2d.cells import parse_numbers

    try:
        return parse_numbers(text, "numbers", least=least, what=what)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("numbers: ")) from None


def layer_list(text: str) -> list[int]:
    """Layers as 1,3,6 or ranges 1-6 (0: a model's static cell) -> the numbers, in the order given; an empty item, a
    reversed range (3-1, which holds no number) and a negative number are refused (matryoshka2d.cells.parse_numbers).
    With nargs="+" give it action=Numbers, which joins the items (--layers 1,2 4-6) into one list."""
    return _numbers(text, 0, "layers")


def width_list(text: str) -> list[int]:
    """Widths as 64,128 or ranges, each at least 1, read as layer_list reads layers."""
    return _numbers(text, 1, "widths")


def exit_list(text: str) -> list[int]:
    """Exits as 1,2,3 or 1-5, each at least 1 (layer 0 has no exit head), read as layer_list reads layers."""
    return _numbers(text, 1, "exits")


class Numbers(argparse.Action):
    """The action of an option of several number lists (nargs="+", type=layer_list: --layers 1,2 4-6): one list of
    the numbers, in the order given, repeats dropped."""

    def __call__(self, parser, namespace, values, option_string=None):
        from matryoshka2d.cells import check_how_many

        numbers = [number for value in values for number in value]
        try:
            check_how_many(numbers, "numbers")
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc).removeprefix("numbers: ")) from None
        setattr(namespace, self.dest, list(dict.fromkeys(numbers)))


def only_static_layers(layers) -> bool:
    """Whether every layer given (a parsed --layers list) is 0, the static cell."""
    return bool(layers) and set(layers) == {0}


def refuse_pooling_at_static_cell(args, layer_option: str) -> None:
    """--pooling where every cell asked for is layer 0 would do nothing: the static cell averages rows of its token
    table, it has no pooling to choose (rule 4)."""
    if getattr(args, "pooling", None):
        raise ValueError(
            f"--pooling {args.pooling} with {layer_option} 0 would do nothing: layer 0 is the model's static cell, "
            "which averages its token table's rows and has no pooling to choose; leave --pooling out"
        )


def named_folder(text: str) -> tuple[str, str]:
    """[NAME=]FOLDER: the text before the first '=' is a name only when it is a plain name (no '/', not empty),
    so that a folder whose path holds '=' (q=/runs/a=b/q, /runs/a=b) keeps it whole. ('', FOLDER) without one.

    A text that is no name=folder and no existing path is refused here, naming what is wrong with it, where it
    was read as a folder and refused as "not a query encoder": '=q' (no name before the '='), and 'DIR/tiny=q'
    where DIR/tiny exists (the name written after the folder, not before it)."""
    name, sep, folder = (text or "").partition("=")
    if sep and name and "/" not in name and "\\" not in name:
        if not folder:
            raise argparse.ArgumentTypeError(f"{text!r}: no folder after '{name}='")
        return name, folder
    if not text:
        raise argparse.ArgumentTypeError("is empty: give a folder, or NAME=FOLDER")
    if sep and not Path(text).expanduser().exists():
        if not name:
            raise argparse.ArgumentTypeError(
                f"{text!r}: no name before '=' (and no folder of that name): write NAME=FOLDER, or the folder alone"
            )
        before, _, after = text.rpartition("=")
        if after and "/" not in after and "\\" not in after and Path(before).expanduser().exists():
            raise argparse.ArgumentTypeError(
                f"{text!r}: no folder of that name; the name goes before the folder: write {after}={before}"
            )
    return "", text


def command(sub, name: str, func, **parser_options):
    """A subcommand whose arguments go to `func(args)`: the parser, created with its function."""
    p = sub.add_parser(name, **parser_options)
    p.set_defaults(func=func)
    return p


def command_group(sub, name: str, help: str, dest: str, func=None):
    """A command of subcommands (`eval sts`, `index build`, `models list`): the subparsers to add them to;
    `func`, if given, runs every subcommand that has none of its own."""
    p = sub.add_parser(name, help=help)
    if func is not None:
        p.set_defaults(func=func)
    return p.add_subparsers(dest=dest, required=True)


def model_args(
    p,
    default="minilm-l6",
    model_help=MODEL_HELP,
    pooling_help=POOLING_HELP,
    device_help=DEVICE_HELP,
    heads: bool = True,
) -> None:
    """--model, --pooling and --device (and --no-heads unless `heads` is False); a command whose default model
    comes from elsewhere says so in its help."""
    p.add_argument("--model", default=default, help=model_help)
    p.add_argument("--pooling", choices=POOLING_CHOICES, help=pooling_help)
    p.add_argument("--device", help=device_help)
    if heads:
        heads_flag(p)


def heads_flag(p) -> None:
    p.add_argument(
        "--no-heads",
        action="store_true",
        help="leave the model's exit heads off: shallow cells are the pooled layer itself (to compare both)",
    )


def load_encoder(args, model: str | None = None, log=None, **options):
    """The ElasticEncoder a command's --model (or `model`), --pooling, --device and --no-heads ask for. With
    --no-heads it says whether the folder had heads to leave off."""
    import sys

    from matryoshka2d.models.backbones import check_device
    from matryoshka2d.models.encoder import ElasticEncoder

    device = options.pop("device", getattr(args, "device", None))
    pooling = options.pop("pooling", getattr(args, "pooling", None))
    check_device(device)
    no_heads = bool(getattr(args, "no_heads", False))
    encoder = ElasticEncoder(model or args.model, pooling=pooling, device=device, heads=not no_heads, **options)
    if no_heads:
        said = "exit heads left off (--no-heads)" if encoder.folder_has_heads else "--no-heads: it has no exit heads"
        (log or (lambda m: print(m, file=sys.stderr)))(f"{encoder.name}: {said}")
    return encoder


# ---- Rule 1: no output overlaps an input ----------------------------------------------------------------------
# Each command that writes says, with `reads_and_writes`, which of its options name what it reads and which names
# what it writes; `main` opens the one writer's scope over the inputs (outputs.command_scope: every later write is
# checked against them, by path and by device and inode) and runs `check_outputs` before the command starts, so
# nothing is deleted or written over an input, with --overwrite or without. Training runs check the paths of their
# final options again (a --config file may name them): training.rundir.RunDir.check.

MODEL_OPTIONS = ("--model", "--models", "--teacher", "--query-model", "--distill-from")  # names or folders
RESULT_OPTIONS = ("--results", "results")  # result folders: the results.json / cascade.json read in them


def reads_and_writes(
    p, reads: tuple[str, ...], output: str | None = "--output", files=None, default=None, caches: tuple[str, ...] = ()
) -> None:
    """Declare a command's inputs (options, or positional names) and its output. `files` None: the output is a
    folder the command fills as a whole (a model, a run, an index); a tuple: the names of the result files it
    writes into the output folder (('',): the output is itself the file written). `default(args)`: where the
    command writes when the output option is not given. `caches`: options naming a folder the command also
    writes files into (a Qdrant local folder, a document cache, serve's graph cache): it may not be, or hold, an
    input either. `output` None: the command writes only into its caches (serve)."""
    p.set_defaults(reads=reads, output_option=output, output_files=files, output_default=default, caches=caches)


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def input_paths(args):
    """(option, path) of every input the command's options name; a model name is the folder it stands for, a
    result folder the result files in it."""
    from matryoshka2d.models.backbones import local_folder

    for option in getattr(args, "reads", ()):
        value = getattr(args, _dest(option), None)
        for item in value if isinstance(value, list) else [value]:
            if item is None or item == "":  # no path (the command says what is missing)
                continue
            if isinstance(item, tuple):  # NAME=FOLDER (serve --query-model)
                item = item[1]
            if option in MODEL_OPTIONS:
                yield option, local_folder(item)
            elif option in RESULT_OPTIONS and Path(item).is_dir():
                for name in ("results.json", "cascade.json"):
                    yield option, Path(item) / name
            else:
                yield option, Path(item)


def output_of(args):
    """(output option, the path it names or its default, own folders) of the command `args` runs: own folders are
    the folder of named result files and the caches it writes into, which may lie inside a folder it reads."""
    option = getattr(args, "output_option", None)
    caches = getattr(args, "caches", ())
    if option is None and not caches:
        return None, None, []
    output = getattr(args, _dest(option), None) if option else None
    if output is None and option and args.output_default is not None:
        output = args.output_default(args)
    own = [getattr(args, _dest(cache), None) for cache in caches]
    if output is not None and args.output_files is not None:
        own.append(output if args.output_files != ("",) else None)
    return option, output, [Path(folder) for folder in own if folder]


def command_scope_of(args):
    """The one writer's scope for the command `args` runs (outputs.command_scope): every file it writes is checked
    against every input its options name, by path and by device and inode."""
    from matryoshka2d.outputs import command_scope

    option, output, own = output_of(args)
    caches = getattr(args, "caches", ())
    inputs = list(input_paths(args)) if option is not None or caches else []
    return command_scope(option or (caches[0] if caches else "--output"), inputs, output=output, own_folders=own)


def check_outputs(args) -> None:
    """Rule 1 for the command `args` runs, before it starts (inside `command_scope_of`): its output lies apart from
    every input (see reads_and_writes), and the folder it writes into can be written."""
    from matryoshka2d.outputs import check_destination, check_writable, current_scope

    option, output, _ = output_of(args)
    if option is None and not getattr(args, "caches", ()):
        return
    if current_scope() is None:  # called on its own (a library caller, a test): the command's scope for the check
        with command_scope_of(args):
            check_outputs(args)
        return
    for cache in args.caches:
        if (folder := getattr(args, _dest(cache), None)) is not None:
            check_destination(folder, cache, whole_folder=False)
            check_writable(folder, cache)
    if output is None:
        return
    if not str(output).strip():  # '' would be the current folder
        raise ValueError(f"{option} is empty: give the folder (or file) to write")
    if args.output_files is None:
        check_destination(output, option, whole_folder=True)
        check_writable(output, option)
        return
    if args.output_files != ("",):
        check_destination(output, option, results_folder=True)  # not an input folder itself
    for name in args.output_files:
        check_destination(Path(output) / name if name else output, option)
    check_writable(Path(output).parent if args.output_files == ("",) else output, option)


def check_new_output(out: Path, overwrite: bool) -> None:
    """A command that writes a new model folder never replaces a user's folder unless told to."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"--output {out} already exists and is not empty; pass --overwrite or choose another folder")


def folder_metadata(encoder) -> dict:
    """The model folder's matryoshka2d.json (method, training record, ...), or {} for a folder without one (or a
    model that has no folder here), read by the one confined reader (confined.ConfinedFolder)."""
    from matryoshka2d.confined import ConfinedFolder

    if not encoder.location or not Path(encoder.location).is_dir():  # not the current folder's matryoshka2d.json
        return {}
    folder = ConfinedFolder(encoder.location, "model")
    if not folder.path("matryoshka2d.json").is_file():
        return {}
    record = folder.read_json("matryoshka2d.json")
    if not isinstance(record, dict):
        raise ValueError(f"{folder.folder / 'matryoshka2d.json'}: not a JSON object (a model's record is one)")
    return record
