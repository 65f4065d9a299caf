"""How to install an optional part of matryoshka2d (an extra of pyproject.toml: onnx, qdrant, ray, mteb, ...) into
the Python that runs it.

The package is on no index, so installing it by its name with an extra (matryoshka2d[onnx]) fails. The line
`install_line` gives installs the extra from the checkout the package was installed from (`make` installs it so:
`pip install -e '.[dev]'`, and `dev` holds every extra but smollm2), with the interpreter that runs matryoshka2d,
so that it lands where it is imported; where there is no checkout (a wheel), it installs the extra's own
requirements.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the folder holding src/matryoshka2d, when installed from one


def install_line(extra: str) -> str:
    """A command that installs `extra` into the interpreter running this (`python -m pip install ...`)."""
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    if (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "src" / "matryoshka2d").is_dir():
        return f"{pip} -e {shlex.quote(f'{CHECKOUT}[{extra}]')}"
    if requirements := extra_requirements(extra):
        return f"{pip} {' '.join(shlex.quote(requirement) for requirement in requirements)}"
    return f"install the requirements of matryoshka2d's {extra!r} extra (pyproject.toml, optional-dependencies)"


def extra_requirements(extra: str) -> list[str]:
    """The requirements the installed package's metadata lists for `extra` (e.g. ['onnx>=1.16', ...]); [] where
    it lists none (an extra of another version, a source tree never installed)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        listed = requires("matryoshka2d") or []
    except PackageNotFoundError:  # run from a source tree that was never installed
        listed = []
    marker = re.compile(rf"""^(.*?)\s*;\s*extra\s*==\s*["']{re.escape(extra)}["']\s*$""")
    return [match[1] for line in listed if (match := marker.match(line))]
