"""The options of a training run that train, two-step, pretrain and distill share, the run-safety flags, and
reading back which of them were given (a preset's or a --config file's value stands where a flag was not)."""

from __future__ import annotations

import yaml

from matryoshka2d.cli.args import count, fraction, non_negative_float, positive_float, positive_int, seed, token_length

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
    "--seed": ({"type": seed}, None),
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
