"""`matryoshka2d info MODEL`: a model's layers, hidden size, pooling and parameters."""

from __future__ import annotations

from matryoshka2d.cli.args import POOLING_CHOICES, command, heads_flag


def cmd_info(args) -> int:
    from matryoshka2d.cli.args import load_encoder

    info = load_encoder(args).info()
    width = max(len(k) for k in info)
    for key, value in info.items():
        shown = f"{value:,}" if key == "parameters" else value
        print(f"{key:<{width}}  {shown}")
    return 0


def register(sub, model_args) -> None:
    p = command(sub, "info", cmd_info, help="layers, hidden size, pooling and parameters of a model")
    p.add_argument("model", help="short name, directory or hub id")
    p.add_argument("--pooling", choices=POOLING_CHOICES)
    heads_flag(p)
