"""Serving load, side by side: our server (torch, onnx fp32, onnx int8) against infinity (torch, optimum int8).

    python benchmarks/serve_load.py [--servers torch onnx onnx-int8 infinity-torch infinity-optimum]
        [--cells 6,384 3,128] [--clients 32] [--requests 2000] [--texts-per-request 8] [--warmup-requests 100]
        [--server-core 0] [--client-core 1] [--pause-training] [--infinity-venv VENV] [--pick-check] [--logs DIR]

Every server runs on 127.0.0.1 pinned to `--server-core` (taskset; one thread for the model), and this process,
whose `clients` threads send the requests (one keep-alive connection each), is pinned to `--client-core`: the
throughput is the server's, not the clients'. The same requests (`texts-per-request` distinct STS sentences each,
base64 vectors asked for unless `--encoding-format float`) go to every server at every cell; nothing is retried,
and a reply that is not 200 with one vector per text counts as an error.

- Ours: one `matryoshka2d serve` process serves every cell (`layer` in the request); `--backend onnx` with
  `--layers` of the cells, so its sessions load up front.
- infinity has no per-request layer: each cell's depth is a folder cut to that many layers (infinity_peer.py),
  one server per cell, `dimensions` in the request. `--engine optimum` serves optimum's int8 ONNX export.
  They run from `--infinity-venv` (how to make it: benchmarks/infinity_peer.py); without it, the default servers
  are ours only, and an infinity server named in --servers is refused.

Throughput is given twice: requests per wall-clock second, and requests per CPU second of the server process
(user + system time of all its threads over the timed span, from /proc). On a core of its own the two agree;
on a machine whose other work takes turns on the server's core (the load average is printed before each run),
the wall clock measures the share the scheduler gave the server, and the CPU figure what the server did with
it. The offline reference is given both ways too.

For each server: RSS after start-up, after an uncounted warm-up load (`--warmup-requests` per cell) and after
the measured load, both read once the server has been idle `--settle` seconds (our server gives memory back
after REST_AFTER idle; the RSS at the last reply is printed too); the vectors of a few check sentences at each
cell, re-normalised (infinity does not normalise a slice), against `ElasticEncoder.encode(..., normalize=True)`.
The offline reference of each of our servers is an offline pass of what that server runs, on the same texts, in
this process moved to the server's core with one thread: `ElasticEncoder.encode` for torch, the very graphs (same
cache) for onnx and onnx-int8; infinity is set against torch's. `--pick-check` replaces the load with the check of
`pick`'s timing: pick's one-query ms per (layer, backend), measured here as pick measures it, against what the server
delivers to one client for the same query texts, less the round trip of an empty request (GET /health).
Nothing else on the machine is stopped unless asked: `--pause-training` stops the machine's training runs (SIGSTOP to
processes whose command line holds "matryoshka2d" then "train", "distill" or "eval", or the WiSE-FT alphas script)
for each timed span only, and always continues them (SIGCONT) after it, also on errors and interrupts; what it
stopped is printed. The servers' logs go to --logs (default: runs/serve-load in the checkout).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from common import CHECKOUT_RUNS, DEFAULT_DATA, checkout_env, free_port, header, rss_mb, stop_process, sts_sentences
from pausing import Pause

OURS = ("torch", "onnx", "onnx-int8")
SERVERS = (*OURS, "infinity-torch", "infinity-optimum")
MAX_CLIENTS = 256
MAX_PAUSE_SECONDS = 14 * 60  # a timed span never keeps the training runs stopped longer than this
CHECK_TEXTS = 16
PICK_CHECK_ROUNDS = 5  # --pick-check: rounds over pick's query texts, per text the fastest
PICK_CHECK_EMPTY = 200  # --pick-check: empty requests timed for the HTTP round trip
# What --pause-training stops, as pkill -f reads it (a regular expression); this process and the servers it started
# are never stopped (pausing.Pause).
TRAINING_PATTERN = "matryoshka2d (train|distill|eval)|wise_ft_alphas"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# The machine's training runs, stopped during each timed span once --pause-training names them.
PAUSE = Pause("--pause-training")


# ---- servers ----------------------------------------------------------------------------------------


class Server:
    """One server process on 127.0.0.1, pinned; `request(texts, layer, dim)` is its request body and path."""

    def __init__(self, kind: str, port: int, command: list[str], cwd: Path | None, env: dict, layer: int | None):
        self.kind, self.port, self.layer = kind, port, layer  # layer: infinity's folder depth (None: ours)
        self.command = ["taskset", "-c", str(ARGS.server_core), *command]
        self.log = open(Path(ARGS.logs) / f"{kind}{'-L' + str(layer) if layer else ''}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(self.command, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        deadline = time.monotonic() + ARGS.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{kind} exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    self.startup_seconds = time.monotonic() - self.started
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{kind} did not answer /health within {ARGS.start_timeout} s; see {self.log.name}")

    def request(self, texts: list[str], layer: int, dim: int) -> tuple[str, str]:
        if self.kind.startswith("infinity"):
            return "/embeddings", json.dumps(
                {"model": "bench", "input": texts, "dimensions": dim, "encoding_format": ARGS.encoding_format}
            )
        body = {"model": "bench", "input": texts, "layer": layer, "dimensions": dim}
        body["encoding_format"] = ARGS.encoding_format
        return "/v1/embeddings", json.dumps(body)

    def vectors(self, texts: list[str], layer: int, dim: int) -> np.ndarray:
        path, body = self.request(texts, layer, dim)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = json.loads(reply.read())
        conn.close()
        if reply.status != 200:
            raise RuntimeError(f"{self.kind}: {reply.status} {data}")
        rows = sorted(data["data"], key=lambda d: d["index"])
        if ARGS.encoding_format == "float":
            return np.array([d["embedding"] for d in rows], dtype=np.float32)
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in rows])

    def rss(self) -> float:
        return rss_mb(self.process.pid)

    def stop(self) -> None:
        stop_process(self.process)
        self.log.close()


def start_ours(kind: str, cells: list[tuple[int, int]]) -> Server:
    env = checkout_env()
    extra = []
    if kind.startswith("onnx"):
        extra = ["--backend", "onnx", "--layers", ",".join(str(n) for n in sorted({c[0] for c in cells}))]
        extra += ["--quantize", "int8"] if kind == "onnx-int8" else []
    command = [sys.executable, "-m", "matryoshka2d.cli", "serve", "--model", ARGS.model, "--served-name", "bench"]
    command += ["--port", str(port := free_port()), "--device", "cpu", "--log-level", "warning", *extra]
    return Server(kind, port, command, None, env, None)


def start_infinity(kind: str, layer: int, folders: dict) -> Server:
    from infinity_peer import server_command

    cut, onnx = folders[layer]
    engine = kind.removeprefix("infinity-")
    command, cwd, env = server_command(engine, onnx if engine == "optimum" else cut, port := free_port(), ARGS.venv)
    env["OMP_NUM_THREADS"] = "1"
    return Server(kind, port, command, cwd, env, layer)


# ---- load ---------------------------------------------------------------------------------------------


def run_load(server: Server, batches: list[list[str]], layer: int, dim: int, clients: int) -> dict:
    """Send every batch once from `clients` threads; latency per request, errors counted, nothing retried."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    next_index = iter(range(len(batches)))
    stop_at = time.monotonic() + MAX_PAUSE_SECONDS

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        while time.monotonic() < stop_at:
            with lock:
                i = next(next_index, None)
            if i is None:
                break
            path, body = server.request(batches[i], layer, dim)
            start = time.perf_counter()
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                payload = response.read()
                ok = response.status == 200 and len(json.loads(payload)["data"]) == len(batches[i])
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                ok, payload = False, repr(exc).encode()
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
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
        "errors": len(errors) + (len(batches) - len(latencies)),
        "first_error": errors[0] if errors else None,
    }


@contextmanager
def on_core(core: int):
    """This process (all its threads) on one core for the block, back on its own core after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def offline_backend(encoder, kind: str, cells):
    """What an offline pass of server `kind` runs: torch's encode, or the very graphs the onnx server loads (the
    same cache, built and checked the same way), one thread."""
    if kind == "torch" or kind.startswith("infinity"):
        return None
    from matryoshka2d.serve.served import make_backend

    return make_backend(encoder, kind, sorted({c[0] for c in cells}), threads=1)


def offline_throughput(encoder, texts: list[str], layer: int, dim: int, backend=None) -> tuple[float, float]:
    """(texts per second, texts per CPU second) of an offline pass at the cell, batches of 64, one thread on the
    server's core: `encoder.encode`, or with `backend` its graph, sliced to `dim` and made unit length."""
    import torch

    def run(chunk):
        if backend is None:
            return encoder.encode(chunk, layer=layer, dim=dim, batch_size=64, normalize=True)
        vectors = backend.pooled(chunk, layer)[:, :dim]
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with on_core(ARGS.server_core):
            run(texts[:128])  # warm-up
            with PAUSE.span():
                start, cpu = time.perf_counter(), time.process_time()
                run(texts)
                return len(texts) / (time.perf_counter() - start), len(texts) / (time.process_time() - cpu)
    finally:
        torch.set_num_threads(threads)


def agreement(got: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(max |difference|, lowest cosine) of the re-normalised rows."""
    unit = got / np.maximum(np.linalg.norm(got, axis=1, keepdims=True), 1e-12)
    return float(np.abs(unit - expected).max()), float(np.einsum("ij,ij->i", unit, expected).min())


def measure(server: Server, cells, batches, references, check_texts) -> list[dict]:
    """Warm-up, then each cell's timed load (training paused around it), RSS and vector agreement."""
    rows = []
    rss_start = server.rss()
    if not server.kind.startswith("infinity"):  # our onnx backend measures each session's memory as it loads
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models/bench", timeout=10) as reply:
            sessions = json.loads(reply.read()).get("session_mb")
        if sessions:
            print(f"  {server.kind}: resident memory per onnxruntime session (MB, by layer): {sessions}")
    for layer, dim in cells:
        run_load(server, batches[: ARGS.warmup_requests], layer, dim, ARGS.clients)
    time.sleep(ARGS.settle)  # our server gives memory back once idle for REST_AFTER (serve/batching.py)
    rss_warm = server.rss()
    for layer, dim in cells:
        diff, cosine = agreement(server.vectors(check_texts, layer, dim), references[(layer, dim)])
        with PAUSE.span():
            load = load_average()
            cpu = cpu_seconds(server.process.pid)
            result = run_load(server, batches, layer, dim, ARGS.clients)
            result["cpu_s"] = cpu_seconds(server.process.pid) - cpu
        rows.append({"server": server.kind, "cell": (layer, dim), **result, "max_diff": diff, "min_cos": cosine})
        rows[-1].update(load=load, rss_start=rss_start, rss_warm=rss_warm, startup=server.startup_seconds)
        print(
            f"  {server.kind} ({layer},{dim}): {result['requests_per_s']:.1f} requests/s, "
            f"{result['requests'] / result['cpu_s']:.1f} per server CPU second, {result['errors']} errors "
            f"(load average before: {load})" + (f"; first error: {result['first_error']}" if result["errors"] else ""),
            flush=True,
        )
    at_once = server.rss()
    time.sleep(ARGS.settle)
    for row in rows:
        row["rss_after_at_once"], row["rss_after"] = at_once, server.rss()
    if ARGS.results:  # one JSON line per measured run, so that a benchmark cut short keeps what it measured
        with open(ARGS.results, "a") as f:
            f.writelines(json.dumps({**row, "cell": list(row["cell"])}) + "\n" for row in rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=SERVERS,
        help="default: ours (torch onnx onnx-int8), and infinity's two when --infinity-venv is given",
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000, help="requests per cell")
    parser.add_argument("--texts-per-request", type=int, default=8)
    parser.add_argument(
        "--encoding-format",
        choices=["base64", "float"],
        default="base64",
        help="what the requests ask for: base64 (the openai client's default) or float (JSON numbers, as curl "
        "and most other clients get them)",
    )
    parser.add_argument("--cells", nargs="+", default=["6,384", "3,128"], help="layer,dim pairs")
    parser.add_argument("--warmup-requests", type=int, default=100, help="per cell, before RSS is read")
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds idle before RSS is read after warm-up and after the runs (the RSS right after the last "
        "reply is printed too); longer than the server's REST_AFTER",
    )
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument(
        "--pause-training", action="store_true", help="SIGSTOP training, distillation and eval runs during timed spans"
    )
    parser.add_argument(
        "--pick-check",
        action="store_true",
        help="instead of the load: pick's one-query ms per (layer, backend) against serve's for one client, less an "
        "empty request's round trip",
    )
    parser.add_argument(
        "--infinity-venv",
        dest="venv",
        type=Path,
        help="a virtual environment with infinity-emb (benchmarks/infinity_peer.py); the infinity servers need it",
    )
    parser.add_argument("--start-timeout", type=float, default=1200, help="seconds a server may take to start")
    parser.add_argument(
        "--logs", default=str(CHECKOUT_RUNS / "serve-load"), help="folder for the servers' logs (default: %(default)s)"
    )
    parser.add_argument("--results", help="append each measured run to this file as a JSON line")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    global ARGS
    ARGS = args = parser.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS:
        parser.error(f"--clients must be 1..{MAX_CLIENTS}")
    peers = [s for s in args.servers or () if s.startswith("infinity")]
    if peers and args.venv is None:
        named = " ".join(peers)
        parser.error(f"--servers {named} needs --infinity-venv VENV (a virtual environment with infinity-emb)")
    args.servers = args.servers or list(SERVERS if args.venv else OURS)
    cells = [tuple(int(x) for x in c.split(",")) for c in args.cells]
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    PAUSE.pattern = TRAINING_PATTERN if args.pause_training else None
    PAUSE.guard()
    os.sched_setaffinity(0, {args.client_core})

    print(header())
    print(PAUSE.describe(), flush=True)
    need = args.requests * args.texts_per_request
    texts = sts_sentences(args.data_dir, need)
    if len(texts) < need:  # fewer distinct sentences than asked: reuse them, marked so that none is a duplicate
        texts = [f"{texts[i % len(texts)]} ({i // len(texts)})" if i >= len(texts) else texts[i] for i in range(need)]
    batches = [texts[i : i + args.texts_per_request] for i in range(0, need, args.texts_per_request)]
    print(
        f"data: {need} distinct texts (STS-B/SICK-R sentences) in {len(batches)} requests of "
        f"{args.texts_per_request}; {args.clients} concurrent clients on core {args.client_core}; servers on core "
        f"{args.server_core} (taskset, 1 model thread); model {args.model}; cells {cells}; training runs "
        f"{'paused during each timed span' if args.pause_training else 'left running'}"
    )
    from matryoshka2d.models.encoder import ElasticEncoder

    encoder = ElasticEncoder(args.model, device="cpu")
    check_texts = texts[-CHECK_TEXTS:]
    references = {c: encoder.encode(check_texts, layer=c[0], dim=c[1], normalize=True) for c in cells}
    if args.pick_check:
        return pick_check(encoder, cells)
    offline = {}  # (kind, cell) -> (texts/s, texts per CPU s): each server against an offline pass of its own model
    for kind in dict.fromkeys("torch" if k.startswith("infinity") else k for k in args.servers):
        backend = offline_backend(encoder, kind, cells)
        for c in cells:
            offline[(kind, c)] = offline_throughput(encoder, texts, *c, backend=backend)
    shown = {f"{k} ({c[0]},{c[1]})": (round(a), round(b)) for (k, c), (a, b) in offline.items()}
    print(f"offline pass on core {args.server_core}, texts/s and per CPU second: {shown}", flush=True)

    folders = {}
    if any(s.startswith("infinity") for s in args.servers):
        from infinity_peer import prepare

        folders = prepare(Path(encoder.location), sorted({c[0] for c in cells}), venv=args.venv)
    rows = []
    for kind in args.servers:
        if kind.startswith("infinity"):
            for cell in cells:
                server = start_infinity(kind, cell[0], folders)
                try:
                    rows += measure(server, [cell], batches, references, check_texts)
                finally:
                    server.stop()
        else:
            server = start_ours(kind, cells)
            try:
                rows += measure(server, cells, batches, references, check_texts)
            finally:
                server.stop()

    print(
        "\n| server | cell | requests | errors | requests/s | texts/s | served/offline | requests per server CPU s "
        "| served/offline per CPU s | p50 ms | p99 ms | RSS MB started / warm-up / at the last reply / after "
        "| after - warm-up "
        "| vs encode: max diff, min cos |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        layer, dim = r["cell"]
        wall, per_cpu = offline[(reference_of(r["server"]), r["cell"])]
        r["requests_per_cpu_s"] = r["requests"] / r["cpu_s"]
        print(
            f"| {r['server']} | ({layer},{dim}) | {r['requests']} | {r['errors']} | {r['requests_per_s']:.1f} "
            f"| {r['texts_per_s']:.0f} | {r['texts_per_s'] / wall:.0%} | {r['requests_per_cpu_s']:.1f} "
            f"| {r['texts'] / r['cpu_s'] / per_cpu:.0%} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} "
            f"| {r['rss_start']:.0f} / {r['rss_warm']:.0f} / {r['rss_after_at_once']:.0f} / {r['rss_after']:.0f} "
            f"| {r['rss_after'] - r['rss_warm']:+.0f} "
            f"| {r['max_diff']:.1e}, {r['min_cos']:.4f} |"
        )
        if r["first_error"]:
            print(f"  first error of {r['server']} at ({layer},{dim}): {r['first_error']}")
    print(
        f"\noffline pass (batch 64, 1 thread on core {args.server_core}; torch: ElasticEncoder.encode, onnx: the "
        "served graphs; infinity servers are set against torch):"
    )
    for (kind, cell), (wall, per_cpu) in offline.items():
        print(f"  {kind} {cell}: {wall:.0f} texts/s, {per_cpu:.0f} texts per CPU second")
    for measure_name, key in (
        ("requests/s", "requests_per_s"),
        ("requests per server CPU second", "requests_per_cpu_s"),
    ):
        ratios(rows, cells, measure_name, key)


def reference_of(server: str) -> str:
    return "torch" if server.startswith("infinity") else server


def pick_check(encoder, cells) -> None:
    """`pick`'s one-query ms at each (layer, backend) against what `serve` delivers to one client at that cell: the
    same query texts one per request, per text the fastest of ROUNDS, median over texts (pick's own protocol), less
    the round trip of an empty request (GET /health) measured on the same connection in the same run."""
    from matryoshka2d.serve.served import make_backend
    from matryoshka2d.serve.timing import QUERY_TEXTS, measure_latency

    print(
        "\n| server | cell | serve ms (1 client, 1 text) | empty request ms | serve - empty | pick ms "
        "| pick / (serve - empty) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    layers = sorted({c[0] for c in cells})
    for kind in (k for k in ARGS.servers if not k.startswith("infinity")):
        import torch

        torch.set_num_threads(1)
        with on_core(ARGS.server_core), PAUSE.span():
            picked = measure_latency(make_backend(encoder, kind, layers, threads=1), layers)
        server = start_ours(kind, cells)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            with PAUSE.span():
                empty = []
                for _ in range(PICK_CHECK_EMPTY):
                    start = time.perf_counter()
                    conn.request("GET", "/health")
                    conn.getresponse().read()
                    empty.append(1000 * (time.perf_counter() - start))
                for layer, dim in cells:
                    best = {t: float("inf") for t in QUERY_TEXTS}
                    for _ in range(PICK_CHECK_ROUNDS + 1):  # the first round warms the session up
                        for t in QUERY_TEXTS:
                            path, body = server.request([t], layer, dim)
                            start = time.perf_counter()
                            conn.request("POST", path, body, {"Content-Type": "application/json"})
                            reply = conn.getresponse()
                            reply.read()
                            if reply.status != 200:
                                raise RuntimeError(f"{kind}: HTTP {reply.status} at ({layer},{dim})")
                            best[t] = min(best[t], 1000 * (time.perf_counter() - start))
                    served = float(np.median(list(best.values())))
                    rtt = float(np.median(empty))
                    print(
                        f"| {kind} | ({layer},{dim}) | {served:.2f} | {rtt:.2f} | {served - rtt:.2f} | "
                        f"{picked[layer]:.2f} | {picked[layer] / (served - rtt):.2f} |",
                        flush=True,
                    )
            conn.close()
        finally:
            server.stop()


def ratios(rows: list[dict], cells, measure_name: str, key: str) -> None:
    by: dict = {}
    for r in rows:  # a server run more than once: its best run
        by[(r["server"], r["cell"])] = max(by.get((r["server"], r["cell"]), 0.0), r[key])
    print(f"\nratios of {measure_name} at each cell:")
    pairs = [("onnx-int8", "infinity-torch"), ("onnx-int8", "infinity-optimum"), ("torch", "infinity-torch")]
    pairs += [("onnx", "infinity-optimum"), ("onnx-int8", "torch")]
    for cell in cells:
        for a, b in pairs:
            if (a, cell) in by and (b, cell) in by:
                print(f"  {cell}: {a} / {b} = {by[(a, cell)] / by[(b, cell)]:.2f}x")


if __name__ == "__main__":
    main()
