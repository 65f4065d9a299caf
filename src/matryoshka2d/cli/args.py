"""Options shared by several commands: the model to load, the options of a training run, key=value option
lists, the run-safety flags; and reading back which of them were given."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import yaml

POOLING_CHOICES = ["mean", "cls", "last-token"]  # models.backbones.POOLING_MODES, without importing torch here

MODEL_HELP = "short name (minilm-l6, mpnet-base), directory or hub id"
POOLING_HELP = "override the model's pooling"
DEVICE_HELP = "cpu, cuda, ... (default: cuda if available)"


# ---- Rule 4: every option is checked where it is parsed -------------------------------------------------------
# Converters for argparse's `type=`: a bad value stops the command at parse time, before anything loads, with
# argparse's one line `matryoshka2d CMD: error: argument --OPTION: WHAT` (exit 2). Each names the value it got.


def _whole(text: str) -> int:
    """A whole number written as one (digits, an optional sign): '1e3', '2.0', '' and 'abc' are not."""
    if not re.fullmatch(r"\s*[+-]?\d+\s*", text or ""):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(text)


def positive_int(text: str) -> int:
    """A whole number of at least 1 (a count of steps, texts, workers, a layer, a width)."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def count(text: str) -> int:
    """A whole number of at least 0 (0 meaning none or off, as the option's help says)."""
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


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
    value = _whole(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535 (0: any free port), got {value}")
    return value


def fraction(text: str) -> float:
    """A finite number from 0 to 1."""
    value = number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated whole numbers of at least 1, e.g. 64,128,384: an empty list or item is refused, not read
    as "the default" or skipped."""
    if not (text or "").strip():
        raise argparse.ArgumentTypeError("is empty: give comma-separated numbers such as 64,128,384")
    out = []
    for position, part in enumerate(text.split(","), start=1):
        if not part.strip():
            raise argparse.ArgumentTypeError(f"item {position} of {text!r} is empty: write e.g. 64,128,384")
        try:
            out.append(positive_int(part))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"item {position} of {text!r}: {exc}") from None
    return out


def cell_list(text: str) -> list[tuple[int, int]]:
    """layer:dim cells, e.g. 3:128,6:384, each number at least 1."""
    from matryoshka2d.views import parse_cells

    try:
        cells = parse_cells(text or "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    for layer, dim in cells:
        if layer < 1 or dim < 1:
            raise argparse.ArgumentTypeError(f"cell {layer}:{dim}: a layer and a width are at least 1")
    return cells


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


def _numbers_or_ranges(text: str, least: int, what: str) -> str:
    """Check one item of a --layers/--dims style option (evaluate.grid.parse_ints reads it): comma-separated whole
    numbers of at least `least` or ranges LOW-HIGH with LOW <= HIGH. A reversed range (3-1) was read as no number
    at all, so the option fell back to its default silently. The text is returned as given (parse_ints reads it)."""
    for part in (text or "").split(","):
        part = part.strip()
        if not part:  # an empty item: evaluate.grid.parse_ints names it, with the option, when the command starts
            continue
        low_text, dash, high_text = part[1:].partition("-")  # part[1:]: a leading '-' is a sign, refused below
        low_text = part[0] + low_text
        try:
            low = _whole(low_text)
            high = _whole(high_text) if dash else low
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a whole number or a range like 1-6") from None
        if low < least:
            raise argparse.ArgumentTypeError(f"{part!r}: {what} start at {least}, got {low}")
        if high < low:
            raise argparse.ArgumentTypeError(
                f"{part!r} is a reversed range, which holds no number: write {high}-{low} (from the smaller up)"
            )
    return text


def layer_ranges(text: str) -> str:
    """Layers as 1,2,3 or 1-6 (0 is a model's static cell); a reversed range is refused."""
    return _numbers_or_ranges(text, 0, "layers")


def width_ranges(text: str) -> str:
    """Widths as 64,128 or ranges (each at least 1); a reversed range is refused."""
    return _numbers_or_ranges(text, 1, "widths")


def exit_ranges(text: str) -> str:
    """Exits as 1,2,3 or 1-5 (each at least 1: layer 0 has no exit head); a reversed range is refused."""
    return _numbers_or_ranges(text, 1, "exits")


def only_static_layers(layers) -> bool:
    """Whether every layer given (items of layer_ranges, or numbers) is 0, the static cell."""
    from matryoshka2d.evaluate.grid import parse_ints

    numbers = parse_ints([str(item) for item in layers], "layers") if layers else None
    return bool(numbers) and set(numbers) == {0}


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


# ---- Rule 2: no output overlaps an input ----------------------------------------------------------------------
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
    """Rule 2 for the command `args` runs, before it starts (inside `command_scope_of`): its output lies apart from
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
    model that has no folder here), read by the one confined reader (files.ConfinedFolder)."""
    from matryoshka2d.files import ConfinedFolder

    if not encoder.location or not Path(encoder.location).is_dir():  # not the current folder's matryoshka2d.json
        return {}
    folder = ConfinedFolder(encoder.location, "model")
    if not folder.path("matryoshka2d.json").is_file():
        return {}
    record = folder.read_json("matryoshka2d.json")
    if not isinstance(record, dict):
        raise ValueError(f"{folder.folder / 'matryoshka2d.json'}: not a JSON object (a model's record is one)")
    return record


# The options of a training run that train, two-step and pretrain share: flag -> (argparse keywords, help).
# Every one defaults to None, so that a command can tell what was given (see `given`) from its own defaults.
RUN_OPTIONS = {
    "--steps": ({"type": positive_int}, "optimizer steps (default: one epoch)"),
    "--epochs": ({"type": positive_float}, None),
    "--batch-size": ({"type": positive_int}, None),
    "--lr": ({"type": positive_float}, None),
    "--weight-decay": ({"type": non_negative_float}, None),
    "--lr-schedule": ({"choices": ["cosine", "linear"]}, None),
    "--warmup-ratio": ({"type": fraction}, None),
    "--seed": ({"type": count}, None),
    "--max-length": ({"type": token_length}, None),
    "--save-steps": ({"type": count}, "checkpoint every N steps (default 200; 0: none)"),
    "--eval-steps": ({"type": count}, None),
    "--eval-file": ({}, None),
    "--resume": ({"action": "store_true"}, "continue from the last checkpoint in --output"),
    "--quiet": ({"action": "store_true"}, "no progress bars"),
}


def run_options(p, *flags: str, **helps: str) -> None:
    """Add these training-run options, in this order; `helps` (by option name: batch_size="...") gives a
    command's own help for one."""
    for flag in flags:
        keywords, text = RUN_OPTIONS[flag]
        text = helps.get(flag[2:].replace("-", "_"), text)
        p.add_argument(flag, **keywords, **({"help": text} if text else {}))


def run_training(entry, values: dict, args):
    """Start `entry` (training.trainer.train, compress.smae.pretrain) on a TrainConfig of `values`, with the run
    options every training command has: --resume, --quiet, --overwrite, --allow-pickle-checkpoint."""
    from matryoshka2d.training.config import TrainConfig

    return entry(
        TrainConfig.from_dict(values),
        resume=args.resume,
        progress=not args.quiet,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle_checkpoint,
    )


def given(args, names) -> dict:
    """The options among `names` given on the command line, by name: a value, or a switch turned on (None, and
    False for a switch, mean not given, so that a preset's or a config file's value stands)."""
    return {name: value for name in names if (value := getattr(args, name, None)) is not None and value is not False}


def training_options(args, but=()) -> dict:
    """The flags named like a TrainConfig option (--batch-size: batch_size) that were given, except `but`."""
    import dataclasses

    from matryoshka2d.training.config import TrainConfig

    return given(args, [f.name for f in dataclasses.fields(TrainConfig) if f.name not in but])


def parse_options(values: list[str] | None, flag: str) -> dict:
    """key=value pairs; values parsed as YAML scalars/lists (k=128, sizes=[[1,32],[6,384]], dynamic_weights=true)."""
    out = {}
    for item in values or []:
        if "=" not in item:
            raise ValueError(f"{flag} expects key=value, got '{item}'")
        key, value = item.split("=", 1)
        out[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return out


def add_safety_flags(p, overwrite: bool = True) -> None:
    """--overwrite and --allow-pickle-checkpoint, shared by train and pretrain."""
    if overwrite:
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="train into an --output that already holds a model or run, deleting its checkpoints and log",
        )
    p.add_argument(
        "--allow-pickle-checkpoint",
        action="store_true",
        help="when resuming, read a checkpoint written by an older matryoshka2d (state.pt, a pickle). RISK: "
        "unpickling a file can run code planted in it; use only on checkpoints you wrote yourself",
    )
