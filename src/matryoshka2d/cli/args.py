"""Options shared by several commands: the model to load, key=value option lists, the run-safety flags."""

from __future__ import annotations

import yaml


def model_args(p, default="minilm-l6", heads: bool = True) -> None:
    p.add_argument("--model", default=default, help="short name (minilm-l6, mpnet-base), directory or hub id")
    p.add_argument("--pooling", choices=["mean", "cls", "last-token"], help="override the model's pooling")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    if heads:
        heads_flag(p)


def heads_flag(p) -> None:
    p.add_argument(
        "--no-heads",
        action="store_true",
        help="leave the model's exit heads off: shallow cells are the pooled layer itself (to compare both)",
    )


def load_encoder(args, model: str | None = None, log=None, **options):
    """The ElasticEncoder a command's --model (or `model`), --pooling, --device and --no-heads ask for. With
    --no-heads it says whether the folder had heads to leave off."""
    import sys

    from matryoshka2d.models.backbones import check_device
    from matryoshka2d.models.encoder import ElasticEncoder

    device = options.pop("device", getattr(args, "device", None))
    check_device(device)
    no_heads = bool(getattr(args, "no_heads", False))
    encoder = ElasticEncoder(
        model or args.model, pooling=getattr(args, "pooling", None), device=device, heads=not no_heads, **options
    )
    if no_heads:
        said = "exit heads left off (--no-heads)" if encoder.folder_has_heads else "--no-heads: it has no exit heads"
        (log or (lambda m: print(m, file=sys.stderr)))(f"{encoder.name}: {said}")
    return encoder


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
