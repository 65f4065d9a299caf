"""Options shared by several commands: the model to load, the options of a training run, key=value option
lists, the run-safety flags; and reading back which of them were given."""

from __future__ import annotations

from pathlib import Path

import yaml

POOLING_CHOICES = ["mean", "cls", "last-token"]  # models.backbones.POOLING_MODES, without importing torch here

MODEL_HELP = "short name (minilm-l6, mpnet-base), directory or hub id"
POOLING_HELP = "override the model's pooling"
DEVICE_HELP = "cpu, cuda, ... (default: cuda if available)"


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


def check_new_output(out: Path, overwrite: bool) -> None:
    """A command that writes a new model folder never replaces a user's folder unless told to."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"--output {out} already exists and is not empty; pass --overwrite or choose another folder")


def check_not_an_input(out: Path, encoders, what: str) -> None:
    """--output must not be the folder of a model the command reads (it would be replaced while in use)."""
    if any(e.location and out.resolve() == Path(e.location).resolve() for e in encoders):
        raise ValueError(f"--output {out} is the folder of a model it reads; write {what} to a new folder")


def folder_metadata(encoder) -> dict:
    """The model folder's matryoshka2d.json (method, training record, ...), or {} for a folder without one."""
    import json

    source = Path(encoder.location or "") / "matryoshka2d.json"
    return json.loads(source.read_text(encoding="utf-8")) if source.is_file() else {}


# The options of a training run that train, two-step and pretrain share: flag -> (argparse keywords, help).
# Every one defaults to None, so that a command can tell what was given (see `given`) from its own defaults.
RUN_OPTIONS = {
    "--steps": ({"type": int}, "optimizer steps (default: one epoch)"),
    "--epochs": ({"type": float}, None),
    "--batch-size": ({"type": int}, None),
    "--lr": ({"type": float}, None),
    "--weight-decay": ({"type": float}, None),
    "--lr-schedule": ({"choices": ["cosine", "linear"]}, None),
    "--warmup-ratio": ({"type": float}, None),
    "--seed": ({"type": int}, None),
    "--max-length": ({"type": int}, None),
    "--save-steps": ({"type": int}, "checkpoint every N steps (default 200)"),
    "--eval-steps": ({"type": int}, None),
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
