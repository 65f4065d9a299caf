"""Start-up of the servers that benchmarks/serve_capacity.py (and serve_overload.py) put side by side, each one process
on the server core: our `matryoshka2d serve` at a fixed depth, llama.cpp's `llama-server` on a GGUF file, and
infinity-emb with its optimum (ONNX Runtime) engine on a folder made by benchmarks/infinity_peer.py.

Every function returns serving_harness's `Server` (pinned with taskset to ARGS.server_core, its log in ARGS.logs),
so the callers' clients, spans and pauses are the same for all three. How to make each peer: the docstring of
serve_capacity.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import checkout_env, free_port
from infinity_peer import server_command
from serving_harness import Server

# What keeps a peer to the one core it is pinned to: every library's own thread pool at one thread (taskset alone
# leaves a pool sized to the machine, whose threads then take turns on the core).
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def start_ours_fixed(
    model: str, layers: int, extra: list[str] | None = None, src: str | None = None, quantize: str | None = "int8"
) -> Server:
    """`serve --backend onnx --quantize int8 --layers N`: one depth, its session loaded up front, no adaptive depth
    (a request with no layer is answered at full depth). `src`: the source tree to run (default this checkout's);
    `quantize` None: the fp32 graph."""
    command = [sys.executable, "-m", "matryoshka2d.cli", "serve", "--model", model, "--served-name", "bench"]
    command += ["--port", str(port := free_port()), "--device", "cpu", "--log-level", "warning", "--backend", "onnx"]
    command += [*(["--quantize", quantize] if quantize else []), "--layers", str(layers), "--truncate", *(extra or [])]
    return Server("ours", command, port, checkout_env(src))


def llama_command(binary: str, gguf: str, port: int, parallel: int, batch: int, ubatch: int) -> list[str]:
    """llama-server as an embeddings server: mean pooling (minilm's), one thread for the model and one for its
    batch work. With --embedding the server itself sets n_batch = n_ubatch (a larger n_batch fails an assertion),
    so both are given."""
    command = [binary, "-m", gguf, "--embedding", "--pooling", "mean", "-t", "1", "-tb", "1"]
    command += ["--parallel", str(parallel), "--batch-size", str(batch), "--ubatch-size", str(ubatch)]
    return [*command, "--host", "127.0.0.1", "--port", str(port)]


def start_llama(binary: str, gguf: str, parallel: int, batch: int, ubatch: int) -> Server:
    port = free_port()
    return Server("llama", llama_command(binary, gguf, port, parallel, batch, ubatch), port, {**ONE_THREAD})


def start_infinity_optimum(venv: str, folder: str) -> Server:
    """infinity-emb `--engine optimum` on a folder of benchmarks/infinity_peer.py (model_quantized.onnx: int8)."""
    command, cwd, env = server_command("optimum", Path(folder).resolve(), port := free_port(), Path(venv))
    return Server("infinity", command, port, {**env, **ONE_THREAD}, cwd)


def peer_arguments(parser) -> None:
    """The options that say where the peers are; a peer whose path is not given is skipped."""
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (skipped when not given)")
    parser.add_argument("--llama-model", help="the model as GGUF (Q8_0) for llama-server")
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server --parallel")
    parser.add_argument(
        "--llama-batch",
        type=int,
        default=512,
        help="llama-server --batch-size and --ubatch-size (equal for embeddings)",
    )
    parser.add_argument("--infinity-venv", help="a virtual environment with infinity-emb (skipped when not given)")
    parser.add_argument("--infinity-folder", help="the optimum folder of benchmarks/infinity_peer.py (model_quantized)")
