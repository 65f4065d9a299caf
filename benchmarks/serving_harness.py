"""The serving harness that benchmarks/serve_overload.py and serve_capacity.py (and the peers of serve_peers.py)
share: a server process pinned to its core, the client (HTTP/1.1 on asyncio streams, a pool of keep-alive
connections) with its open and closed loops, the timed span, and the options that say where the server and the
client run and what is paused while they are timed.

The scripts parse their options into `ARGS` (`parser.parse_args(namespace=ARGS)`), then call `set_up_machine()`;
everything here reads its settings from there: --logs, --server-core, --start-timeout, --timeout, and `ARGS.layers`
(the model's depth, the layer a peer's answer is counted at).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import orjson

from common import CHECKOUT_RUNS, header, rss_mb, stop_process
from pausing import EVERY_PYTHON, Pause

ARGS = argparse.Namespace()
STARTED: list = []  # every server this run started: stopped at the end, also when the run fails
PAUSE = Pause("--pause")


# ---- the machine -----------------------------------------------------------------------------------------------
def machine_arguments(parser, settle: float, logs: str) -> None:
    """Where the server and the client run, what is paused while they are timed, and where the logs go (`logs`: a
    folder under the checkout's runs/ unless --logs says otherwise)."""
    parser.add_argument(
        "--server-core", default="0", help="the server's CPUs for taskset: 0, or 0,1 for serve --workers 2"
    )
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--settle", type=float, default=settle)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument(
        "--pause",
        metavar="PATTERN",
        help=f"stopped (SIGSTOP) during each timed span and continued after: '{EVERY_PYTHON}' (every other Python "
        "process on the machine) or a pkill -f pattern; not given: nothing is stopped",
    )
    parser.add_argument(
        "--logs", default=str(CHECKOUT_RUNS / logs), help="folder for the servers' logs (default: %(default)s)"
    )


def set_up_machine() -> None:
    """Once the options are parsed: the logs folder made, --pause armed (what it stops is continued at exit and on
    SIGINT, SIGTERM and SIGHUP), this process moved to the client core, and the run's header printed."""
    Path(ARGS.logs).mkdir(parents=True, exist_ok=True)
    PAUSE.pattern = ARGS.pause or None
    PAUSE.guard()
    os.sched_setaffinity(0, {ARGS.client_core})
    print(header())
    print(f"server core {ARGS.server_core}, client core {ARGS.client_core}; load average {os.getloadavg()}")
    print(PAUSE.describe(), flush=True)


def stop_everything() -> None:
    """At the end of a run, whatever ended it: what --pause stopped continued, every server started stopped."""
    PAUSE.resume()
    for started in STARTED:
        started.stop()


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
        with PAUSE.span():
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
        STARTED.append(self)
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


async def open_loop(server: Server, rate: float, seconds: float, layer, queries: list[str], seed: int) -> dict:
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


async def closed_loop(server: Server, clients: int, seconds: float, layer, queries: list[str]) -> float:
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
