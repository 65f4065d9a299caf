"""`matryoshka2d pretrain --method smae`: Starbucks masked-autoencoder pre-training of a backbone
(compress/smae.py)."""

from __future__ import annotations

from matryoshka2d.cli.args import cell_list, command, fraction, reads_and_writes
from matryoshka2d.cli.run_options import add_safety_flags, run_options, run_training, training_options
from matryoshka2d.compress.smae import DECODER_MASK_RATIO, ENCODER_MASK_RATIO


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
    from matryoshka2d.confined import ConfinedFolder

    meta = ConfinedFolder(out, "run").read_json("matryoshka2d.json")
    print(f"pre-trained encoder saved to {out} ({meta['steps']} steps; decoder and MLM head discarded)")
    return 0


def register(sub, model_args) -> None:
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
