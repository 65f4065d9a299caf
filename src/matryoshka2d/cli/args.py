"""Options shared by several commands: the model to load, key=value option lists, the run-safety flags."""

from __future__ import annotations

import yaml


def model_args(p, default="minilm-l6") -> None:
    p.add_argument("--model", default=default, help="short name (minilm-l6, mpnet-base), directory or hub id")
    p.add_argument("--pooling", choices=["mean", "cls", "last-token"], help="override the model's pooling")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")


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
