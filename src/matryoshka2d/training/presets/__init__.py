"""Training recipes of the papers and of their reference code, one YAML file each, each citing its source.

A preset holds `description`, `source` and `options` (any `matryoshka2d train` option, as in --config).
`train --preset NAME` applies the options; --config and flags given on the command line override them.
"""

from __future__ import annotations

from importlib import resources

import yaml


def available() -> dict[str, str]:
    """Preset name -> one-line description, sorted by name."""
    out = {}
    for entry in sorted(resources.files(__name__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out[entry.name.removesuffix(".yaml")] = yaml.safe_load(entry.read_text(encoding="utf-8"))["description"]
    return out


def load(name: str) -> dict:
    """The preset's training options (a copy the caller may change)."""
    names = available()
    if name not in names:
        raise ValueError(f"unknown preset '{name}'; choose one of {', '.join(names)}")
    preset = yaml.safe_load(resources.files(__name__).joinpath(f"{name}.yaml").read_text(encoding="utf-8"))
    return dict(preset["options"])


def source(name: str) -> str:
    load(name)  # the same error for an unknown name
    return yaml.safe_load(resources.files(__name__).joinpath(f"{name}.yaml").read_text(encoding="utf-8"))["source"]
