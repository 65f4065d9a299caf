"""`matryoshka2d two-step`: pooler compression to d dims, Algorithm 1 of the dimensionality paper
(compress/two_step.py)."""

from __future__ import annotations

from matryoshka2d.cli.args import command, positive_float, positive_int, reads_and_writes, width_list
from matryoshka2d.cli.run_options import add_safety_flags, parse_options, run_options, training_options
from matryoshka2d.losses import TASK_LOSSES


def cmd_two_step(args) -> int:
    from matryoshka2d.compress.two_step import MANAGED, TwoStepConfig, run_two_step

    train = training_options(args, but=MANAGED)  # model, data, output, loss: each stage sets them for its runs
    loss_options = parse_options(args.loss_option, "--loss-option")
    if loss_options:
        train["loss_options"] = loss_options
    config = TwoStepConfig(
        data=args.data,
        output=args.output,
        target_dims=args.target_dim,
        candidate_dims=args.candidate_dims,
        model=args.model,
        loss=args.loss,
        validation_file=args.validation_file,
        report_file=args.report_file,
        pooler_steps=args.pooler_steps,
        pooler_lr=args.pooler_lr,
        train=train,
    )
    result = run_two_step(config, progress=not args.quiet, allow_pickle=args.allow_pickle_checkpoint)
    for row in result["targets"]:
        stages = ", ".join(f"{k} {row[k]['report']:.2f}" for k in ("end_to_end", "after_step1", "after_step2"))
        print(f"d={row['dim']} (opt={result['opt']}) on {result['report_file']}: {stages}")
    print(f"report -> {args.output}/two_step.md, {args.output}/two_step.json")
    return 0


def register(sub, model_args) -> None:
    p = command(
        sub,
        "two-step",
        cmd_two_step,
        help="pooler compression to d dims with two-step training (dimensionality paper, Algorithm 1)",
        description="Train the encoder with a D->d tanh pooler for every candidate d', pick the encoder that is "
        "best alone on the validation set, put the target pooler on it and fine-tune only the pooler. Writes "
        "two_step.json and two_step.md (the paper's Table 1/2) and the models of every stage.",
    )
    model_args(p, heads=False)
    p.add_argument(
        "--target-dim", required=True, type=width_list, help="pooler output size d, or several: 128,64,32,16,8"
    )
    p.add_argument(
        "--candidate-dims",
        type=width_list,
        help="pooler sizes whose encoders compete, e.g. 384,256,128,64,32 "
        "(default: 8, 16, 32, ... below the hidden size, and the hidden size)",
    )
    p.add_argument(
        "--data", nargs="+", required=True, help="training files (sentences for simcse; NLI pairs for softmax)"
    )
    p.add_argument(
        "--loss",
        choices=list(TASK_LOSSES),
        default="simcse",
        help="default simcse (Table 1); softmax on NLI pairs is Table 2",
    )
    p.add_argument("--output", required=True, help="folder for every run, the final models and the report")
    run_options(
        p,
        *("--steps", "--epochs", "--batch-size", "--lr", "--warmup-ratio", "--seed", "--max-length", "--save-steps"),
        steps="optimizer steps of each step-1 run (default: one epoch)",
    )
    p.add_argument(
        "--pooler-steps", type=positive_int, help="steps of the step-2 pooler fine-tuning (default: as step 1)"
    )
    p.add_argument("--pooler-lr", type=positive_float, help="learning rate of step 2 (default: as step 1)")
    p.add_argument("--validation-file", help="STS file that selects encoder_opt (default: STS-B dev)")
    p.add_argument("--report-file", help="STS file of the report (default: STS-B test)")
    p.add_argument("--loss-option", action="append", metavar="KEY=VALUE", help="e.g. temperature=0.05")
    add_safety_flags(p, overwrite=False)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    reads_and_writes(p, ("--model", "--data", "--validation-file", "--report-file"))
