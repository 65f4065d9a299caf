"""Every block of docs/guide/ marked `<!-- runnable -->` runs, command by command, as the guide writes it: on a tiny
model saved as a sentence-transformers folder standing in for minilm-l6, and on tiny data laid out like the shared
data standing in for ../shared/data, in a fresh working folder."""

import gzip
import re
import shlex
from pathlib import Path

import pytest

from helpers.data import data_root
from matryoshka2d.cli import main

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guide"
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)```", re.S)


RUNNABLE_PYTHON = re.compile(r"<!-- runnable python -->\n```python\n(.*?)```", re.S)


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(guide, block number, text) of every runnable block."""
    found = []
    for guide in sorted(GUIDES.glob("*.md")):
        for number, block in enumerate(RUNNABLE.findall(guide.read_text(encoding="utf-8")), start=1):
            found.append((guide.name, number, block))
    return found


def commands(block: str) -> list[list[str]]:
    """The block's commands: continuation lines joined, comments dropped, each split as the shell would."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def stand_in(argument: str, stand_ins: dict[str, str]) -> str:
    """`minilm-l6` -> the tiny model; `../shared/data/x` -> the tiny data's x."""
    for name, path in stand_ins.items():
        if argument == name or argument.startswith(name + "/"):
            return path + argument[len(name) :]
    return argument


def test_the_guides_have_runnable_blocks():
    names = {guide for guide, _, _ in runnable_blocks()}
    assert {"heads.md", "evaluate-and-pick.md", "distill.md", "deploy.md", "retrieval.md"} <= names


@pytest.fixture(scope="module")
def stand_ins(tiny_bert, tmp_path_factory):
    """A tiny sentence-transformers folder for minilm-l6 and a tiny shared-data tree for ../shared/data."""
    root = tmp_path_factory.mktemp("guides")
    model = root / "tiny-minilm"
    tiny_bert.save(str(model))
    data = data_root(root / "data")
    corpus = data / "retrieval" / "scifact" / "corpus.jsonl"  # the shared data's corpus is gzipped
    with gzip.open(corpus.with_suffix(".jsonl.gz"), "wt", encoding="utf-8") as f:
        f.write(corpus.read_text(encoding="utf-8"))
    corpus.unlink()
    return {"minilm-l6": str(model), "../shared/data": str(data)}


@pytest.mark.parametrize(("guide", "number", "block"), runnable_blocks(), ids=lambda v: str(v)[:24])
def test_a_runnable_block_runs(guide, number, block, stand_ins, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MATRYOSHKA2D_DATA", stand_ins["../shared/data"])
    for argv in commands(block):
        assert argv[0] == "matryoshka2d", f"{guide} block {number}: only matryoshka2d commands run here: {argv}"
        argv = [stand_in(a, stand_ins) for a in argv[1:]]
        code = main(argv)
        said = capsys.readouterr().err[-2000:]
        assert code == 0, f"{guide} block {number}: `matryoshka2d {' '.join(argv)}` exited {code}: {said}"


def python_blocks() -> list[tuple[str, int, str]]:
    """(guide, block number, text) of every runnable python block."""
    found = []
    for guide in sorted(GUIDES.glob("*.md")):
        for number, block in enumerate(RUNNABLE_PYTHON.findall(guide.read_text(encoding="utf-8")), start=1):
            found.append((guide.name, number, block))
    return found


def test_the_retrieval_guide_has_a_python_block():
    assert "retrieval.md" in {guide for guide, _, _ in python_blocks()}


@pytest.mark.parametrize(("guide", "number", "block"), python_blocks(), ids=lambda v: str(v)[:24])
def test_a_python_block_runs_after_its_guides_commands(guide, number, block, stand_ins, tmp_path, monkeypatch, capsys):
    """A python block runs as written (../shared/data standing for the tiny data) in the folder where every
    runnable command block of its guide ran first, so it reads what they wrote."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MATRYOSHKA2D_DATA", stand_ins["../shared/data"])
    for _, _, commands_block in (b for b in runnable_blocks() if b[0] == guide):
        for argv in commands(commands_block):
            assert main([stand_in(a, stand_ins) for a in argv[1:]]) == 0, capsys.readouterr().err[-2000:]
    code = block.replace("../shared/data", stand_ins["../shared/data"])
    exec(compile(code, f"{guide} python block {number}", "exec"), {"__name__": "__guide__"})
    assert capsys.readouterr().out.strip(), f"{guide} python block {number} printed nothing"
