"""Load on `matryoshka2d serve`: N concurrent clients on 127.0.0.1, throughput and latency per cell, errors, RSS.

    python benchmarks/serve_load.py [--model minilm-l6] [--clients 32] [--requests 1000] [--texts-per-request 8]
                                    [--cells 3,128 6,384]

Starts the server as a subprocess on a free port of 127.0.0.1 (nothing else is reachable or touched), waits
for /health, then for each cell sends `requests` requests of `texts-per-request` distinct STS sentences from
`clients` threads (one keep-alive connection each). Next to each cell it measures offline throughput: the same
texts through `ElasticEncoder.encode` (batch 64) in this process while the server is idle, so the ratio
served/offline is taken side by side on the same machine. RSS of the server process is read from /proc right
after loading, after an uncounted warm-up load of `--warmup-requests` requests per cell, and after the last
request.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from common import DEFAULT_DATA, header, sts_sentences

MAX_CLIENTS = 256
MAX_SECONDS = 1800  # the whole run stops here, whatever is left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [
        sys.executable,
        "-m",
        "matryoshka2d.cli",
        "serve",
        "--model",
        model,
        "--served-name",
        "bench",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        *extra,
    ]
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return process
        except OSError:
            time.sleep(0.3)
    process.terminate()
    raise RuntimeError("server did not answer /health within 180 s")


def run_load(port: int, batches: list[list[str]], layer: int, dim: int, clients: int, stop_at: float) -> dict:
    """Send every batch once from `clients` threads; latency per request, errors counted, nothing retried."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    next_index = iter(range(len(batches)))

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.monotonic() < stop_at:
            with lock:
                i = next(next_index, None)
            if i is None:
                break
            body = json.dumps(
                {"model": "bench", "input": batches[i], "layer": layer, "dimensions": dim, "encoding_format": "base64"}
            )
            start = time.perf_counter()
            try:
                conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                payload = response.read()
                ok = response.status == 200 and len(json.loads(payload)["data"]) == len(batches[i])
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                ok, payload = False, repr(exc).encode()
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if not ok:
                    errors.append(payload[:200].decode(errors="replace"))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    lat = np.array(latencies) * 1000
    texts = sum(len(b) for b in batches[: len(latencies)])
    return {
        "requests": len(latencies),
        "texts": texts,
        "seconds": seconds,
        "requests_per_s": len(latencies) / seconds,
        "texts_per_s": texts / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def offline_throughput(encoder, texts: list[str], layer: int, dim: int) -> float:
    encoder.encode(texts[:128], layer=layer, dim=dim)  # warm-up
    start = time.perf_counter()
    encoder.encode(texts, layer=layer, dim=dim, batch_size=64, normalize=True)
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=1000, help="requests per cell")
    parser.add_argument("--texts-per-request", type=int, default=8)
    parser.add_argument("--cells", nargs="+", default=["3,128", "6,384"], help="layer,dim pairs")
    parser.add_argument("--warmup-requests", type=int, default=100, help="per cell, before RSS is read")
    parser.add_argument("--server-args", default="", help="extra arguments for `matryoshka2d serve`")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS:
        parser.error(f"--clients must be 1..{MAX_CLIENTS}")
    cells = [tuple(int(x) for x in c.split(",")) for c in args.cells]
    stop_at = time.monotonic() + MAX_SECONDS

    print(header())
    need = args.requests * args.texts_per_request
    texts = sts_sentences(args.data_dir, need)
    if len(texts) < need:  # fewer distinct sentences than asked: reuse them, marked so that none is a duplicate
        texts = [f"{texts[i % len(texts)]} ({i // len(texts)})" if i >= len(texts) else texts[i] for i in range(need)]
    batches = [texts[i : i + args.texts_per_request] for i in range(0, need, args.texts_per_request)]
    print(
        f"data: {need} distinct texts (STS-B/SICK-R sentences) in {len(batches)} requests of "
        f"{args.texts_per_request}; {args.clients} concurrent clients; model {args.model}"
    )

    port = free_port()
    server = start_server(args.model, port, args.server_args.split())
    try:
        warm = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for layer, dim in cells:
            warm.request(
                "POST",
                "/v1/embeddings",
                json.dumps({"model": "bench", "input": texts[:64], "layer": layer, "dimensions": dim}),
                {"Content-Type": "application/json"},
            )
            warm.getresponse().read()
        warm.close()
        rss_loaded = rss_mb(server.pid)
        # A warm-up load (the first `--warmup-requests` batches at each cell, not counted): allocator pools and
        # kernel caches fill up to their working size here, so that growth under the measured load means a leak.
        for layer, dim in cells:
            run_load(port, batches[: args.warmup_requests], layer, dim, args.clients, stop_at)
        rss_before = rss_mb(server.pid)
        from matryoshka2d.models.encoder import ElasticEncoder

        encoder = ElasticEncoder(args.model, device="cpu")
        rows = []
        for layer, dim in cells:  # served, then offline right after with the server idle: side by side
            served = run_load(port, batches, layer, dim, args.clients, stop_at)
            rows.append((layer, dim, served, offline_throughput(encoder, texts, layer, dim)))
        rss_after = rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)

    print(
        "\n| cell | requests | errors | seconds | requests/s | texts/s served | texts/s offline | served/offline "
        "| p50 ms | p99 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layer, dim, r, off in rows:
        print(
            f"| ({layer},{dim}) | {r['requests']} | {r['errors']} | {r['seconds']:.1f} | {r['requests_per_s']:.1f} "
            f"| {r['texts_per_s']:.0f} | {off:.0f} | {r['texts_per_s'] / off:.0%} | {r['p50_ms']:.0f} "
            f"| {r['p99_ms']:.0f} |"
        )
        if r["first_error"]:
            print(f"  first error at ({layer},{dim}): {r['first_error']}")
    print(
        f"\nserver RSS: {rss_loaded:.0f} MB with the model loaded, {rss_before:.0f} MB after the warm-up load, "
        f"{rss_after:.0f} MB after the measured load ({rss_after - rss_before:+.0f} MB over the measured load, "
        f"{rss_after - rss_loaded:+.0f} MB since loading)"
    )


if __name__ == "__main__":
    main()
