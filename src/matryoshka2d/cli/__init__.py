"""The `matryoshka2d` command: one module per command group, each with `register(subparsers, model_args)`;
a command parses its arguments, calls the library and prints."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from matryoshka2d.cli.args import check_outputs, command_scope_of, model_args, output_of
from matryoshka2d.cli.failures import failure_line
from matryoshka2d.cli.help import Parser
from matryoshka2d.outputs import failure_message

# In the order `matryoshka2d --help` lists them.
COMMAND_MODULES = (
    "matryoshka2d.cli.info",  # info
    "matryoshka2d.cli.encode",  # encode
    "matryoshka2d.cli.models",  # models list, models prepare
    "matryoshka2d.cli.evaluate",  # eval (sts, classification; retrieval and mteb from their own modules)
    "matryoshka2d.cli.report",  # report, report compression
    "matryoshka2d.cli.train",  # train
    "matryoshka2d.cli.merge",  # merge
    "matryoshka2d.cli.two_step",  # two-step
    "matryoshka2d.cli.pretrain",  # pretrain
    "matryoshka2d.cli.heads",  # heads fit
    "matryoshka2d.cli.distill",  # distill
    "matryoshka2d.cli.export",  # export
    "matryoshka2d.cli.serve",  # serve
    "matryoshka2d.cli.index",  # index build
    "matryoshka2d.cli.search",  # search
    "matryoshka2d.cli.pick",  # pick
    "matryoshka2d.cli.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(  # every command's --help shows each default once (cli/help.py)
        prog="matryoshka2d", description="Sentence embeddings elastic in depth (layers) and width (dims)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub, model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # imports torch: a Ctrl-C during start-up is one line too
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("matryoshka2d: interrupted (Ctrl-C) while starting; nothing was written", file=sys.stderr)
        return 130
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: `train --processes` starts it again
    scope = None
    try:
        with command_scope_of(args) as scope:  # the one writer checks every write against the command's inputs
            scope.keep_whole(result_files(args))  # a failure puts back the result files it had written
            check_outputs(args)  # rule 1: before the command deletes or writes anything
            return args.func(args)
    except (MemoryError, OverflowError, UnicodeError) as exc:  # what no reader named: said here (cli/failures.py)
        print(f"matryoshka2d {args.command}: error: {failure_line(exc, args.argv)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback; what was written is whole (the writer renames finished files only)
        print(
            f"matryoshka2d {args.command}: interrupted (Ctrl-C); files being written were left unfinished "
            "and removed, finished ones are whole",
            file=sys.stderr,
        )
        return 130
    except Exception as exc:  # the storage failing (a full disk, from any writer), or an error the toolkit raised
        line = failure_message(exc, scope)  # in the user's paths, never the writer's temporary ones
        if line is None:
            raise  # a fault of the toolkit: its traceback
        print(f"matryoshka2d {args.command}: error: {line}", file=sys.stderr)
        return 2


def result_files(args) -> list[Path]:
    """The named result files the command writes (cli.args.reads_and_writes): one set, put back as it was when the
    command fails after writing some of them."""
    _, output, _ = output_of(args)
    names = getattr(args, "output_files", None)
    if output is None or not names:
        return []
    return [Path(output) / name if name else Path(output) for name in names]


__all__ = ["build_parser", "main"]
