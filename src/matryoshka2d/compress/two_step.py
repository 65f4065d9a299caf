"""Two-step training of a pooler-compressed model (Wang et al., "On the Dimensionality of Sentence
Embeddings", sec. 4, Algorithm 1), with the paper's Table 1/2 report.

The model is an encoder plus a pooler head D -> d with tanh (matryoshka2d.models.pooler). Algorithm 1, as we run it:
  line 2   train the model end to end with out_dim = d (the target) and keep pooler_d (and encoder_d);
  line 3-5 train the model end to end with out_dim = d' for every candidate d', and evaluate each encoder_d'
           on the validation set E;
  line 6   encoder_opt = the best of them on E;
  line 7   concatenate encoder_opt and pooler_d (pooler_d as trained in line 2);
  line 8   fine-tune pooler_d on the same training data and loss with encoder_opt frozen -> new_pooler_d;
  line 9   return encoder_opt + new_pooler_d.

Readings of what the paper leaves open:
- "Evaluate encoder_d' on E": the encoder alone, its pooled vector at full width with the pooler dropped, as in
  Table 2's last block ("Encoder_d, pooler_d used only in training"), whose best row gives opt there. E is
  STS-B dev (Spearman x 100 of cosine, via the trainer's `sts_dev_score`); --validation-file changes it.
- Line 2 always trains the target size, so pooler_d always starts from its end-to-end weights, never fresh
  (sec. 4.3, point 2: fine-tuning from the current parameters beats a random start). When d is also a
  candidate, the line-2 run is that candidate's run (it is the same training), as Table 2's "+0.00" at
  d = opt = 512 shows.
- Several targets can be given at once: the end-to-end runs are shared (every target is one of the runs, and
  the selection does not depend on d), then lines 7-9 run per target.
- Step 2 "until the model achieves the optimal performance": a fixed number of steps, by default as many as
  each step-1 run, at the step-1 learning rate (--pooler-steps, --pooler-lr). The frozen encoder still
  applies dropout in training mode (parameters frozen, not the noise: SimCSE's positives come from dropout).
  A loss with its own parameters (softmax's classifier) gets a fresh classifier in step 2: step 1 does not
  save it.
- The report evaluates every stage at the full depth and width d on --report-file, STS-B test by default
  (Tables 1 and 2 report STS-B), and also gives the validation scores.
- Candidate dims default to 8, 16, 32, ... below D, and D (the paper's Figure 4 range, 768 down to 4, halving).

Every training run is an ordinary `matryoshka2d train` run (method plain, pooler_dim d) in
OUTPUT/runs/pooler-<d>/; a killed two-step resumes with the same command: finished runs are reused (their
settings must match), an unfinished one resumes from its last checkpoint, and checkpoints of finished runs are
deleted to save space.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from matryoshka2d import outputs
from matryoshka2d.cells import nested_dims
from matryoshka2d.confined import ConfinedFolder

# TrainConfig options that two-step sets itself, per run.
MANAGED = ("model", "method", "loss", "data", "output", "pooler_dim", "freeze_encoder", "eval_file")
# Settings a finished run must share with the current command to be reused.
RUN_KEYS = ("model", "loss", "data", "steps", "epochs", "batch_size", "lr", "seed", "pooler_dim", "freeze_encoder")


@dataclass
class TwoStepConfig:
    data: list[str]
    output: str
    target_dims: list[int]
    candidate_dims: list[int] | None = None  # default: 8, 16, 32, ... below D, and D
    model: str = "minilm-l6"
    loss: str = "simcse"  # Table 1 (SimCSE); "softmax" on NLI pairs for Table 2
    validation_file: str | None = None  # E: STS-B dev by default
    report_file: str | None = None  # STS-B test by default
    pooler_steps: int | None = None  # step 2: default the step-1 length
    pooler_lr: float | None = None  # step 2: default the step-1 learning rate
    train: dict = field(default_factory=dict)  # any other TrainConfig option (steps, batch_size, lr, seed, ...)


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def check_dims(dims, hidden: int, what: str) -> list[int]:
    """Distinct pooler sizes, each an integer in 1..hidden; the error names the bad one."""
    if not dims:
        raise ValueError(f"two-step: no {what} given")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            raise ValueError(f"two-step: {what} must be integers, got {d!r}")
        if d < 1:
            raise ValueError(f"two-step: {what} {d} must be at least 1")
        if d > hidden:
            raise ValueError(f"two-step: {what} {d} is larger than the model's hidden size {hidden}")
        if d not in out:
            out.append(d)
    return out


def _default_file(name: str) -> Path:
    from matryoshka2d.paths import sts_file

    return sts_file(name)


def _score(model_dir: Path, path: Path, without_pooler: bool = False, device=None) -> float:
    """Spearman x 100 on one STS file at the full depth and the embedding width (the head's d, or D alone)."""
    from matryoshka2d.evaluate.sts import sts_dev_score
    from matryoshka2d.models.encoder import ElasticEncoder

    encoder = ElasticEncoder(str(model_dir), device=device)
    if without_pooler:
        encoder.set_pooler(None)
    return round(sts_dev_score(encoder, path, encoder.num_layers, encoder.hidden_size), 2)


def _or_worst(score: float) -> float:
    """An undefined correlation (constant embeddings) ranks below every defined one."""
    return score if math.isfinite(score) else -math.inf


def _train(values: dict, progress: bool, allow_pickle: bool = False) -> Path:
    """One `matryoshka2d train` run; a finished run with the same settings is reused, an unfinished one resumed."""
    from matryoshka2d.training.config import TrainConfig
    from matryoshka2d.training.trainer import Trainer

    config = TrainConfig.from_dict(values)
    out = Path(config.output)
    done = ConfinedFolder(out, "run").path("matryoshka2d.json")  # a run holding a link out is refused, not read
    if done.is_file():
        saved = json.loads(done.read_text(encoding="utf-8")).get("training", {})
        mine = {k: getattr(config, k) for k in RUN_KEYS}
        differ = [k for k in RUN_KEYS if saved.get(k) != mine[k]]
        if differ:
            raise ValueError(
                f"{out} holds a finished run with other settings ({', '.join(differ)}); delete it or choose "
                "another --output"
            )
        _log(f"two-step: reusing the finished run {out}")
        return out
    _log(f"two-step: training {out.name} (pooler {config.pooler_dim}, frozen encoder: {config.freeze_encoder})")
    Trainer(config).run(resume=True, progress=progress, allow_pickle=allow_pickle)
    outputs.remove_tree(out / "checkpoints")  # the run is finished; its model is saved (a link: refused)
    return out


def _combine(encoder_dir: Path, pooler_dir: Path, out: Path, device=None) -> tuple[Path, bool]:
    """Algorithm 1, line 7: encoder_opt with pooler_d's trained head, saved as a model folder.
    Returns the folder and whether it was (re)built (a new encoder_opt makes any step-2 result stale)."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.pooler import PoolerHead
    from matryoshka2d.training.checkpoints import save_model_atomically

    marker = {"encoder": str(encoder_dir), "pooler": str(pooler_dir / "2_Dense")}
    meta = ConfinedFolder(out, "model").path("matryoshka2d.json")
    if meta.is_file() and json.loads(meta.read_text(encoding="utf-8")).get("two_step_combination") == marker:
        return out, False
    encoder = ElasticEncoder(str(encoder_dir), device=device)
    encoder.set_pooler(PoolerHead.load(pooler_dir / "2_Dense"))
    save_model_atomically(lambda folder: encoder.save(folder, metadata={"two_step_combination": marker}), out)
    return out, True


def run_two_step(config: TwoStepConfig, progress: bool = True, allow_pickle: bool = False) -> dict:
    """Run Algorithm 1 for every target dim; write two_step.json and two_step.md into the output folder."""
    from matryoshka2d.evaluate.sts import load_pairs
    from matryoshka2d.losses import TASK_LOSSES
    from matryoshka2d.models.encoder import ElasticEncoder

    start = time.perf_counter()
    clash = sorted(set(config.train) & set(MANAGED))
    if clash:
        raise ValueError(f"two-step sets {', '.join(clash)} itself; do not pass them as training options")
    if config.loss not in TASK_LOSSES:
        raise ValueError(f"Unknown loss '{config.loss}'; choose one of {', '.join(TASK_LOSSES)}")
    if not config.data:
        raise ValueError("two-step needs training data (--data)")
    validation = Path(config.validation_file) if config.validation_file else _default_file("stsb_dev.tsv")
    report = Path(config.report_file) if config.report_file else _default_file("stsb_test.tsv")
    for path in (validation, report):
        load_pairs(path)  # fail now, not after hours of training
    device = config.train.get("device")
    probe = ElasticEncoder(config.model, pooling=config.train.get("pooling"), device=device)
    hidden, layers = probe.transformer_size, probe.num_layers
    del probe
    targets = check_dims(config.target_dims, hidden, "target dim")
    candidates = check_dims(config.candidate_dims or nested_dims(hidden), hidden, "candidate dim")
    out = outputs.make_folder(Path(config.output))
    base = {**config.train, "model": config.model, "method": "plain", "loss": config.loss, "data": config.data}
    base["eval_file"] = str(validation)

    # Step 1 (lines 2-6): end-to-end runs at every target and candidate size, then the best encoder on E.
    runs: dict[int, Path] = {}
    for d in sorted(set(targets) | set(candidates), reverse=True):
        runs[d] = _train({**base, "pooler_dim": d, "output": str(out / "runs" / f"pooler-{d}")}, progress, allow_pickle)
    encoder_only = {
        d: {
            "validation": _score(run, validation, without_pooler=True, device=device),
            "report": _score(run, report, without_pooler=True, device=device),
        }
        for d, run in runs.items()
    }
    opt = max(candidates, key=lambda d: _or_worst(encoder_only[d]["validation"]))
    _log(f"two-step: encoder_opt = encoder_{opt} ({encoder_only[opt]['validation']} on {validation.name})")

    # Step 2 (lines 7-9), per target: encoder_opt + pooler_d, then pooler_d fine-tuned with the encoder frozen.
    step2 = dict(base)
    if config.pooler_steps is not None:
        step2["steps"] = config.pooler_steps
    if config.pooler_lr is not None:
        step2["lr"] = config.pooler_lr
    rows = []
    for d in targets:
        combined, rebuilt = _combine(runs[opt], runs[d], out / f"step1-d{d}", device)
        final_dir = out / f"two-step-d{d}"
        if rebuilt and final_dir.exists():
            outputs.remove_tree(final_dir)  # fine-tuned on another encoder_opt: stale (a link: refused)
        values = {**step2, "model": str(combined), "pooler_dim": d, "freeze_encoder": True, "output": str(final_dir)}
        final = _train(values, progress, allow_pickle)
        stages = {"end_to_end": runs[d], "after_step1": combined, "after_step2": final}
        row = {"dim": d, "models": {k: str(v) for k, v in stages.items()}}
        for name, model_dir in stages.items():
            row[name] = {
                "validation": _score(model_dir, validation, device=device),
                "report": _score(model_dir, report, device=device),
            }
        row["encoder_only"] = encoder_only[d]
        rows.append(row)

    result = {
        "method": "two-step training (Wang et al., On the Dimensionality of Sentence Embeddings, Algorithm 1)",
        "model": config.model,
        "layers": layers,
        "hidden_size": hidden,
        "loss": config.loss,
        "data": list(config.data),
        "validation_file": str(validation),
        "report_file": str(report),
        "metric": "Spearman x 100 of cosine vs gold, full depth, width d",
        "target_dims": targets,
        "candidate_dims": candidates,
        "opt": opt,
        "selection": [{"dim": d, **encoder_only[d]} for d in candidates],
        "targets": rows,
        "training": {**config.train, "pooler_steps": config.pooler_steps, "pooler_lr": config.pooler_lr},
        "seconds": round(time.perf_counter() - start, 1),
    }
    outputs.write_text(out / "two_step.json", json.dumps(result, indent=2, default=str))
    outputs.write_text(out / "two_step.md", markdown(result))
    return result


def markdown(result: dict) -> str:
    """The paper's Table 1/2 layout: one column per target d, the stages as rows, gains in brackets."""
    rows = result["targets"]
    lines = [
        f"# Two-step training: {result['model']}, loss {result['loss']}",
        "",
        f"opt = {result['opt']} (best encoder alone on {Path(result['validation_file']).name}); "
        f"candidates {', '.join(map(str, result['candidate_dims']))}.",
        "",
    ]
    splits = [("report", result["report_file"]), ("validation", result["validation_file"])]
    if result["report_file"] == result["validation_file"]:
        splits = splits[:1]
    for split, file in splits:
        lines += [f"## {Path(file).name} ({result['metric']})", ""]
        lines.append("| pooler output dim d | " + " | ".join(str(r["dim"]) for r in rows) + " |")
        lines.append("|---|" + "---:|" * len(rows))
        previous = None
        for key, label in (
            ("end_to_end", "Encoder_d + pooler_d (end-to-end training)"),
            ("after_step1", "Encoder_opt + pooler_d (after step 1)"),
            ("after_step2", "Encoder_opt + new-pooler_d (after step 2)"),
        ):
            cells = []
            for r in rows:
                value = r[key][split]
                gain = "" if previous is None else f" ({value - r[previous][split]:+.2f})"
                cells.append(f"{value:.2f}{gain}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
            previous = key
        cells = [f"{r['encoder_only'][split]:.2f}" for r in rows]
        lines.append("| Encoder_d alone, full width (pooler_d used only in training) | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Encoder selection (encoder alone, full width)",
        "",
        "| d' | validation | report |",
        "|---:|---:|---:|",
    ]
    for s in result["selection"]:
        mark = " (opt)" if s["dim"] == result["opt"] else ""
        lines.append(f"| {s['dim']}{mark} | {s['validation']:.2f} | {s['report']:.2f} |")
    return "\n".join(lines) + "\n"
