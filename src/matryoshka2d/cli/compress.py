"""`matryoshka2d two-step` (pooler compression, Algorithm 1 of the dimensionality paper) and
`matryoshka2d pretrain --method smae` (Starbucks masked-autoencoder pre-training)."""

from __future__ import annotations

from matryoshka2d.cli.args import (
    add_safety_flags,
    cell_list,
    command,
    fraction,
    parse_options,
    positive_float,
    positive_int,
    reads_and_writes,
    run_options,
    run_training,
    training_options,
)
from matryoshka2d.compress.smae import DECODER_MASK_RATIO, ENCODER_MASK_RATIO
from matryoshka2d.losses import TASK_LOSSES


def parse_dims(text: str, flag: str) -> list[int]:
    """'384,256,128' -> [384, 256, 128]; the error names the flag and the bad item."""
    out = []
    for part in str(text).replace(" ", ",").split(","):
        if not part.strip():
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"{flag}: '{part}' is not an integer (write e.g. 384,128,32)") from None
    if not out:
        raise ValueError(f"{flag}: no dims in '{text}'")
    return out


def cmd_two_step(args) -> int:
    from matryoshka2d.compress.two_step import MANAGED, TwoStepConfig, run_two_step

    train = training_options(args, but=MANAGED)  # model, data, output, loss: each stage sets them for its runs
    loss_options = parse_options(args.loss_option, "--loss-option")
    if loss_options:
        train["loss_options"] = loss_options
    config = TwoStepConfig(
        data=args.data,
        output=args.output,
        target_dims=parse_dims(args.target_dim, "--target-dim"),
        candidate_dims=parse_dims(args.candidate_dims, "--candidate-dims") if args.candidate_dims else None,
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


def cmd_pretrain(args) -> int:
    from matryoshka2d.compress.smae import pretrain

    # Defaults of the SMAE paper, sec. 4.1: AdamW lr 1e-4, weight decay 0.05, cosine schedule, warm-up 0.05.
    values = {"loss": "mlm+mae", "lr": 1e-4, "weight_decay": 0.05, "lr_schedule": "cosine", "warmup_ratio": 0.05}
    values.update(training_options(args))
    options = {
        "encoder_mask_ratio": args.encoder_mask_ratio if args.encoder_mask_ratio is not None else ENCODER_MASK_RATIO,
        "decoder_mask_ratio": args.decoder_mask_ratio if args.decoder_mask_ratio is not None else DECODER_MASK_RATIO,
        "bottleneck": args.bottleneck,
        "reduction": args.reduction,
    }
    if args.sizes:
        options["sizes"] = [list(c) for c in args.sizes]
    values["method_options"] = options
    out = run_training(pretrain, values, args)
    from matryoshka2d.files import ConfinedFolder

    meta = ConfinedFolder(out, "run").read_json("matryoshka2d.json")
    print(f"pre-trained encoder saved to {out} ({meta['steps']} steps; decoder and MLM head discarded)")
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
    p.add_argument("--target-dim", required=True, help="pooler output size d, or several: 128,64,32,16,8")
    p.add_argument(
        "--candidate-dims",
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

    p = command(
        sub,
        "pretrain",
        cmd_pretrain,
        help="SMAE pre-training of a backbone (Starbucks sec. 3.2); resumable like train",
        description="Masked-LM pre-training of the encoder at a list of (layer, dim) sizes plus a one-layer "
        "decoder that reconstructs a more heavily masked copy from the size's sentence vector. Saves the "
        "encoder only; fine-tune it with `matryoshka2d train --model OUTPUT`.",
    )
    model_args(p, heads=False)
    p.add_argument("--method", choices=["smae"], default="smae")
    p.add_argument("--data", nargs="+", required=True, help="corpus: text files, one sentence per line (or TSVs)")
    p.add_argument("--output", required=True, help="folder for the pre-trained encoder, logs and checkpoints")
    run_options(
        p,
        *("--steps", "--epochs", "--batch-size", "--lr", "--weight-decay", "--lr-schedule", "--warmup-ratio"),
        *("--seed", "--max-length"),
        batch_size="default 32 (the paper: 512)",
        lr="default 1e-4 (paper sec. 4.1)",
        weight_decay="default 0.05 (paper sec. 4.1)",
        lr_schedule="default cosine (paper sec. 4.1)",
        warmup_ratio="default 0.05 (paper sec. 4.1)",
    )
    p.add_argument(
        "--sizes", type=cell_list, help="(layer,dim) list, e.g. 1:32,2:64,6:384 (default: the Starbucks SRL sizes)"
    )
    p.add_argument("--encoder-mask-ratio", type=fraction, help=f"alpha_e (default {ENCODER_MASK_RATIO})")
    p.add_argument("--decoder-mask-ratio", type=fraction, help=f"alpha_d (default {DECODER_MASK_RATIO})")
    p.add_argument(
        "--bottleneck",
        choices=["pooled", "cls"],
        default="pooled",
        help="decoder input vector: the model's pooled sentence vector (default) or the [CLS] state",
    )
    p.add_argument(
        "--reduction",
        choices=["sum", "mean"],
        default="sum",
        help="how the per-size MLM and MAE losses combine: sum (the paper's eq. 9, the default) or mean (ielab's "
        "code: (mlm + mae) / 2 per size, averaged over sizes)",
    )
    run_options(
        p,
        *("--save-steps", "--eval-steps", "--eval-file", "--resume", "--quiet"),
        eval_steps="STS-B dev check every N steps (and at the end)",
        eval_file="STS file for that check (default STS-B dev, skipped if absent)",
    )
    add_safety_flags(p)
    reads_and_writes(p, ("--model", "--data", "--eval-file"))
