"""What the docs cite of the tests exists: every `tests/test_*.py` a page names is a file, and every
`tests/test_x.py::test_name` a test defined there, so a page's proof of a claim cannot point at a moved test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"(tests/test_\w+\.py)(?:::(test_\w+))?")


def citations() -> list[tuple[str, int, str, str | None]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [
        (str(page.relative_to(ROOT)), number, match[1], match[2])
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        for match in CITATION.finditer(line)
    ]


def test_every_test_file_and_test_the_docs_cite_exists():
    assert citations(), "the docs cite no test: the pattern no longer matches how they cite"
    broken = []
    for page, number, path, name in citations():
        source = ROOT / path
        if not source.is_file():
            broken.append(f"{page}:{number}: {path} does not exist")
        elif name and not re.search(rf"^(?:async )?def {name}\(", source.read_text(encoding="utf-8"), re.M):
            broken.append(f"{page}:{number}: {path} defines no {name}")
    assert not broken, "\n".join(broken)
