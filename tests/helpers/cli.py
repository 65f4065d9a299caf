"""Running the command line in-process and reading what it said: exit codes, the one error line, every command."""

import argparse
import os
from pathlib import Path

from matryoshka2d.cli import main


def exit_code(args) -> int:
    """main's exit code, whether the command returned it or argparse exited with it (an option refused where it is
    parsed); paths may be given, they are passed as strings."""
    try:
        return main([str(a) for a in args])
    except SystemExit as exc:
        return exc.code


def error_line(capsys, *needles) -> str:
    """The one "error:" line the command printed (no traceback, no second error), holding each of `needles`."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def sole_line(capsys) -> str:
    """Standard error, which must be exactly one line and no traceback."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def train_args(model_dir, files, out, *extra, steps=1) -> list[str]:
    """`train` on the tiny data of the `files` fixture (its triplets, its dev.tsv), batch 8, `steps` steps, into
    `out`; `extra` options after them (a later option wins)."""
    args = ["train", "--model", str(model_dir), "--pooling", "mean", "--data", str(files / "triplets.tsv")]
    args += ["--eval-file", str(files / "dev.tsv"), "--batch-size", "8", "--steps", str(steps), "--output", str(out)]
    return [*args, *extra]


def every_command(parser, path=()):
    """(words, parser) of every command and subcommand under `parser`, e.g. (("index", "build"), its parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_command(sub, (*path, name))
    if path:
        yield path, parser


def folder_bytes(folder) -> dict:
    """The bytes of every file under `folder` by relative path (links followed): equal before and after means the
    folder was not changed."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def folder_entries(folder: Path) -> dict:
    """Every entry of a folder: a file's bytes, a link's target (links are not followed), or "dir"."""
    state = {}
    for root, dirs, names in os.walk(folder):
        for name in sorted(dirs + names):
            path = Path(root) / name
            key = str(path.relative_to(folder))
            state[key] = (
                ("link", os.readlink(path)) if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
            )
    return state
