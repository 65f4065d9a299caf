"""`matryoshka2d demo --cells`: the older, quicker demo: a few sentences embedded at several cells, with their
similarities and the time per cell."""

from __future__ import annotations

import os
import time

DEMO_SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The central bank raised interest rates again this quarter.",
    "A child is riding a bicycle down the street.",
    "A kid rides a bike along the road.",
    "Fresh snow covered the mountain village overnight.",
]


def demo_cells(num_layers: int, hidden: int) -> list[tuple[int, int]]:
    """Six or fewer cells from full size down: depth spread evenly, width proportional to depth."""
    layers = sorted({max(1, round(num_layers * i / 6)) for i in range(1, 7)}, reverse=True)
    return [(n, max(8, hidden * n // num_layers // 8 * 8)) for n in layers]


def run_cells(args) -> int:
    """Embed a few sentences at several cells and show similarities and time per cell."""
    from matryoshka2d.models.encoder import ElasticEncoder

    encoder = ElasticEncoder(args.model, pooling=args.pooling, device=args.device)
    n, d = encoder.num_layers, encoder.hidden_size
    cells = demo_cells(n, d)
    # Timing text: the demo sentences repeated with a counter so that deduplication does not hide work.
    timing_texts = [f"{s} ({i})" for i in range(40) for s in DEMO_SENTENCES]
    encoder.encode(timing_texts[:64])  # warm-up
    print(f"model {encoder.name}: {n} layers x {d} dims, pooling {encoder.pooling}")
    print("pairs: P1 guitar/guitar (paraphrase), P2 child-bike/kid-bike (paraphrase), U guitar/bank (unrelated)")
    print(f"{'cell':>10} {'P1':>7} {'P2':>7} {'U':>7} {'ms/sentence':>12} {'speed-up':>9}")
    full_ms = None
    for layer, dim in cells:
        v = encoder.encode(DEMO_SENTENCES, layer=layer, dim=dim, normalize=True)
        start = time.perf_counter()
        encoder.encode(timing_texts, layer=layer, dim=dim)
        ms = (time.perf_counter() - start) * 1000 / len(timing_texts)
        full_ms = full_ms or ms
        print(
            f"{f'({layer},{dim})':>10} {v[0] @ v[1]:7.3f} {v[3] @ v[4]:7.3f} {v[0] @ v[2]:7.3f} {ms:12.2f} "
            f"{full_ms / ms:8.2f}x"
        )
    print(
        f"(time per cell: {len(timing_texts)} sentences, batch 64, {os.cpu_count()} CPU cores, torch threads "
        f"{__import__('torch').get_num_threads()})"
    )
    return 0
