"""`matryoshka2d models list|prepare`: the short model names, and a short-name model unpacked offline."""

from __future__ import annotations

from matryoshka2d.cli.args import command_group


def cmd_models(args) -> int:
    from matryoshka2d.models.backbones import SHORT_NAMES, cache_dir, minilm_dir, prepare_mpnet

    if args.action == "list":
        for name, what in SHORT_NAMES.items():
            print(f"{name:<12} {what}")
        print(f"cache: {cache_dir()}")
        return 0
    if args.name == "minilm-l6":
        print(f"minilm-l6 needs no preparation: {minilm_dir()}")
    elif args.name == "mpnet-base":
        print(f"mpnet-base ready at {prepare_mpnet(force=args.force)}")
    else:
        raise ValueError(f"Nothing to prepare for '{args.name}'; short names: {', '.join(SHORT_NAMES)}")
    return 0


def register(sub, model_args) -> None:
    msub = command_group(
        sub, "models", help="list short model names or prepare one offline", dest="action", func=cmd_models
    )
    msub.add_parser("list", help="short names and the cache directory")
    mp = msub.add_parser("prepare", help="unpack a short-name model into the cache (mpnet-base)")
    mp.add_argument("name")
    mp.add_argument("--force", action="store_true", help="unpack again even if present")
