"""Which torch.onnx exporter makes the faster graph in onnxruntime (issue 19): the same exit of the same model
written by each exporter, fp32 and quantized to int8 the way `serve --backend onnx --quantize int8` does, run
side by side in one process on the same batches (8 texts each, as the serving benchmark's requests), one thread.
Prints CPU ms per text (best of 3 passes over all batches, the exporters' passes alternating) and how far each
graph is from the torch model.

    python benchmarks/onnx_exporters.py [--model minilm-l6] [--layers 3 6] [--texts 2000] [--work DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import DEFAULT_DATA, header
from matryoshka2d.export.onnx_graphs import EXPORTERS, export_exit, graph_exporter, quantize_int8
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.training.data import read_sentences


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--data", default=str(DEFAULT_DATA / "nli" / "train_triplets.tsv"))
    parser.add_argument("--layers", nargs="+", type=int, default=[3, 6])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--per-call", type=int, default=8, help="texts per onnxruntime call")
    parser.add_argument("--work", type=Path, help="folder for the graphs (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(header())
    encoder = ElasticEncoder(args.model, device="cpu")
    texts = read_sentences(args.data)[: args.texts]
    calls = [encoder.tokenize(texts[i : i + args.per_call]) for i in range(0, len(texts), args.per_call)]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for layer in args.layers:
            with torch.inference_mode():
                expected = np.concatenate([encoder.forward(f, [layer])[layer].numpy() for f in calls])
            graphs = {}
            for exporter in EXPORTERS:
                fp32 = work / f"layer{layer}.{exporter}.onnx"
                export_exit(encoder, layer, fp32, exporters=(exporter,))
                assert graph_exporter(fp32) == exporter
                graphs[f"{exporter} fp32"] = fp32
                graphs[f"{exporter} int8"] = quantize_int8(fp32, work / f"layer{layer}.{exporter}.int8.onnx")
            sessions = {name: session(path) for name, path in graphs.items()}
            feeds = {
                name: [{i.name: f[i.name].numpy() for i in s.get_inputs()} for f in calls]
                for name, s in sessions.items()
            }
            best = dict.fromkeys(sessions, float("inf"))
            for _ in range(3):
                for name, s in sessions.items():
                    start = time.process_time()
                    for feed in feeds[name]:
                        s.run(None, feed)
                    best[name] = min(best[name], time.process_time() - start)
            print(f"\nlayer {layer}: {len(texts)} texts, {args.per_call} per call")
            print("| graph | CPU ms per text | max abs difference to torch | lowest cosine to torch |")
            print("|---|---:|---:|---:|")
            for name, s in sessions.items():
                got = np.concatenate([s.run(None, feed)[0] for feed in feeds[name]])
                cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
                print(
                    f"| {name} | {1000 * best[name] / len(texts):.3f} | {np.abs(got - expected).max():.1e} | "
                    f"{cosine.min():.4f} |"
                )
            for kind in ("fp32", "int8"):
                ratio = best[f"dynamo {kind}"] / best[f"torchscript {kind}"]
                print(f"{kind}: the TorchScript graph runs {ratio:.2f}x as fast as dynamo's")


if __name__ == "__main__":
    main()
