"""`matryoshka2d distill`: exits (or a query encoder) trained towards the teacher's own vectors on unlabelled text
(matryoshka2d.training.distill)."""

from __future__ import annotations

import argparse

from matryoshka2d.cli.args import POOLING_CHOICES, cell_list, positive_float, positive_int, reads_and_writes, width_list
from matryoshka2d.cli.run_options import add_safety_flags, run_options, run_training, training_options
from matryoshka2d.training.distill_options import check_eval_cells, check_exit_heads_sentences
from matryoshka2d.training.distill_recipe import RECIPE_CHOICES

# The run's defaults; the learning rate, the number of epochs and the passages' length are the measured recipe's
# (training.distill_recipe.recipe, which says in one line what it chose); every one can be given.
DEFAULTS = {"batch_size": 64, "warmup_ratio": 0.05, "save_steps": 100}


def check_combination(args) -> None:
    """Options that would do nothing with the others given are refused, not ignored (rule 4)."""
    if args.mode == "query" and args.layer is None:
        raise ValueError("--mode query needs --layer n: the query encoder keeps the teacher's first n layers")
    if args.mode != "query" and args.layer is not None:
        raise ValueError(f"--layer is for --mode query (the shared mode trains every exit), got --layer {args.layer}")
    check_eval_cells(args.mode, args.layer, args.eval_cell)  # as DistillTrainer does for a library caller
    if args.mode == "static":
        heads = [
            f"--{name.replace('_', '-')}"
            for name in ("exit_heads", "exit_heads_lr", "exit_heads_inputs", "exit_heads_sentences")
            if getattr(args, name) is not None
        ]
        if heads:
            raise ValueError(
                f"{' and '.join(heads)} would do nothing with --mode static: only the static cell (layer 0) trains, "
                "the teacher's exit heads are kept as they are; leave "
                f"{'them' if len(heads) > 1 else 'it'} out (or use --mode shared or query)"
            )
    check_exit_heads_sentences(args.exit_heads, args.exit_heads_sentences is not None)
    if args.temperature is not None and args.loss != "relational":
        raise ValueError(f"--temperature is the softmax temperature of --loss relational; --loss {args.loss} has none")
    if args.engine != "ray" and (args.address or args.workers is not None):
        raise ValueError("--address and --workers are for --engine ray")


def cmd_distill(args) -> int:
    from matryoshka2d.training.distill import distill

    check_combination(args)
    values = {**DEFAULTS, **training_options(args, but=("eval_cell", "exclude_sts_test", "loss"))}
    values.update(
        model=args.teacher,
        method="distill",
        loss=args.loss,
        exclude_sts_test=args.exclude_sts_test,
        exit_heads=args.exit_heads,
    )
    options: dict = {"mode": args.mode, "recipe_for": recipe_for(values)}
    if args.layer is not None:
        options["layer"] = args.layer
    if args.widths:
        options["widths"] = args.widths
    if args.max_texts is not None:
        options["max_texts"] = args.max_texts
    if args.temperature is not None:
        options["temperature"] = args.temperature
    values["method_options"] = options
    if args.eval_cell:
        cells = [list(c) for c in args.eval_cell]
        values["eval_cell"] = cells[0] if len(cells) == 1 else cells
    entry = distill
    if args.engine == "ray":
        engine = ray_targets(args, values)
        entry = lambda config, **kw: distill(config, targets_engine=engine, **kw)  # noqa: E731
    out = run_training(entry, values, args)
    print(f"student saved to {out}")
    return 0


def recipe_for(values: dict) -> list[str]:
    """The options the measured recipe chooses: those not given (--steps stands for --epochs; --max-length for
    the passages' length)."""
    given = {
        "lr": "lr",
        "epochs": "epochs",
        "steps": "epochs",
        "max_length": "passage_tokens",
        "weight_decay": "weight_decay",
    }
    taken = {given[name] for name in given if name in values}
    return [name for name in RECIPE_CHOICES if name not in taken]


def ray_targets(args, values: dict):
    """teacher -> engine(texts, chunk): the teacher's unit last-layer vectors computed on Ray, one model per actor,
    as `index build --engine ray` encodes a corpus (retrieval.ray_engine); chunks come back in order."""
    from matryoshka2d.retrieval.ray_engine import encode_on_ray, require_ray

    require_ray(local=args.address is None)

    def make(teacher_name: str):
        def engine(texts, chunk: int):
            from matryoshka2d.models.encoder import ElasticEncoder

            teacher = ElasticEncoder(
                teacher_name, pooling=values.get("pooling"), max_length=values.get("max_length"), device="cpu"
            )  # as loaded from its folder: the model every worker loads
            top, width = teacher.num_layers, teacher.hidden_size
            blocks = [
                (n, [(str(b + i), t) for i, t in enumerate(texts[b : b + chunk])])
                for n, b in enumerate(range(0, len(texts), chunk))
            ]
            done: dict[int, object] = {}
            encode_on_ray(
                teacher,
                blocks,
                [(top, width)],
                values.get("batch_size", 64),
                lambda number, _ids, _texts, arrays: done.__setitem__(number, arrays[f"cell-{top}x{width}"]),
                address=args.address,
                workers=args.workers,
            )
            for n in range(len(blocks)):
                yield done[n]

        return engine

    return make


def register(sub, model_args) -> None:
    p = sub.add_parser(
        "distill",
        help="train exits (or a query encoder) towards the full model's own vectors on unlabelled text",
        description="The student starts as a copy of the teacher; the teacher's last-layer vectors (unit length) "
        "of every text are computed once into the run folder, and the student's exits learn to land on them. "
        "--mode shared trains every exit and its head and ties the last layer to the teacher: one 2D model. "
        "--mode query --layer n trains the first n layers and a head: a query encoder whose vectors live in the "
        "teacher's space, so an index the teacher built stays valid (search --query-model).",
    )
    p.add_argument("--teacher", default="minilm-l6", help="the full model: short name or folder (default minilm-l6)")
    p.add_argument("--pooling", choices=POOLING_CHOICES, help="the teacher's pooling, if its folder does not say")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="training files (their texts, no labels), plain text files, or BEIR corpora (documents cut into "
        "passages of at most --max-length tokens); duplicates are dropped",
    )
    p.add_argument("--max-texts", type=positive_int, help="use the first N distinct texts of --data (default: all)")
    p.add_argument("--output", required=True, help="folder for the student, its log, checkpoints and the targets")
    _student_options(p)
    _exit_heads_options(p)
    _run_options(p)
    p.add_argument("--eval-cell", type=cell_list, help="layer:dim to evaluate on STS-B dev, or several: 3:128,6:384")
    p.add_argument(
        "--exclude-sts-test",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="leave out every sentence of the STS test sets (compared by lower-cased words; default on)",
    )
    _engine_options(p)
    run_options(p, "--resume", "--quiet")
    add_safety_flags(p)
    p.set_defaults(func=cmd_distill)
    reads_and_writes(p, ("--teacher", "--data", "--eval-file"))


def _student_options(p) -> None:
    """What the student is (a 2D model, a query encoder, a static cell) and what it learns by."""
    p.add_argument(
        "--mode",
        choices=["shared", "query", "static"],
        default="shared",
        help="one 2D model, a query encoder, or a static cell (layer 0: model2vec's token table and a head)",
    )
    p.add_argument("--layer", type=positive_int, help="query mode: the student keeps this many of the teacher's layers")
    p.add_argument(
        "--loss",
        choices=["cos", "mse", "relational"],
        default="cos",
        help="1 - cos (default), squared distance to the teacher's unit vector, or KL between in-batch "
        "similarity distributions; each on nested prefixes of --widths",
    )
    p.add_argument(
        "--widths", type=width_list, help="nested prefixes the loss covers, e.g. 64,128,256,384 (default: the model's)"
    )
    p.add_argument("--temperature", type=positive_float, help="relational: the softmax temperature (default 0.05)")


def _exit_heads_options(p) -> None:
    p.add_argument(
        "--exit-heads",
        choices=["fit", "identity", "keep"],
        help="how the heads start: closed-form fit on the texts, identity, or the teacher's own (default: keep "
        "when the teacher has heads, else fit)",
    )
    p.add_argument("--exit-heads-lr", type=positive_float, help="learning rate of the heads (default: --lr)")
    p.add_argument("--exit-heads-inputs", choices=["exit", "stack"], help="shared mode: what a head reads")
    p.add_argument(
        "--exit-heads-sentences", type=positive_int, help="texts the closed-form start is fitted on (default 20000)"
    )


def _run_options(p) -> None:
    """The training run's options, with what the measured recipe chooses where they are not given."""
    run_options(
        p,
        "--steps",
        "--epochs",
        "--batch-size",
        "--lr",
        "--warmup-ratio",
        "--lr-schedule",
        "--weight-decay",
        "--seed",
        "--max-length",
        "--save-steps",
        "--eval-steps",
        "--eval-file",
        epochs="passes over the texts (default: the recipe's: 3 for --mode query and static; about 2,000 steps, at "
        "most 5 epochs, for shared; the run's first line says)",
        batch_size="texts per step (default 64)",
        lr="learning rate (default: the recipe's: 2e-4 for --mode query, 3e-3 for static; 1e-4 for a 6-layer "
        "teacher, 3e-4 for 12 layers, in shared mode)",
        weight_decay="AdamW's weight decay (default 0.01; --mode static: 0, the recipe's)",
        warmup_ratio="share of the steps with a rising learning rate (default 0.05)",
        max_length="tokens per text; BEIR documents are cut into passages of this many (default: the model's; "
        "--mode query and static cut passages of 48 tokens)",
        save_steps="checkpoint every N steps (default 100)",
        eval_steps="evaluate on STS-B dev every N steps (and always at the end)",
    )


def _engine_options(p) -> None:
    """Where the teacher's targets are computed."""
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="where the teacher's targets are computed: here, or on Ray (one model per actor, as index build does)",
    )
    p.add_argument("--address", help="--engine ray: a Ray cluster's HEAD:6379 (default: a local Ray)")
    p.add_argument("--workers", type=positive_int, help="--engine ray: actors (default: the cluster's CPUs)")
