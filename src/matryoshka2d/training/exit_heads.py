"""Exit heads trained with the backbone (`train --exit-heads`, matryoshka2d.models.heads).

Every exit below the last layer gets a head; each shallow view of a method then goes through its head before
the task loss and the alignment terms (ElasticEncoder.forward applies them), so the backbone and the heads learn
together. The heads start from the closed-form fit on the run's own training sentences ("fit", the default), from
the identity ("identity"), or from the heads the model folder already has ("keep"). They have their own learning
rate (`exit_heads_lr`, default the run's): a head fitted in closed form is already close to its optimum, one
started at the identity is far from it.
"""

from __future__ import annotations

import itertools

from matryoshka2d.models.heads import ExitHeads
from matryoshka2d.models.heads_fit import fit_heads

STARTS = ("fit", "identity", "keep")
# Methods whose steps train a shallow view: only they give heads a gradient (plain and mrl train layer N only).
SHALLOW_METHODS = ("2dmse", "ese", "starbucks", "separate", "asymmetric", "distill")
FIT_BATCH = 512


def prepare(trainer) -> None:
    """Put the heads on the encoder before the optimizer is built. A model with heads trained without
    --exit-heads would save stale heads: they are dropped, and the run says so."""
    cfg, encoder = trainer.config, trainer.encoder
    if cfg.exit_heads is None:
        if encoder.exit_heads is not None:
            if trainer.processes.main:
                print(
                    f"{encoder.name}: its exit heads are dropped: training changes the backbone they were fitted on "
                    "(train with --exit-heads keep to train them along, or fit them again after training)"
                )
            encoder.set_exit_heads(None)
        return
    if cfg.exit_heads not in STARTS:
        raise ValueError(f"exit_heads must be one of {', '.join(STARTS)}, got {cfg.exit_heads!r}")
    if cfg.method not in SHALLOW_METHODS:
        raise ValueError(
            f"--exit-heads: method '{cfg.method}' trains no view below the last layer, so its heads would learn "
            f"nothing; use it with {', '.join(SHALLOW_METHODS)}"
        )
    if cfg.exit_heads == "keep":
        if encoder.exit_heads is None:
            raise ValueError(f"--exit-heads keep: {encoder.name} has no exit heads to keep; use fit or identity")
        if cfg.exit_heads_inputs not in (None, encoder.exit_heads.inputs):
            raise ValueError(
                f"--exit-heads keep --exit-heads-inputs {cfg.exit_heads_inputs}: the heads of {encoder.name} read "
                f"'{encoder.exit_heads.inputs}'; keep trains them as they are (use fit or identity for other inputs)"
            )
    else:
        layers = getattr(trainer, "head_layers", None) or range(1, encoder.num_layers)  # distill's query mode: one
        inputs = cfg.exit_heads_inputs or "exit"
        encoder.set_exit_heads(ExitHeads.identity(layers, encoder.transformer_size, encoder.hidden_size, inputs=inputs))
    for p in encoder.exit_heads.parameters():
        p.requires_grad_(True)


def regroup(trainer):
    """A function splitting the optimizer's parameter groups so that the heads' parameters get exit_heads_lr (each
    keeping its group's weight decay); None when the run trains no heads or gives them no rate of their own."""
    heads, lr = trainer.encoder.exit_heads, trainer.config.exit_heads_lr
    if trainer.config.exit_heads is None or heads is None or lr is None:
        return None
    mine = {id(p) for p in heads.parameters()}

    def split(groups: list[dict]) -> list[dict]:
        out = []
        for group in groups:
            params = list(group["params"])
            rest = [p for p in params if id(p) not in mine]
            own = [p for p in params if id(p) in mine]
            out += [{**group, "params": rest}] if rest else []
            out += [{**group, "params": own, "lr": lr}] if own else []
        return out

    return split


def fit_at_start(trainer, log=print) -> None:
    """--exit-heads fit: the closed-form heads on the run's training sentences, before the first step (a resumed
    run has its heads in the checkpoint and skips this)."""
    cfg, encoder = trainer.config, trainer.encoder
    if cfg.exit_heads != "fit" or trainer.step > 0:
        return
    # the run's own rows, row by row (what exclude_sts_test left of them), each distinct text once
    texts = (text for row in zip(*trainer.data.columns, strict=True) for text in row if text.strip())
    texts = itertools.islice(dict.fromkeys(texts), cfg.exit_heads_sentences)
    batches = iter(lambda: list(itertools.islice(texts, FIT_BATCH)), [])
    if trainer.processes.main:
        log(f"exit heads: fitting in closed form on up to {cfg.exit_heads_sentences} training sentences")
    fitted, report = fit_heads(encoder, batches, layers=encoder.exit_heads.layers, inputs=encoder.exit_heads.inputs)
    state = {k: v.to(encoder.device) for k, v in fitted.state_dict().items()}
    encoder.exit_heads.load_state_dict(state)  # in place: the optimizer holds these parameters
    encoder.exit_heads.record = {**fitted.record, "then": f"trained with the backbone ({cfg.method})"}
    if trainer.processes.active:
        trainer.processes.broadcast_from_main([encoder.exit_heads])
    if trainer.processes.main:
        log(f"exit heads: fitted on {report.sentences} sentences in {report.seconds:.1f} s")
