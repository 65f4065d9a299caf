"""Model surgery a run does once, before its first step (as nanoGPT crops its model once, never per call): a
pooler head and the freeze of two-step training, and the decoder backbones' bidirectional attention and LoRA
(ESE sec. 3.1)."""

from __future__ import annotations


def prepare_model(encoder, config) -> None:
    add_pooler(encoder, config)
    prepare_decoder(encoder, config)


def add_pooler(encoder, config) -> None:
    """A pooler head of size pooler_dim (kept if the model already has one that size), and the freeze: the
    transformer's weights stay as they are, and only a pooler head or exit heads (--exit-heads) learn."""
    dim = config.pooler_dim
    if dim is not None:
        head = encoder.head
        if head is None or head.out_features != dim:
            if head is not None:
                print(f"replacing the model's {head.describe()} head by a fresh {dim}-dim pooler")
            encoder.add_pooler(dim, seed=config.seed)
    if config.freeze_encoder:
        if encoder.head is None and config.exit_heads is None:
            raise ValueError(
                "freeze_encoder trains only the pooler head or the exit heads: give pooler_dim, a model with a "
                "pooler head, or --exit-heads"
            )
        for p in encoder.model.parameters():
            p.requires_grad_(False)


def prepare_decoder(encoder, config) -> None:
    """ESE sec. 3.1 for decoder LLMs: bidirectional attention and LoRA (mean pooling is their default)."""
    from matryoshka2d.models.decoders import set_bidirectional
    from matryoshka2d.models.lora import add_lora

    cfg = config
    if cfg.bidirectional:
        set_bidirectional(encoder.model, encoder.name)
    if cfg.lora_r is not None:
        if cfg.freeze_encoder:
            raise ValueError("lora_r and freeze_encoder exclude each other: LoRA trains adapters in the encoder")
        add_lora(encoder, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules, cfg.lora_dropout)
