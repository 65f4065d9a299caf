"""Open-loop overload, side by side: fixed full depth, a fixed shallow cell, the ladder of adaptive depth, and the
peers a user would run instead (llama.cpp's llama-server, infinity-emb's optimum engine).

    python benchmarks/serve_overload.py --model DIR [--query-model NAME=FOLDER ...] [--rates 0.5 1 1.5 2 3]
        [--seconds 60] [--target-ms 50] [--min-layer 2] [--shallow-layer 3] [--modes full shallow adaptive llama
        infinity] [--llama-server BIN --llama-model GGUF] [--infinity-venv DIR --infinity-folder DIR] [--timeout 2]
        [--server-core 0] [--client-core 1] [--pause python|PATTERN] [--results FILE.json] [--plot FILE.png]

Arrivals are a Poisson process at a fixed rate, each arrival one request of one SciFact query (how a query
reaches a search service), sent whether or not earlier ones were answered: an open loop. A closed loop of N
clients slows down with the server and never shows overload; here the offered rate is what it says, and a
request's latency counts from its scheduled arrival, so a client that falls behind counts against the server, not
for it (the client's own lag is printed). Each rate is a multiple of the full-depth capacity measured in the same
run (a closed loop of --capacity-clients at full depth for --capacity-seconds: requests per second). Before the
rates, a table of what the ladder can give: each rung's closed-loop capacity (--layer-seconds each), the share of
flat nDCG@10 kept when every query is encoded at that rung, and the server's own quality measure of it.

Our server is one `matryoshka2d serve --backend onnx --quantize int8 --adaptive-depth` process on --server-core
with one thread, the documents' model (--model) beside the query encoders distilled from it (--query-model); the
modes differ only in the request: `layer: N` (full), `layer: --shallow-layer` (shallow), no layer (adaptive: the
server's ladder chooses the rung per request). The peers serve the model's full depth on the same core with one
thread, each started afresh for each rate (they have no bound, so a rate would otherwise inherit the backlog of the
one before; ours reports its queue and is let empty it); how to make them: benchmarks/serve_capacity.py. The
client is this process on --client-core. Every request has a deadline (--timeout s from its scheduled arrival);
past it the request counts as a timeout. Goodput: answers (200) within the deadline per second.

After the rates, at each load: the nDCG share the ladder's answers kept beside the most any mix of the rungs could
keep at that load (the linear program over the rung table, `depth_bound`).

Quality of what was answered: the documents are the model's full-depth vectors of the SciFact corpus (made by the
same server, input_type "document"); every answered query vector is searched flat against them and its nDCG@10
set against the full-depth query vector's nDCG@10 for the same query: the share of flat full-depth quality the
answers kept. Server memory (RSS) is sampled through each span. At the end, a drain check: SIGTERM in the middle
of a span at 1.5x, how long the server takes to exit, its exit code, and whether any accepted request went
unanswered.

--pause (default 'python': every other Python process on the machine, training runs and test suites among them;
or a pkill -f pattern; '' for none) SIGSTOPs those processes for each timed span only and SIGCONTs them after,
also on errors and interrupts.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import orjson

from common import DEFAULT_DATA, checkout_env, free_port, header, rss_mb, stop_process

ARGS = argparse.Namespace()


# ---- the machine -----------------------------------------------------------------------------------------------
_PAUSED = {"on": False, "pids": []}
_STARTED: list = []  # every server this run started: stopped at the end, also when the run fails


def _mine() -> set[int]:
    """This process and its descendants (our server, infinity), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    mine, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in mine} - mine
        mine |= more
        grew = bool(more)
    return mine


def _others() -> list[int]:
    """The processes --pause names: every other Python process on the machine ('python'), or pkill -f's matches."""
    if ARGS.pause != "python":
        found = subprocess.run(["pgrep", "-f", ARGS.pause], capture_output=True, text=True, check=False).stdout
        return [int(p) for p in found.split()]
    mine, out = _mine(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in mine and int(entry.name) > 1:
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if b"python" in command.rsplit(b"/", 1)[-1]:
                out.append(int(entry.name))
    return out


def _signal_others(sig: str) -> None:
    if not ARGS.pause:
        return
    if sig == "STOP":
        _PAUSED["pids"] = _others()
    for pid in _PAUSED["pids"]:
        with suppress(OSError):
            os.kill(pid, signal.SIGSTOP if sig == "STOP" else signal.SIGCONT)


def _resume_others() -> None:
    if _PAUSED["on"]:
        _signal_others("CONT")
        _PAUSED["on"] = False


@contextmanager
def others_paused():
    _PAUSED["on"] = True
    _signal_others("STOP")
    try:
        yield
    finally:
        _resume_others()


@contextmanager
def timed_span():
    """A span whose latencies are measured: other processes paused (--pause), and this client's own garbage collector
    off. The client holds the data set, the documents' vectors and every answer it records; a full collection of that
    heap stopped its event loop for about 130 ms once a span (one-text requests at 150 a second, 2026-11-27: every
    latency over 100 ms of the span within 0.15 s of each other, none with the collector frozen and off), during which
    no answer is read, so the server's latency at p99 and its timeouts counted the client's pause. What the span
    allocates is collected after it."""
    import gc

    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        with others_paused():
            yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.collect()


# ---- servers ---------------------------------------------------------------------------------------------------
class Server:
    """A server process pinned to the server core; `body(text, layer)` is a request to it."""

    def __init__(self, kind: str, command: list[str], port: int, env: dict, cwd=None):
        self.kind, self.port = kind, port
        self.log = open(Path(ARGS.logs) / f"{kind}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            ["taskset", "-c", str(ARGS.server_core), *command],
            env=env,
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        _STARTED.append(self)
        deadline = time.monotonic() + ARGS.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{kind} exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{kind} did not answer /health within {ARGS.start_timeout} s; see {self.log.name}")

    def body(self, text: str, layer, input_type: str | None = None) -> bytes:
        """A request of one text: `layer` an int (that layer of the model), None (open: the ladder chooses), or
        "ENCODER@LAYER" (a rung by name: a query encoder served beside the model, or the model's layer)."""
        if self.kind == "infinity":
            body = {"model": "bench", "input": [text], "encoding_format": "base64"}
            return request_bytes("/embeddings", body)
        body = {"model": "bench", "input": [text], "encoding_format": "base64"}
        if isinstance(layer, str):
            encoder, _, number = layer.rpartition("@")
            layer = int(number) if encoder == "bench" else None
            body["model"] = encoder
        if layer is not None:
            body["layer"] = layer
        if input_type is not None:
            body["input_type"] = input_type
        return request_bytes("/v1/embeddings", body)

    def queued(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as reply:
            return int(json.loads(reply.read()).get("queued_requests", 0))

    def statuses(self) -> dict[str, float]:
        """Our server's own count of the embeddings requests it answered, by status (its /metrics); {} for a peer."""
        if self.kind != "ours":
            return {}
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "matryoshka2d_requests_total" and sample.labels.get("route") == "/v1/embeddings":
                    counts[sample.labels["status"]] = counts.get(sample.labels["status"], 0) + sample.value
        return counts

    def stop(self) -> int:
        code = stop_process(self.process)
        self.log.close()
        return code


def start_ours() -> Server:
    env = checkout_env()
    port = free_port()
    command = [sys.executable, "-m", "matryoshka2d.cli", "serve", "--model", ARGS.model, "--served-name", "bench"]
    command += ["--port", str(port), "--device", "cpu", "--log-level", "warning", "--backend", "onnx"]
    command += ["--quantize", "int8", "--truncate", "--adaptive-depth", "--target-ms", str(ARGS.target_ms)]
    command += ["--max-queued-texts", str(ARGS.max_queued_texts)]
    command += ["--max-queue-ms", str(ARGS.max_queue_ms)] if ARGS.max_queue_ms else []
    command += ["--min-layer", str(ARGS.min_layer)] if ARGS.min_layer else []
    command += ["--max-length", str(ARGS.max_length)] if ARGS.max_length else []
    command += ["--max-wait-ms", str(ARGS.max_wait_ms)] if ARGS.max_wait_ms is not None else []
    command += ["--max-batch", str(ARGS.max_batch)] if ARGS.max_batch is not None else []
    command += ["--layers", ARGS.serve_layers] if ARGS.serve_layers else []
    for query_model in ARGS.query_model or []:
        command += ["--query-model", query_model]
    command += ["--calibration-texts", *ARGS.calibration_texts] if ARGS.calibration_texts else []
    return Server("ours", command, port, env)


def start_peer(mode: str) -> Server:
    """A peer at the model's full depth, one core, one thread: llama.cpp's llama-server on the model as GGUF, or
    infinity-emb's optimum engine on its int8 ONNX folder (benchmarks/serve_peers.py; how to make each:
    benchmarks/serve_capacity.py's docstring)."""
    from serve_peers import start_infinity_optimum, start_llama

    if mode == "llama":
        if not (ARGS.llama_server and ARGS.llama_model):
            raise SystemExit("--modes llama needs --llama-server and --llama-model")
        return start_llama(ARGS.llama_server, ARGS.llama_model, ARGS.llama_parallel, ARGS.llama_batch, ARGS.llama_batch)
    if not (ARGS.infinity_venv and ARGS.infinity_folder):
        raise SystemExit("--modes infinity needs --infinity-venv and --infinity-folder")
    return start_infinity_optimum(ARGS.infinity_venv, ARGS.infinity_folder)


# ---- the client: HTTP/1.1 on asyncio streams, a pool of keep-alive connections --------------------------------
def request_bytes(path: str, body: dict) -> bytes:
    payload = orjson.dumps(body)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


class Pool:
    def __init__(self, port: int):
        self.port, self.idle = port, []

    async def send(self, request: bytes) -> tuple[int, dict, bytes]:
        """One request on an idle keep-alive connection, or a new one. A server closes a connection idle past its
        keep-alive time (uvicorn: 5 s); a request that finds its reused connection closed before any byte of an
        answer (it was never read) is sent again once on a new connection."""
        while self.idle:
            reader, writer = self.idle.pop()
            try:
                return await self._exchange(reader, writer, request)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if getattr(exc, "partial", b"") != b"":
                    raise
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        return await self._exchange(reader, writer, request)

    async def _exchange(self, reader, writer, request: bytes) -> tuple[int, dict, bytes]:
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, headers, body


def vector_of(body: bytes) -> np.ndarray:
    return np.frombuffer(base64.b64decode(orjson.loads(body)["data"][0]["embedding"]), dtype="<f4")


async def _open_loop(server: Server, rate: float, seconds: float, layer, queries: list[str], seed: int) -> dict:
    """Poisson arrivals at `rate` per second for `seconds`; each arrival one query (the next in a shuffled order)."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.5) + 10))
    times = times[times < seconds]
    order = rng.permutation(len(times)) % len(queries)
    pool, loop = Pool(server.port), asyncio.get_running_loop()
    records: list[tuple] = []
    lags: list[float] = []
    requests = [server.body(queries[q], layer) for q in order]
    rss, sampling = [rss_mb(server.process.pid)], [True]

    async def sample_rss():
        while sampling[0]:
            rss.append(rss_mb(server.process.pid))
            await asyncio.sleep(0.5)

    async def one(i: int, scheduled: float):
        left = scheduled + ARGS.timeout - loop.time()
        try:
            status, headers, body = await asyncio.wait_for(pool.send(requests[i]), left)
        except TimeoutError:
            records.append((int(order[i]), "timeout", None, None, None))
            return
        except OSError as exc:
            records.append((int(order[i]), f"refused ({type(exc).__name__})", None, None, None))
            return
        latency = loop.time() - scheduled
        layer_used = None
        if status == 200:  # the rung that answered: ENCODER@LAYER (a peer: the model's full depth)
            encoder = urllib.parse.unquote(headers.get("x-matryoshka2d-encoder", "bench"))
            layer_used = f"{encoder}@{headers.get('x-matryoshka2d-layer', ARGS.layers)}"
        vector = vector_of(body) if status == 200 else None
        records.append((int(order[i]), status, latency, layer_used, vector))

    sampler = asyncio.create_task(sample_rss())
    start = loop.time() + 0.1
    tasks = []
    for i, t in enumerate(times):
        delay = start + t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lags.append(max(0.0, loop.time() - start - t))
        tasks.append(asyncio.create_task(one(i, start + t)))
    await asyncio.gather(*tasks)
    sampling[0] = False
    await sampler
    for _, writer in pool.idle:
        writer.close()
    return {"records": records, "lag_p99_ms": 1000 * float(np.percentile(lags, 99)) if lags else 0.0, "rss": rss}


async def _closed_loop(server: Server, clients: int, seconds: float, layer, queries: list[str]) -> float:
    """Requests per second that `clients` back-to-back clients get answered at `layer`."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    done = [0]

    async def client(c: int):
        pool, i = Pool(server.port), c
        while loop.time() < stop:
            status, _, _ = await pool.send(server.body(queries[i % len(queries)], layer))
            done[0] += status == 200
            i += clients

    start = loop.time()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return done[0] / (loop.time() - start)


def encode_all(server: Server, texts: list[str], layer: int | None, input_type: str | None = None) -> np.ndarray:
    """Vectors of `texts` from the server, one request per 32 texts, 4 at a time (a 429 retried after Retry-After)."""

    async def run():
        pool, out = Pool(server.port), [None] * len(texts)

        async def chunk(start: int):
            part = texts[start : start + 32]
            body = {"model": "bench", "input": part, "encoding_format": "base64", "layer": layer}
            if isinstance(layer, str):  # a rung by name, ENCODER@LAYER
                encoder, _, number = layer.rpartition("@")
                body["model"], body["layer"] = encoder, int(number) if encoder == "bench" else None
                if encoder != "bench":
                    del body["layer"]
            if input_type is not None:
                body = {k: v for k, v in body.items() if k != "layer"} | {"input_type": input_type}
            status, headers, raw = await pool.send(request_bytes("/v1/embeddings", body))
            for _ in range(10):  # a busy machine can put the server past its bound: it says when to retry
                if status != 429:
                    break
                await asyncio.sleep(float(headers.get("retry-after", 1)))
                status, headers, raw = await pool.send(request_bytes("/v1/embeddings", body))
            if status != 200:
                raise RuntimeError(f"encoding failed: {status} {raw[:300]!r}")
            for j, item in enumerate(orjson.loads(raw)["data"]):
                out[start + j] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")

        starts = list(range(0, len(texts), 32))
        for k in range(0, len(starts), 4):
            await asyncio.gather(*(chunk(s) for s in starts[k : k + 4]))
        return np.stack(out)

    return asyncio.run(run())


def document_vectors(server: Server, texts: list[str]) -> np.ndarray:
    """The corpus at full depth from the server (input_type "document"), unit rows; kept in the logs folder under a
    key of the model's weight files and the length, so that a second run of the same model reads them back."""
    import hashlib

    files = sorted(Path(ARGS.model).glob("*.safetensors"))
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files] + [ARGS.max_length, len(texts)]
    key = hashlib.sha256(json.dumps([str(Path(ARGS.model).resolve()), stamp]).encode()).hexdigest()[:16]
    cached = Path(ARGS.logs) / f"documents-{key}.npy"
    if cached.is_file():
        return np.load(cached)
    docs = encode_all(server, texts, None, "document")
    docs = docs / np.linalg.norm(docs, axis=1, keepdims=True)
    np.save(cached, docs)
    return docs


# ---- scoring ---------------------------------------------------------------------------------------------------
def ndcg_of(vectors: np.ndarray, qids: list[int], docs: np.ndarray, qrels) -> np.ndarray:
    """nDCG@10 of each row (the query qids[i]) searched flat against the documents."""
    from matryoshka2d.evaluate.retrieval import search

    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    ranked = search(unit.astype(np.float32), docs, 10)
    discount = 1.0 / np.log2(np.arange(2, 12))
    out = np.empty(len(qids))
    for i, (row, q) in enumerate(zip(ranked, qids, strict=True)):
        rel = qrels[q]
        gains = np.array([rel.get(int(d), 0) for d in row], dtype=np.float64)
        ideal = np.sort(np.fromiter(rel.values(), dtype=np.float64))[::-1][:10]
        out[i] = float(gains @ discount[: len(gains)]) / float(ideal @ discount[: len(ideal)])
    return out


def summarize(mode: str, multiple: float, rate: float, run: dict, docs, qrels, flat: np.ndarray) -> dict:
    records = run["records"]
    ok = [r for r in records if r[1] == 200]
    latencies = np.array([r[2] for r in ok]) * 1000
    within = int(np.sum(latencies <= ARGS.timeout * 1000))
    layers = [r[3] for r in ok]
    share = {str(n): layers.count(n) / len(layers) for n in sorted(set(layers))} if layers else {}
    quality = None
    if ok:
        vectors = np.stack([r[4] for r in ok])
        qids = [r[0] for r in ok]
        got = ndcg_of(vectors, qids, docs, qrels)
        quality = 100 * float(got.mean() / flat[qids].mean())
    status = [r[1] for r in records]
    return {
        "mode": mode,
        "load": multiple,
        "offered_per_s": rate,
        "sent": len(records),
        "answered": len(ok),
        "goodput_per_s": within / ARGS.seconds,
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else None,
        "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else None,
        "429": status.count(429),
        "timeouts": status.count("timeout"),
        "other_errors": len(records) - len(ok) - status.count(429) - status.count("timeout"),
        "layer_share": share,
        "ndcg_share_of_flat": quality,
        "client_lag_p99_ms": run["lag_p99_ms"],
        # what our server counted, by status: 200 answered, 429 refused over the bound, 499 accepted but its client
        # left before the answer (its texts were not run); a request the client gave up on before the server read
        # it is in none of these
        "server_statuses": run.get("server", {}),
        "rss_mb": [round(rss[0], 1), round(max(rss), 1), round(rss[-1], 1)]
        if (rss := [r for r in run["rss"] if r == r])
        else None,
    }


def rungs_of(server: Server) -> list[dict]:
    """The ladder our server runs (/v1/models: encoder, layer, its own quality measure); without --adaptive-depth,
    every layer of the model."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models/bench", timeout=10) as reply:
        described = json.loads(reply.read())
    ladder = described.get("adaptive_depth")
    if ladder:
        return [{"encoder": r["encoder"], "layer": r["layer"], "quality": r["quality"]} for r in ladder["rungs"]]
    return [{"encoder": "bench", "layer": n, "quality": None} for n in described["layers"]]


def depth_lever(server: Server, queries: list[str], docs, qrels, flat: np.ndarray, capacity: float) -> list[dict]:
    """What each rung of the ladder gives adaptive depth to work with: its closed-loop capacity (as the full depth's
    is measured), the share of flat full-depth nDCG@10 that all queries keep when encoded at it, and the server's own
    quality measure of it (mean cosine to the full depth on its calibration texts), to see how the one tracks the
    other."""
    rows = []
    qids = list(range(len(queries)))
    for rung in rungs_of(server):
        name = f"{rung['encoder']}@{rung['layer']}"
        quality = 100 * float(ndcg_of(encode_all(server, queries, name), qids, docs, qrels).mean() / flat.mean())
        wait_idle(server)
        with timed_span():
            rate = asyncio.run(_closed_loop(server, ARGS.capacity_clients, ARGS.layer_seconds, name, queries))
        rows.append(
            {
                "rung": name,
                "layer": rung["layer"],
                "capacity_per_s": rate,
                "of_full": rate / capacity,
                "ndcg_share_of_flat": quality,
                "server_quality": rung["quality"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def wait_idle(server: Server) -> None:
    if server.kind == "ours":
        deadline = time.monotonic() + 60
        while server.queued() and time.monotonic() < deadline:
            time.sleep(0.2)
    time.sleep(ARGS.settle)


def drain_check(capacity: float, queries: list[str]) -> dict:
    """SIGTERM to a fresh server in the middle of an open-loop span at 1.5x: exit code, seconds to exit, and
    whether any request the server accepted went unanswered (a timeout, or an error other than 503)."""
    server = start_ours()
    wait_idle(server)

    async def run():
        loop = asyncio.get_running_loop()
        span = asyncio.create_task(_open_loop(server, 1.5 * capacity, ARGS.drain_span, None, queries, 7))
        await asyncio.sleep(ARGS.drain_span / 2)
        sent = loop.time()
        server.process.send_signal(signal.SIGTERM)
        code = await loop.run_in_executor(None, server.process.wait, 60)
        took = loop.time() - sent
        return await span, code, took

    with timed_span():
        run_, code, took = asyncio.run(run())
    server.stop()
    status = [r[1] for r in run_["records"]]
    refused = sum(isinstance(s, str) and s.startswith("refused") for s in status)
    return {
        "exit_code": code,
        "seconds_to_exit": round(took, 2),
        "answered_200": status.count(200),
        "answered_503": status.count(503),
        "not_accepted_connection_closed": refused,
        "timeouts": status.count("timeout"),
        "other": len(status) - status.count(200) - status.count(503) - refused - status.count("timeout"),
    }


def machine_arguments(parser, settle: float) -> None:
    """Where the server and the client run, and what is paused while they are timed (serve_capacity.py too)."""
    parser.add_argument(
        "--server-core", default="0", help="the server's CPUs for taskset: 0, or 0,1 for serve --workers 2"
    )
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--settle", type=float, default=settle)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument(
        "--pause",
        default="python",
        help="stopped during timed spans: 'python' (every other Python process), a pkill -f pattern, or '' (none)",
    )


# ---- the run ---------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        required=True,
        help="the documents' model: one whose exits are aligned (distill --mode shared), or any with --query-model",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA / "retrieval" / "scifact")
    parser.add_argument("--split", default="train", help="qrels split (the shared SciFact has train: 809 queries)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--modes", nargs="+", default=["full", "adaptive"], help="full shallow adaptive llama infinity (any of them)"
    )
    parser.add_argument("--shallow-layer", type=int, default=3)
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument("--min-layer", type=int)
    parser.add_argument(
        "--query-model",
        action="append",
        metavar="NAME=FOLDER",
        help="a query encoder distilled from --model, served beside it: a rung of the ladder (repeat for more)",
    )
    parser.add_argument("--calibration-texts", nargs="+", help="our server's --calibration-texts")
    parser.add_argument("--serve-layers", help="our server's --layers (e.g. 6: the full depth's graph only)")
    parser.add_argument("--max-length", type=int, help="tokens per text for the server (default: the model's)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds from a request's arrival to its deadline")
    parser.add_argument(
        "--max-queued-texts",
        type=int,
        default=256,
        help="our server's bound on waiting texts: what it answers within the deadline at full depth, about",
    )
    parser.add_argument(
        "--max-queue-ms",
        type=float,
        default=1000.0,
        help="our server's bound in model time (serve --max-queue-ms; 0: none): half the deadline, the rest for the "
        "event loop and the batch that runs",
    )
    parser.add_argument(
        "--capacity",
        type=float,
        help="full depth's capacity in requests/s, not measured: the rates are multiples of it (to compare server "
        "options at the same rates across runs)",
    )
    parser.add_argument("--max-wait-ms", type=float, help="our server's --max-wait-ms (default: the server's own)")
    parser.add_argument("--max-batch", type=int, help="our server's --max-batch (default: the server's own)")
    parser.add_argument("--capacity-clients", type=int, default=64)
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument(
        "--layer-seconds", type=float, default=10.0, help="closed-loop seconds per layer, the depth table (0: none)"
    )
    parser.add_argument("--drain-span", type=float, default=8.0, help="seconds of the drain check's span (0: none)")
    machine_arguments(parser, settle=2.0)
    from serve_peers import peer_arguments

    peer_arguments(parser)
    parser.add_argument("--logs", default="/tmp/serve-overload")
    parser.add_argument("--results", help="write every row as JSON here")
    parser.add_argument("--plot", help="latency against offered load, a line per mode, as PNG")
    parser.add_argument("--report", help="print the table (and --plot) of an earlier run's --results file, run nothing")
    parser.parse_args(namespace=ARGS)
    if ARGS.report:
        earlier = json.loads(Path(ARGS.report).read_text())
        report(earlier["capacity"], earlier["rows"], earlier.get("drain"), earlier.get("depth", []))
        if ARGS.plot:
            plot(earlier["rows"], ARGS.plot)
        return
    Path(ARGS.logs).mkdir(parents=True, exist_ok=True)
    atexit.register(_resume_others)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: (_resume_others(), sys.exit(128 + s)))
    os.sched_setaffinity(0, {ARGS.client_core})
    print(header())
    print(f"server core {ARGS.server_core}, client core {ARGS.client_core}; load average {os.getloadavg()}")

    from matryoshka2d.evaluate.retrieval import load_beir

    data = load_beir(ARGS.data, ARGS.split)
    queries = data.query_texts
    with others_paused():  # the server measures its layers' costs as it starts: on a quiet machine too
        ours = start_ours()
    config = json.loads(Path(ARGS.model, "config.json").read_text())
    ARGS.layers = int(config["num_hidden_layers"])
    started = time.monotonic()
    docs = document_vectors(ours, data.doc_texts)
    full_queries = encode_all(ours, queries, ARGS.layers)
    flat = ndcg_of(full_queries, list(range(len(queries))), docs, data.qrels)
    print(
        f"{len(data.doc_texts)} documents and {len(queries)} queries encoded at full depth in "
        f"{time.monotonic() - started:.0f} s; flat nDCG@10 at full depth {100 * flat.mean():.2f}"
    )
    if ARGS.capacity:
        capacity = ARGS.capacity
        print(f"full-depth capacity: {capacity:.1f} requests/s (given: --capacity, not measured)", flush=True)
    else:
        with timed_span():
            capacity = asyncio.run(
                _closed_loop(ours, ARGS.capacity_clients, ARGS.capacity_seconds, ARGS.layers, queries)
            )
        print(
            f"full-depth capacity: {capacity:.1f} requests/s ({ARGS.capacity_clients} closed-loop clients)", flush=True
        )
    depth = depth_lever(ours, queries, docs, data.qrels, flat, capacity) if ARGS.layer_seconds > 0 else []
    layer_of = {"full": ARGS.layers, "shallow": ARGS.shallow_layer, "adaptive": None, "infinity": None, "llama": None}
    rows = []
    for mode in ARGS.modes:
        for multiple in ARGS.rates:
            # the peers have no bound and no way to say what waits: a fresh server per rate, so that no rate
            # inherits the backlog of the one before (ours reports its queue, and wait_idle empties it)
            server = start_peer(mode) if mode in ("infinity", "llama") else ours
            rate = multiple * capacity
            wait_idle(server)
            before = server.statuses()
            with timed_span():
                run = asyncio.run(
                    _open_loop(server, rate, ARGS.seconds, layer_of[mode], queries, seed=int(10 * multiple))
                )
            wait_idle(server)  # what the server still held is answered (or found gone) before it is counted
            after = server.statuses()
            run["server"] = {k: int(after[k] - before.get(k, 0)) for k in after if after[k] > before.get(k, 0)}
            rows.append(summarize(mode, multiple, rate, run, docs, data.qrels, flat))
            print(json.dumps(rows[-1]), flush=True)
            if ARGS.results:
                partial = {"capacity": capacity, "depth": depth, "rows": rows}
                Path(ARGS.results).write_text(json.dumps(partial, indent=1))
            if server is not ours:
                server.stop()
    ours.stop()
    drain = drain_check(capacity, queries) if ARGS.drain_span > 0 else None
    report(capacity, rows, drain, depth)
    if ARGS.results:
        results = {"capacity": capacity, "depth": depth, "rows": rows, "drain": drain}
        Path(ARGS.results).write_text(json.dumps(results, indent=1))
    if ARGS.plot:
        plot(rows, ARGS.plot)


def depth_bound(depth: list[dict], load: float) -> float | None:
    """The largest nDCG share any choice of layers could keep at `load` (a multiple of full depth's capacity), from
    the layer table: a share f_n of the requests answered at layer n, each costing 1 / (layer n's capacity) of the
    core, with the core's time for `load` x full depth's capacity requests a second at most all of it. A linear
    program (the optimum mixes at most two layers); None when even the fastest layer cannot keep up."""
    from scipy.optimize import linprog

    quality = [d["ndcg_share_of_flat"] for d in depth]
    seconds_per_request = [1 / d["of_full"] for d in depth]  # in units of full depth's at the run's capacity
    solved = linprog(
        c=[-q for q in quality],
        A_ub=[seconds_per_request],
        b_ub=[1 / load],
        A_eq=[[1.0] * len(depth)],
        b_eq=[1.0],
        bounds=[(0, 1)] * len(depth),
    )
    return -solved.fun if solved.success else None


def report(capacity: float, rows: list[dict], drain: dict | None, depth: list[dict]) -> None:
    print(
        f"\nfull-depth capacity {capacity:.1f} requests/s; deadline {ARGS.timeout:g} s; {ARGS.seconds:g} s per rate\n"
    )
    if depth:
        print(
            "| rung | capacity/s | of full depth's | nDCG share, every query at this rung | the server's measure "
            "(mean cosine to the full depth, calibration texts) |"
        )
        print("|---|---:|---:|---:|---:|")
        for d in depth:
            share, measure = d["ndcg_share_of_flat"], d.get("server_quality")
            measure = f"{measure:.3f}" if measure is not None else "-"
            print(
                f"| {d.get('rung', d['layer'])} | {d['capacity_per_s']:.1f} | {d['of_full']:.2f}x | {share:.1f}% | "
                f"{measure} |"
            )
        print()
    print(
        "| mode | load | offered/s | p50 ms | p99 ms | goodput/s | 429 | timeouts | other | layers | nDCG share "
        "| server: accepted, client gone (499) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        layers = ", ".join(f"{n}: {100 * s:.0f}%" for n, s in r["layer_share"].items())
        p50, p99 = (f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("p50_ms", "p99_ms"))
        quality = f"{r['ndcg_share_of_flat']:.1f}%" if r["ndcg_share_of_flat"] is not None else "-"
        server = r.get("server_statuses") or {}
        accepted = f"{server.get('200', 0) + server.get('499', 0)}, {server.get('499', 0)}" if server else "-"
        print(
            f"| {r['mode']} | {r['load']:g}x | {r['offered_per_s']:.0f} | {p50} | {p99} | {r['goodput_per_s']:.1f} | "
            f"{r['429']} | {r['timeouts']} | {r['other_errors']} | {layers} | {quality} | {accepted} |"
        )
    by = {(r["mode"], r["load"]): r for r in rows}
    print()
    for load in sorted({r["load"] for r in rows}):
        a = by.get(("adaptive", load))
        for peer in ("llama", "infinity"):
            p = by.get((peer, load))
            if a and p and p["goodput_per_s"]:
                print(f"goodput, adaptive / {peer} at {load:g}x: {a['goodput_per_s'] / p['goodput_per_s']:.2f}x")
        f = by.get(("full", load))
        if a and f and f["goodput_per_s"]:
            print(f"goodput, adaptive / fixed full depth at {load:g}x: {a['goodput_per_s'] / f['goodput_per_s']:.2f}x")
    adaptive = [r for r in rows if r["mode"] == "adaptive" and r["ndcg_share_of_flat"] is not None]
    if depth and adaptive:
        print("\nnDCG share, adaptive depth against the most any choice of layers keeps at that load (depth_bound):")
        for r in adaptive:
            bound = depth_bound(depth, r["load"])
            most = f"{bound:.1f}%" if bound is not None else "none keeps up"
            print(f"  {r['load']:g}x: {r['ndcg_share_of_flat']:.1f}% of flat; at most {most}")
    if drain:
        print(f"\ndrain on SIGTERM at 1.5x: {json.dumps(drain)}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        timed = [r for r in mine if r["p99_ms"] is not None]  # a rate at which nothing was answered has no p99
        axes[0].plot([r["load"] for r in timed], [r["p99_ms"] for r in timed], marker="o", label=mode)
        axes[1].plot([r["load"] for r in mine], [r["goodput_per_s"] for r in mine], marker="o", label=mode)
    axes[0].set(xlabel="offered load (x full-depth capacity)", ylabel="p99 latency (ms)", yscale="log")
    axes[1].set(xlabel="offered load (x full-depth capacity)", ylabel="goodput (answers within deadline / s)")
    axes[0].legend()
    fig.suptitle(f"Open-loop overload: {Path(ARGS.model).name}, int8, one core")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    try:
        main()
    finally:
        _resume_others()
        for started in _STARTED:
            started.stop()
