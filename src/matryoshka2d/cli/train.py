"""`matryoshka2d train`: one command for every backbone, method and loss; `--config file.yaml` for all."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from matryoshka2d.cli.args import cell_list, fraction, positive_float, positive_int, reads_and_writes
from matryoshka2d.cli.run_options import add_safety_flags, parse_options, run_options, run_training, training_options
from matryoshka2d.losses import TASK_LOSSES
from matryoshka2d.methods import METHODS
from matryoshka2d.training import presets
from matryoshka2d.training.config import DEFAULT_LOSSES
from matryoshka2d.training.trainer import train


def _method_help() -> str:
    lines = [f"  {name:<10} {cls.summary}" for name, cls in METHODS.items()]
    recipes = [f"  {name:<16} {description}" for name, description in presets.available().items()]
    losses = [f"  {kind:<10} {name}: {why}" for kind, (name, why) in DEFAULT_LOSSES.items()]
    return (
        "methods:\n"
        + "\n".join(lines)
        + "\n\npresets (--preset NAME; sources in src/matryoshka2d/training/presets/NAME.yaml):\n"
        + "\n".join(recipes)
        + "\n\ndefault loss per kind of training data (without --loss):\n"
        + "\n".join(losses)
    )


def read_config_file(path: Path) -> dict:
    """A YAML mapping of training options; a syntax error names the file and line."""
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{path}{line}: not valid YAML ({problem}); write one 'option: value' per line") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of training options (option: value lines)")
    for name in ("method_options", "loss_options"):
        if name in loaded and not isinstance(loaded[name], dict):
            raise ValueError(
                f"{path}: {name} must be a mapping, one 'key: value' per indented line below it, got {loaded[name]!r}"
            )
    return loaded


# Options that only shape something another option turns on: given without it, they would do nothing (rule 4).
NEEDS = {
    "distill_from": ("distill_weight", "distill_loss"),
    "lora_r": ("lora_alpha", "lora_dropout", "lora_target_modules"),
}


def refuse_idle_options(values: dict) -> None:
    """The run's options (flags, --config and --preset together) hold no option whose switch is off."""
    for switch, dependents in NEEDS.items():
        given = [f"--{d.replace('_', '-')}" for d in dependents if values.get(d) is not None]
        if given and values.get(switch) is None:
            raise ValueError(
                f"{' and '.join(given)} would do nothing without --{switch.replace('_', '-')}: give it, or leave "
                f"{'them' if len(given) > 1 else 'it'} out"
            )


def cmd_train(args) -> int:
    if args.processes is not None:
        if args.processes < 1:
            raise ValueError(f"--processes must be at least 1, got {args.processes}")
        if args.processes > 1 and "WORLD_SIZE" not in os.environ:  # not yet inside torchrun: start it
            from matryoshka2d.cli import main
            from matryoshka2d.training.parallel import launch

            return launch(main, args.argv, args.processes)
    values: dict = {}
    if args.preset:
        values.update(presets.load(args.preset), preset=args.preset)
        print(f"preset {args.preset}: {presets.source(args.preset)}")
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        loaded = read_config_file(path)
        if "preset" in loaded:
            raise ValueError(f"{path}: 'preset' cannot be set in a config file; pass --preset NAME with --config")
        for key in ("method_options", "loss_options"):  # a config refines a preset's options, key by key
            if isinstance(loaded.get(key), dict) and isinstance(values.get(key), dict):
                loaded[key] = {**values[key], **loaded[key]}
        values.update(loaded)
    values.update(training_options(args, but=("eval_cell",)))  # given flags override the preset and the config
    if args.eval_cell:
        cells = [list(c) for c in args.eval_cell]
        values["eval_cell"] = cells[0] if len(cells) == 1 else cells  # several: each is evaluated
    values["method_options"] = dict(values.get("method_options") or {})
    values["loss_options"] = dict(values.get("loss_options") or {})
    values["method_options"].update(parse_options(args.method_option, "--method-option"))
    values["loss_options"].update(parse_options(args.loss_option, "--loss-option"))
    if args.sizes:
        values["method_options"]["sizes"] = [list(c) for c in args.sizes]
    if args.layer is not None or args.dim is not None:  # 0 is passed on, to be refused, not dropped
        values["method_options"].update({k: v for k, v in (("layer", args.layer), ("dim", args.dim)) if v is not None})
    refuse_idle_options(values)
    missing = [k for k in ("data", "output") if not values.get(k)]
    if missing:
        raise ValueError(f"train needs {' and '.join('--' + m for m in missing)} (or in --config)")
    out = run_training(train, values, args)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every process returns here; rank 0 saved it
        print(f"model saved to {out}")
    return 0


def register(sub, model_args) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with any method and loss",
        description="Train an elastic embedding model.\n\n" + _method_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_args(
        p,
        default=None,
        model_help="backbone: short name, directory or hub id (default minilm-l6)",
        pooling_help=None,
        device_help=None,
    )
    p.add_argument(
        "--processes",
        type=positive_int,
        help="data-parallel processes on this machine (torchrun; one GPU each with --device cuda, else CPU "
        "processes of one thread); a step sees the whole batch, as in one process",
    )
    p.add_argument("--method", choices=list(METHODS), help="training method (see above; default plain)")
    p.add_argument("--loss", choices=list(TASK_LOSSES), help="task loss (default: by kind of data, see above)")
    p.add_argument("--preset", choices=list(presets.available()), help="a paper's or reference code's recipe")
    p.add_argument("--data", nargs="+", help="training files (TSV/JSONL: triplets, NLI pairs or scored pairs)")
    run_options(p, "--steps", "--epochs", "--batch-size", "--lr", "--warmup-ratio", "--seed", "--max-length")
    p.add_argument("--output", help="folder for the trained model, logs and checkpoints")
    run_options(
        p,
        "--eval-steps",
        "--eval-file",
        eval_steps="evaluate on STS-B dev every N steps (and always at the end)",
        eval_file="STS file for the periodic evaluation (default STS-B dev)",
    )
    p.add_argument(
        "--eval-cell", type=cell_list, help="layer:dim to evaluate, or several: 1:16,2:32 (default: the full model)"
    )
    run_options(p, "--save-steps")
    _method_options(p)
    _exit_heads_options(p.add_argument_group("exit heads (a small map at every exit into the last layer's space)"))
    _distill_options(
        p.add_argument_group("distillation (the term of `matryoshka2d distill`, added to the method's loss)")
    )
    _decoder_options(p.add_argument_group("decoder backbones (ESE sec. 3.1: bidirectional, mean pooling, LoRA)"))
    _throughput_options(p.add_argument_group("throughput"))
    p.add_argument("--config", help="YAML file with any of the options above (flags override it)")
    run_options(p, "--resume", "--quiet")
    add_safety_flags(p)
    p.set_defaults(func=cmd_train)
    reads_and_writes(p, ("--model", "--data", "--eval-file", "--distill-from", "--config"))


def _exit_heads_options(g) -> None:
    g.add_argument(
        "--exit-heads",
        nargs="?",
        const="fit",
        choices=["fit", "identity", "keep"],
        help="train a head per exit with the backbone (2dmse, ese, starbucks, separate, asymmetric); it starts from "
        "the closed-form fit on the training sentences (fit, the default), the identity, or the model's own (keep)",
    )
    g.add_argument("--exit-heads-lr", type=positive_float, help="learning rate of the heads (default: --lr)")
    g.add_argument(
        "--exit-heads-inputs",
        choices=["exit", "stack"],
        help="what a head reads: its exit's pooled vector (exit, the default of fit and identity) or the pooled "
        "vectors of the embedding output and every layer up to its exit (stack); keep takes the folder's heads",
    )
    g.add_argument(
        "--freeze-encoder",
        action="store_true",
        help="keep the transformer's weights as they are and train only the heads (or a pooler head): e.g. a "
        "query head for asymmetric search against documents already indexed at the last layer",
    )


def _distill_options(g) -> None:
    g.add_argument(
        "--distill-from",
        metavar="TEACHER",
        help="a frozen teacher (same tokenizer and width) whose unit vectors of each step's texts pull every view the "
        "method trains towards them",
    )
    g.add_argument(
        "--distill-weight", type=positive_float, help="weight of the term next to the method's loss (default 1)"
    )
    g.add_argument("--distill-loss", choices=["cos", "mse", "relational"], help="the comparison (default cos)")


def _decoder_options(g) -> None:
    g.add_argument(
        "--bidirectional", action="store_true", help="non-causal attention in a Llama/Qwen2/Mistral backbone"
    )
    g.add_argument("--lora-r", type=positive_int, help="train LoRA adapters of this rank (peft); ESE uses 32")
    g.add_argument("--lora-alpha", type=positive_float, help="LoRA scaling alpha (default: the rank)")
    g.add_argument("--lora-dropout", type=fraction, help="dropout on the LoRA path (ESE uses 0.1; default 0)")
    g.add_argument(
        "--lora-target-modules",
        nargs="+",
        metavar="NAME",
        help="modules to adapt, e.g. q_proj v_proj",
    )


def _throughput_options(g) -> None:
    g.add_argument(
        "--precision", choices=["bf16", "fp16", "fp32"], help="autocast precision (default bf16 on CUDA, else fp32)"
    )
    g.add_argument(
        "--log-every", type=positive_int, help="read the loss back from the device every N steps (default 10)"
    )
    g.add_argument("--gradient-accumulation", type=positive_int, help="micro-batches per batch (default 1)")
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    g.add_argument("--compile", action="store_true", help="torch.compile each layer's blocks")
    g.add_argument(
        "--padding-free",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a step's texts in length groups instead of padding each column (default: on a CPU)",
    )


def _method_options(p) -> None:
    """A method's own settings, the rows a run keeps, and weight decay."""
    p.add_argument("--sizes", type=cell_list, help="starbucks: the (layer,dim) list, e.g. 1:32,2:64,6:384")
    p.add_argument("--layer", type=positive_int, help="separate: train the model cut to this many layers")
    p.add_argument("--dim", type=positive_int, help="separate: at this width")
    p.add_argument("--method-option", action="append", metavar="KEY=VALUE", help="e.g. k=64, kl_temperature=0.5")
    p.add_argument("--loss-option", action="append", metavar="KEY=VALUE", help="e.g. angle_weight=0.02")
    p.add_argument(
        "--filter-duplicates",
        action="store_true",
        help="drop a row that repeats a text already in its batch, as angle-emb's collator does (default off)",
    )
    p.add_argument(
        "--exclude-sts-test",
        action="store_true",
        help="drop every row holding a sentence of the STS test sets (compared by lower-cased words), so that the "
        "STS scores are of sentences the run never saw; the data folder is found as eval's is (default off)",
    )
    run_options(p, "--weight-decay")
    p.add_argument(
        "--weight-decay-exempt",
        choices=["none", "norm-and-bias"],
        help="parameters without weight decay: none (default) or biases and LayerNorm weights, as "
        "sentence-transformers' trainer and nanoGPT do",
    )
