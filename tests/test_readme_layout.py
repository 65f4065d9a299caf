"""The README's layout section names what the package holds: every folder and every top-level module of
src/matryoshka2d, and the import layers' order (pyproject's contract) reads the same way, bottom to top."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "matryoshka2d"


def layout_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def test_the_readme_layout_names_every_folder_and_top_level_module():
    block = layout_block()
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    missing = [f"{f}/" for f in folders if not re.search(rf"\b{f}/", block)]
    missing += [f"{m}.py" for m in modules if not re.search(rf"\b{m}\.py\b", block)]
    assert not missing, f"README.md's layout section does not name {missing}"
    # the names column: each line's text before its description (two spaces or more)
    columns = [re.split(r"\s{2,}", line.strip(), maxsplit=1)[0] for line in block.splitlines()[2:] if line.strip()]
    named = [n for column in columns for n in re.findall(r"\b([a-z_]+)(?:/|\.py\b)", column)]
    gone = [n for n in named if n not in {*folders, *modules, "benchmarks", "docs", "tests"}]
    assert not gone, f"README.md's layout section names {gone}, which src/matryoshka2d does not hold"


def test_the_readme_lists_the_folders_in_the_order_of_the_import_layers():
    """The section reads bottom to top as pyproject's layers contract does: a folder listed below another is on
    the same layer or above it."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    layers = contract["contracts"][0]["layers"]
    level = {
        name.strip().removeprefix("matryoshka2d."): len(layers) - i
        for i, line in enumerate(layers)
        for name in line.split("|")
    }
    block = layout_block()
    order = [m for m in re.findall(r"^\s+([a-z_]+)/", block, flags=re.M) if m in level]
    levels = [level[m] for m in order]
    assert levels == sorted(levels), f"README.md's folders {order} are not bottom to top as the layers {layers}"
