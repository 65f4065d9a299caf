"""One query, one call: `encoder.encode([query], layer=n)` latency at every exit, against the ideal N/n.

    python benchmarks/query_latency.py [--model minilm-l6] [--calls 300] [--rounds 3] [--threads 1]
        [--query-models STUDENT ...] [--int8]

`--query-models`: query encoders distilled from the model (`matryoshka2d distill --mode query`, timed at their own
last layer; `--mode static`, timed at their static cell, layer 0), in the same rounds as the model's exits, and
compared with the model's layer N. `--int8`: the model's layer N as `serve --backend onnx --quantize int8` runs it
(the server's own backend object, serve/backends.py, one call per query) is timed in the same rounds too, and every
query encoder is compared with it as well.

Each exit encodes each of a few short STS-B sentences one at a time, as a search front end does; a call's
latency is its wall time, and the CPU time of the process over the same calls is printed next to it (on a
machine shared with other work the CPU time moves less than the wall time). The layers are visited in
alternating order over `rounds` rounds and the best round of each is kept. Then the fixed part of a call is
split into its stages at layer 1: the tokenizer call, padding into tensors, the forward pass, and what is left
(checks, de-duplication, numpy conversion, slicing), each timed on its own over the same texts, by CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from common import DEFAULT_DATA, header, sts_sentences
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.query_record import query_encoder_layer, query_encoder_record

try:
    from matryoshka2d.models.batching import pad_rows
except ImportError:  # a checkout from before issue 19 (to time it side by side): no stage breakdown
    pad_rows = None


def time_calls(function, queries: list[str], calls: int) -> tuple[float, float]:
    """(median wall ms, mean CPU ms) of `calls` calls, cycling through the queries."""
    for q in queries[:20]:
        function(q)  # warm-up
    wall = []
    cpu_start = time.process_time()
    for i in range(calls):
        q = queries[i % len(queries)]
        start = time.perf_counter()
        function(q)
        wall.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu_start) / calls
    return statistics.median(wall) * 1000, cpu * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--calls", type=int, default=300, help="calls per exit and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a serving process)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--query-models", nargs="*", default=[], help="query encoder folders (distill --mode query or static)"
    )
    parser.add_argument("--int8", action="store_true", help="also time layer N served as an int8 ONNX graph")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(header())
    queries = [s for s in sts_sentences(args.data_dir, 400) if len(s.split()) <= 12][:50]
    enc = ElasticEncoder(args.model, device="cpu")
    lengths = [len(ids) for ids in enc.tokenizer(queries)["input_ids"]]
    print(
        f"data: {len(queries)} short STS-B sentences ({min(lengths)}-{max(lengths)} tokens, median "
        f"{int(np.median(lengths))}), one per call; {args.calls} calls per exit and round, {args.rounds} rounds"
    )
    layers = list(range(1, enc.num_layers + 1))
    students = {path: ElasticEncoder(path, device="cpu") for path in args.query_models}
    own = {path: query_encoder_layer(query_encoder_record(s) or {}, s) for path, s in students.items()}
    full = enc.num_layers
    served = {}
    if args.int8:
        from matryoshka2d.serve.backends import OnnxBackend

        served["int8"] = OnnxBackend(enc, "int8", [full], threads=args.threads)
    timed = [*layers, *served, *students]  # an exit of the model, the served model, or a query encoder's folder
    best = {n: (float("inf"), float("inf")) for n in timed}
    for r in range(args.rounds):
        for n in timed if r % 2 == 0 else timed[::-1]:
            if n in layers:
                call = lambda q, n=n: enc.encode([q], layer=n)  # noqa: E731
            elif n in served:
                call = lambda q, backend=served[n]: backend.pooled([q], full)  # noqa: E731
            else:
                call = lambda q, student=students[n], at=own[n]: student.encode([q], layer=at)  # noqa: E731
            wall, cpu = time_calls(call, queries, args.calls)
            best[n] = (min(best[n][0], wall), min(best[n][1], cpu))
    print(f"\nmodel {args.model}: {full} layers x {enc.hidden_size}, {args.threads} torch thread(s)")
    print(
        "| layer | ms per query (median wall) | CPU ms per query | speed-up vs layer N (wall) | ideal N/n "
        "| share of ideal |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n in layers:
        speedup = best[full][0] / best[n][0]
        print(
            f"| {n} | {best[n][0]:.2f} | {best[n][1]:.2f} | {speedup:.2f}x | {full / n:.2f}x | "
            f"{speedup / (full / n):.0%} |"
        )
    print(
        f"\nlayer 1 vs layer {full}: {best[full][0] / best[1][0]:.2f}x by wall time, "
        f"{best[full][1] / best[1][1]:.2f}x by CPU time (ideal {full}x)"
    )
    if served:
        wall, cpu = best["int8"]
        print(
            f"\nlayer {full} served in int8 (ONNX, the server's backend): {wall:.2f} ms per query (median wall), "
            f"{cpu:.2f} CPU ms; {best[full][0] / wall:.2f}x faster than torch"
        )
    if students:
        int8 = f" vs {args.model} layer {full} in int8 (wall) |" if served else ""
        print(
            f"\n| query encoder | runs | ms per query (median wall) | CPU ms | vs {args.model} layer {full} in torch "
            f"(wall) |{int8}"
        )
        print("|---|---|---:|---:|---:|" + ("---:|" if served else ""))
        for path, student in students.items():
            wall, cpu = best[path]
            runs = f"{student.num_layers} layers" if own[path] else "its static cell (layer 0)"
            versus = f" {best['int8'][0] / wall:.1f}x faster |" if served else ""
            print(f"| {path} | {runs} | {wall:.3f} | {cpu:.3f} | {best[full][0] / wall:.1f}x faster |{versus}")

    # Where a layer-1 call goes: each stage on its own, over the same queries.
    if pad_rows is None:
        return
    names = enc._input_names
    encoded = {q: enc.tokenizer([q], truncation=True, max_length=enc.max_length) for q in queries}
    features = {q: pad_rows(enc.tokenizer, encoded[q], [0], names) for q in queries}

    def forward(q):
        with torch.inference_mode():
            return enc.forward(features[q], [1])

    stages = {
        "tokenizer call": lambda q: enc.tokenizer([q], truncation=True, max_length=enc.max_length),
        "padding into tensors": lambda q: pad_rows(enc.tokenizer, encoded[q], [0], names),
        "forward pass to layer 1 (embeddings, layer 1, pooling)": forward,
        "whole encode() call at layer 1": lambda q: enc.encode([q], layer=1),
    }
    # CPU time per call: on a shared machine the wall-clock medians of sub-millisecond stages are mostly waiting.
    times = {name: min(time_calls(f, queries, args.calls)[1] for _ in range(args.rounds)) for name, f in stages.items()}
    whole = times.pop("whole encode() call at layer 1")
    print("\n| stage of a layer-1 call | CPU ms per call | share |")
    print("|---|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.3f} | {ms / whole:.0%} |")
    rest = whole - sum(times.values())
    print(f"| the rest (checks, de-duplication, numpy conversion, slicing) | {rest:.3f} | {rest / whole:.0%} |")
    print(f"| whole encode() call | {whole:.3f} | 100% |")


if __name__ == "__main__":
    main()
