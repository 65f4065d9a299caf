"""How every command's --help reads: one formatter for all of them, so that each option shows its default once.

`HelpFormatter` appends "(default: X)" to an option's help where the option has a default to show (not None or
off; a list as it is typed: `stsb sts16`) and its help does not already say it; a help that names its default in
its own words ("(default: the model's)", "default 10") is left as written. A description that holds line breaks
(train's lists of methods and presets, the demo's steps) is printed as written; any other is wrapped to the
terminal. `Parser` is the parser class of the `matryoshka2d` command and of every command under it (argparse's
subparsers take their parent's class), and gives each of them this formatter.
"""

from __future__ import annotations

import argparse
import copy


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default once (see the module docstring); descriptions with line breaks kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (shown := _shown_default(action)) is None or "default" in text.lower():
            return text
        return f"{text} (default: {shown})".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and (shown := _shown_default(action)) is not None:  # argparse skips an empty help
            action = copy.copy(action)
            action.help = f"(default: {shown})"
        return super()._format_action(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _shown_default(action: argparse.Action) -> str | None:
    """An option's default as the command line types it (a list: `stsb sts16`), or None where there is none to
    show (None, a switch that is off, a positional argument); '%' doubled, as argparse fills %(...)s in a help."""
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS or not action.option_strings:
        return None
    shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
    return shown.replace("%", "%%")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose --help is formatted by `HelpFormatter`, whatever formatter a command asks for: the
    same rules for every command."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)
