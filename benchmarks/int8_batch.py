"""Does a text's vector move with what shares its call, and what int8 recipe keeps int8's point (issue 61)?

One exit of a model (default minilm-l6 at layer 6) as an fp32 ONNX graph, and int8 graphs made from it by each
recipe tried: onnxruntime's dynamic quantization as the graphs were made before (one activation scale per call),
the same graph run one text per call, the recipe the project uses now (export/onnx_graphs.quantize_int8: one
activation scale per row), onnxruntime's weight-only MatMulNBits with 8 bits and int8 compute per block
(accuracy level 4), and static scales calibrated once (QOperator, MinMax over other SciFact texts). For each, in
one process, one thread, the graphs' calls taking turns call by call (the machine's load moves all of them alike):

- ms per text in calls of 1 and of 64 (length-sorted), SciFact queries and abstracts apart, and the ratio to the
  fp32 graph in calls of 64 per round (median and spread over the rounds);
- the lowest and mean cosine to torch fp32 (encoder.forward at the layer) over all those texts;
- batch independence: 60 queries, each alone and each in a call with an abstract and the next query: the lowest
  cosine between the two vectors of a query.

Then the acceptance through `OnnxBackend` (serve/backends.py), the object `serve`, `eval --backend onnx-int8` and
`pick` run: the 60 queries alone and in a call with an abstract and a second query; texts alone and inside
requests of 8 of mixed lengths; int8 against fp32 time per text in calls of 64, in turns; int8 against torch fp32.

    python benchmarks/int8_batch.py [--model minilm-l6] [--layer 6] [--data ../shared/data/retrieval/scifact]
                                    [--rounds 5] [--work DIR]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import DEFAULT_DATA, header
from matryoshka2d.beir import corpus_file, read_beir_file
from matryoshka2d.export.onnx_graphs import export_exit, quantize_int8
from matryoshka2d.models.batching import pad_rows
from matryoshka2d.models.encoder import ElasticEncoder

QUERIES, ABSTRACTS, ALONE = 256, 128, 60  # texts timed per set; queries of the batch-independence check
SINGLES = {"queries": 32, "abstracts": 16}  # texts timed one per call
CALIBRATION = (256, 64)  # queries and abstracts (after the timed ones) the static recipe is calibrated on


def read_texts(folder: Path, path: Path, titles: bool, count: int) -> list[str]:
    return [text for _, _, text in itertools.islice(read_beir_file(folder / path, titles), count)]


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Without the memory arena: six sessions that each kept what a call of 64 abstracts needed held 9.7 GB here. It
    # costs every graph alike (4-5% more CPU per text, docs/benchmarks.md); OnnxBackend below keeps it, as it serves.
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def build_graphs(encoder: ElasticEncoder, layer: int, work: Path, calibration: list[str]) -> dict[str, Path]:
    """Every recipe's graph of `layer`, from one fp32 graph."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from onnxruntime.quantization.shape_inference import quant_pre_process

    logging.getLogger().setLevel(logging.WARNING)  # the MatMulNBits module sets the root logger to INFO on import
    fp32 = export_exit(encoder, layer, work / "fp32.onnx")
    prepared = work / "prepared.onnx"
    quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
    per_call = work / "per_call.onnx"  # the recipe before issue 61
    quantize_dynamic(str(prepared), str(per_call), weight_type=QuantType.QInt8, per_channel=True)
    nbits = MatMulNBitsQuantizer(onnx.load(str(prepared)), bits=8, block_size=32, is_symmetric=True, accuracy_level=4)
    nbits.process()
    nbits.model.save_model_to_file(str(work / "nbits8.onnx"), use_external_data_format=False)

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.calls = iter([feed(encoder, calibration[i : i + 16]) for i in range(0, len(calibration), 16)])

        def get_next(self):
            return next(self.calls, None)

    quantize_static(
        str(prepared),
        str(work / "static.onnx"),
        Calibration(),
        quant_format=QuantFormat.QOperator,
        per_channel=True,
        weight_type=QuantType.QInt8,
        activation_type=QuantType.QUInt8,
        op_types_to_quantize=["MatMul"],
        extra_options={"MatMulConstBOnly": True},
    )
    return {
        "fp32 graph": fp32,
        "int8 dynamic, one scale per call (before)": per_call,
        "int8 dynamic, one text per call": per_call,
        "int8, one scale per row (quantize_int8, now)": quantize_int8(fp32, work / "rows.onnx"),
        "MatMulNBits 8 bits, block 32, accuracy 4": work / "nbits8.onnx",
        "int8 static, calibrated once": work / "static.onnx",
    }


def feed(encoder: ElasticEncoder, texts: list[str]) -> dict[str, np.ndarray]:
    """The texts as one padded call of the graph."""
    encoded = encoder.tokenizer(texts, truncation=True, max_length=encoder.max_length)
    names = list(encoder._input_names)
    return {k: v.numpy() for k, v in pad_rows(encoder.tokenizer, encoded, list(range(len(texts))), names).items()}


def calls(encoder: ElasticEncoder, texts: list[str], size: int) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """The texts sorted by length (`order`), cut into calls of `size`."""
    encoded = encoder.tokenizer(texts, truncation=True, max_length=encoder.max_length)
    order = np.argsort([len(ids) for ids in encoded["input_ids"]], kind="stable")
    return order, [feed(encoder, [texts[i] for i in order[b : b + size]]) for b in range(0, len(order), size)]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.einsum("ij,ij->i", a, b)


def timed_rounds(runs: dict[str, object], sets: dict[str, dict[int, list]], rounds: int) -> dict:
    """CPU seconds of this thread (onnxruntime runs a one-thread session on the caller's) of each graph for each
    call of each set, in calls of 1 and of 64, rounds after rounds: {(graph, set, size): [(seconds, texts) per
    call and round]}. The graphs take turns call by call, the order rotated every round, so that a call of one
    graph and the same call of another ran seconds apart, under the same load of the machine."""
    timings = {(name, s, n): [] for name in runs for s in sets for n in (1, 64)}
    names = list(runs)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for s, by_size in sets.items():
            for n, feeds in by_size.items():
                for one in feeds:
                    for name in order:
                        start = time.thread_time()
                        runs[name](one)
                        timings[(name, s, n)].append((time.thread_time() - start, len(one["input_ids"])))
        print(f"round {r + 1} of {rounds} done", flush=True)
    return timings


def per_text_ms(timings: list[tuple[float, int]]) -> float:
    return 1000 * sum(t for t, _ in timings) / sum(n for _, n in timings)


def paired_ratio(timings: list[tuple[float, int]], reference: list[tuple[float, int]]) -> tuple[float, str]:
    """The median over the calls of a call's time against the same call's by the reference graph (seconds apart),
    and it with the quartiles of those ratios, as text."""
    ratios = np.array([t / r for (t, _), (r, _) in zip(timings, reference, strict=True)])
    low, median, high = np.percentile(ratios, [25, 50, 75])
    return float(median), f"{median:.2f} ({low:.2f}-{high:.2f})"


def one_per_call(graph):
    """A call of several texts run as one call per text, each without padding."""

    def run(one: dict[str, np.ndarray]) -> np.ndarray:
        rows = []
        for i in range(len(one["input_ids"])):
            keep = one["attention_mask"][i].astype(bool)
            rows.append(graph.run(None, {k: v[i : i + 1, keep] for k, v in one.items()})[0])
        return np.concatenate(rows)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--layer", type=int, default=6)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA / "retrieval" / "scifact")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=Path, help="folder for the graphs (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    print(header())
    print(f"onnxruntime {ort.__version__}")
    encoder = ElasticEncoder(args.model, device="cpu")
    queries = read_texts(args.data, Path("queries.jsonl"), False, QUERIES + CALIBRATION[0])
    abstracts = read_texts(args.data, corpus_file(args.data).relative_to(args.data), True, ABSTRACTS + CALIBRATION[1])
    calibration = queries[QUERIES:] + abstracts[ABSTRACTS:]
    queries, abstracts = queries[:QUERIES], abstracts[:ABSTRACTS]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        graphs = build_graphs(encoder, args.layer, work, calibration)
        sessions = {name: session(path) for name, path in graphs.items()}
        runs = {name: (lambda one, s=s: s.run(None, one)[0]) for name, s in sessions.items()}
        runs["int8 dynamic, one text per call"] = one_per_call(sessions["int8 dynamic, one text per call"])
        texts = {"queries": queries, "abstracts": abstracts}
        sets = {s: {1: calls(encoder, t[: SINGLES[s]], 1)[1], 64: calls(encoder, t, 64)[1]} for s, t in texts.items()}
        report_recipes(encoder, args.layer, runs, sets, texts, args.rounds)
        report_acceptance(encoder, args.layer, work, queries, abstracts, args.rounds)


def report_recipes(encoder, layer: int, runs: dict, sets: dict, texts: dict, rounds: int) -> None:
    every = texts["queries"] + texts["abstracts"]
    with torch.inference_mode():
        expected = encoder.pooled_states(every, [layer])[layer]
    alone_calls = [feed(encoder, [q]) for q in texts["queries"][:ALONE]]
    shared_calls = [
        feed(encoder, [q, texts["abstracts"][i % len(texts["abstracts"])], texts["queries"][(i + 1) % ALONE]])
        for i, q in enumerate(texts["queries"][:ALONE])
    ]
    quality = {}
    for name, run in runs.items():
        order, batches = calls(encoder, every, 64)
        to_torch = cosines(np.concatenate([run(one) for one in batches]), expected[order])
        alone = np.concatenate([run(one) for one in alone_calls])
        shared = np.stack([run(one)[0] for one in shared_calls])
        quality[name] = (float(to_torch.min()), float(to_torch.mean()), float(cosines(alone, shared).min()))
    timings = timed_rounds(runs, sets, rounds)
    calls_of = {s: f"{len(by_size[64])} calls of 64, {len(by_size[1])} of 1" for s, by_size in sets.items()}
    print(
        f"\n{len(texts['queries'])} SciFact queries ({calls_of['queries']}) and {len(texts['abstracts'])} abstracts "
        f"({calls_of['abstracts']}), layer {layer}, one thread, {rounds} rounds, the graphs in turns call by call; "
        "CPU ms per text; x fp32: the median over calls of 64 of a call's time against the fp32 graph's on the same "
        "call (quartiles)"
    )
    print(
        "| graph | queries, calls of 1 | queries, calls of 64 | abstracts, calls of 1 | abstracts, calls of 64 | "
        "x fp32, queries in calls of 64 | x fp32, abstracts in calls of 64 | lowest / mean cosine to torch fp32 | "
        "batch independence (lowest cosine) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in runs:
        ms = {(s, n): per_text_ms(timings[(name, s, n)]) for s in sets for n in (1, 64)}
        ratios = [paired_ratio(timings[(name, s, 64)], timings[("fp32 graph", s, 64)])[1] for s in sets]
        low, mean, independent = quality[name]
        print(
            f"| {name} | {ms[('queries', 1)]:.2f} | {ms[('queries', 64)]:.2f} | {ms[('abstracts', 1)]:.2f} | "
            f"{ms[('abstracts', 64)]:.2f} | {' | '.join(ratios)} | {low:.4f} / {mean:.4f} | {independent:.6f} |"
        )


def cut(texts: list[str], words: tuple[int, ...]) -> list[str]:
    """Each text cut to its first `words` words."""
    return [" ".join(text.split()[:n]) for text, n in zip(texts, words, strict=True)]


def report_acceptance(encoder, layer: int, work: Path, queries: list[str], abstracts: list[str], rounds: int) -> None:
    """Issue 61's acceptance through OnnxBackend, the serving backend (its graphs built in a cache under `work`)."""
    from matryoshka2d.serve.backends import OnnxBackend

    def backend(quantize):
        return OnnxBackend(encoder, quantize, [layer], cache_folder=work / "cache", threads=1, log=lambda line: None)

    fp32, int8 = backend(None), backend("int8")
    alone = np.concatenate([int8.pooled([q], layer) for q in queries[:ALONE]])
    shared = np.stack(
        [int8.pooled([q, abstracts[i], queries[(i + 1) % ALONE]], layer)[0] for i, q in enumerate(queries[:ALONE])]
    )
    # requests of 8 of mixed lengths: 3 queries, 3 abstracts, and 2 abstracts cut to 12 and 40 words
    requests = [
        [*queries[3 * r : 3 * r + 3], *abstracts[3 * r : 3 * r + 3], *cut(abstracts[3 * r + 3 : 3 * r + 5], (12, 40))]
        for r in range(len(abstracts) // 3 - 2)
    ]
    in_request = np.concatenate([int8.pooled(request, layer) for request in requests])
    by_itself = np.concatenate([int8.pooled([text], layer) for request in requests for text in request])
    with torch.inference_mode():
        expected = encoder.pooled_states(queries + abstracts, [layer])[layer]
    to_torch = cosines(int8.pooled(queries + abstracts, layer), expected)
    spent = {(q, s): [] for q in ("fp32", "int8") for s in ("queries", "abstracts")}
    chunks = [("queries", queries[i : i + 64]) for i in range(0, len(queries), 64)]
    chunks += [("abstracts", abstracts[i : i + 64]) for i in range(0, len(abstracts), 64)]
    for r in range(rounds):
        for s, texts in chunks:
            for name, graph in (("fp32", fp32), ("int8", int8)) if r % 2 == 0 else (("int8", int8), ("fp32", fp32)):
                start = time.thread_time()
                graph.pooled(texts, layer)
                spent[(name, s)].append((time.thread_time() - start, len(texts)))
    print(f"\nacceptance, through OnnxBackend (layer {layer}, one thread, {rounds} rounds in turns):")
    lines = [
        (
            f"{ALONE} queries alone and in a call with an abstract and a second query, lowest cosine",
            float(cosines(alone, shared).min()),
            ">= 0.99999",
        ),
        (
            f"{len(by_itself)} texts alone and inside {len(requests)} requests of 8 mixed lengths, lowest cosine",
            float(cosines(by_itself, in_request).min()),
            ">= 0.99999",
        ),
        (f"int8 vs torch fp32, lowest cosine over {len(to_torch)} texts", float(to_torch.min()), ">= 0.985"),
    ]
    for s in ("queries", "abstracts"):
        median, described = paired_ratio(spent[("int8", s)], spent[("fp32", s)])
        int8_ms, fp32_ms = per_text_ms(spent[("int8", s)]), per_text_ms(spent[("fp32", s)])
        lines.append(
            (
                f"int8 / fp32 CPU time in calls of 64, {s}: median over the calls {described} (int8 {int8_ms:.2f}, "
                f"fp32 {fp32_ms:.2f} CPU ms a text)",
                median,
                "<= 0.75",
            )
        )
    for what, value, bound in lines:
        met = value >= float(bound[3:]) if bound.startswith(">=") else value <= float(bound[3:])
        print(f"- {what}: {value:.6f} (needs {bound}: {'met' if met else 'NOT met'})")


if __name__ == "__main__":
    main()
