"""The layout of issue 17 kept what users see: every command's --help, and exits that several threads share."""

import argparse
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from helpers.data import SENTENCES
from helpers.models import tiny_transformer
from matryoshka2d.models.encoder import ElasticEncoder

SNAPSHOT = Path(__file__).parent / "snapshots" / "help-before-layout.txt"  # taken at the move's first commit
CURRENT = Path(__file__).parent / "snapshots" / "help.txt"
# Module paths that moved (the only text --help may change): before -> after.
MOVED_PATHS = {"src/matryoshka2d/presets/": "src/matryoshka2d/training/presets/"}


def help_texts(parser: argparse.ArgumentParser, path: list[str]):
    """(command path, --help text) for the parser and every subcommand under it, depth first."""
    yield " ".join(path), parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from help_texts(sub, [*path, name])


def sections(text: str) -> dict[str, str]:
    return dict(re.findall(r"===== (.*)\n((?:(?!=====).*\n)*)", text))


def current_help(monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("COLUMNS", "100")  # the width the snapshots were taken at
    from matryoshka2d.cli import build_parser

    return sections("".join(f"===== {path}\n{text}" for path, text in help_texts(build_parser(), ["matryoshka2d"])))


def test_every_command_and_option_from_before_the_move_is_still_there_with_its_help(monkeypatch):
    """The move changed no command and no flag: every section of the snapshot taken before it still exists, and
    each of its option lines (flag and help, module paths mapped) is in today's help of that command. Later issues
    only add commands and options."""
    now = current_help(monkeypatch)
    before = SNAPSHOT.read_text(encoding="utf-8")
    for old, new in MOVED_PATHS.items():
        before = before.replace(old, new)
    for command, text in sections(before).items():
        assert command in now, f"`{command}` is gone"
        flags = re.findall(r"^  (-[-\w]+)", text, flags=re.M)
        for flag in flags:
            assert re.search(rf"^  (\S+, )?{re.escape(flag)}\b", now[command], flags=re.M), (
                f"`{command} {flag}` is gone"
            )


def test_every_help_text_equals_the_current_snapshot(monkeypatch):
    """Any change to a --help text is deliberate: tests/snapshots/help.txt is rewritten with it (python
    tests/test_layout.py --write) and the diff is reviewed."""
    now = current_help(monkeypatch)
    snapshot = sections(CURRENT.read_text(encoding="utf-8"))
    assert sorted(now) == sorted(snapshot), "commands were added or removed: rewrite the snapshot"
    for command, text in snapshot.items():
        assert now[command] == text, f"`{command} --help` changed: rewrite the snapshot"


def test_python_dash_m_runs_the_command():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "matryoshka2d.cli", "--help"], capture_output=True, text=True, check=True, timeout=120
    )
    assert "usage: matryoshka2d" in out.stdout


def test_public_names_stay_importable():
    from matryoshka2d import BackboneError, ElasticEncoder  # noqa: F401


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_eight_threads_at_different_cells_get_the_sequential_vectors(arch, tokenizer):
    encoder = ElasticEncoder.from_modules(
        tiny_transformer(arch, tokenizer.vocab_size), tokenizer, pooling="mean", name=f"tiny-{arch}", device="cpu"
    )
    texts = [t for t in SENTENCES if t] * 3
    cells = [(1, 8), (2, 16), (3, 32), (4, 32), (1, 32), (2, 8), (3, 16), (4, 8)]
    expected = {cell: encoder.encode(texts, layer=cell[0], dim=cell[1], batch_size=4) for cell in cells}
    results: dict[tuple[int, int], list[np.ndarray]] = {cell: [] for cell in cells}
    start = threading.Barrier(len(cells))
    errors = []

    def work(cell):
        try:
            start.wait()
            for _ in range(5):  # many short calls, so the threads' forward passes interleave
                results[cell].append(encoder.encode(texts, layer=cell[0], dim=cell[1], batch_size=4))
        except Exception as exc:  # reported below with its cell
            errors.append((cell, exc))

    threads = [threading.Thread(target=work, args=(cell,)) for cell in cells]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for cell in cells:
        assert len(results[cell]) == 5
        for got in results[cell]:
            np.testing.assert_array_equal(got, expected[cell], err_msg=f"cell {cell}")
    assert encoder.num_layers == 4  # never cut, not even for a moment


def test_an_exit_runs_only_its_layers(tiny_bert):
    """The exit still stops the pass: layers above the deepest one asked for never run."""
    from matryoshka2d.models.backbones import layer_stack

    ran = []
    handles = [
        layer.register_forward_hook(lambda *_a, n=n: ran.append(n))
        for n, layer in enumerate(layer_stack(tiny_bert.model), start=1)
    ]
    try:
        tiny_bert.encode(["a cat sits"], layer=2)
    finally:
        for handle in handles:
            handle.remove()
    assert ran == [1, 2]


if __name__ == "__main__":  # python tests/test_layout.py --write: the current --help texts become the snapshot
    import os
    import sys

    if sys.argv[1:] == ["--write"]:
        os.environ["COLUMNS"] = "100"
        from matryoshka2d.cli import build_parser

        texts = "".join(f"===== {path}\n{text}" for path, text in help_texts(build_parser(), ["matryoshka2d"]))
        CURRENT.write_text(texts, encoding="utf-8")
