"""The server harness of the tests: an app in-process (build_app on models in memory, a fake backend of controllable
cost, a direct ASGI call), and `matryoshka2d serve` as a real process where a signal, the exit code, the workers or
the network path is what is tested."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from matryoshka2d.serve import ServerConfig, build_app
from matryoshka2d.serve.engine import Models

SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
    """A port nothing listens on now (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- in-process -------------------------------------------------------------------------------------------------
def app_of(model, name: str = "tiny", queries=None, query_layers=None, ladder=None, **options):
    """build_app on models in memory (an ElasticEncoder or a backend), served as `name`; `options`: ServerConfig's
    fields (limits, defaults, api_key, ...)."""
    config = ServerConfig(model=name, **options)
    return build_app(config, Models(name, model, queries or {}, query_layers or {}, ladder))


class FakeBackend:
    """A backend (the Backend protocol) that answers each text with its layer in every number, once its gate is open
    (`open`: set it to let calls through), each call taking `seconds` more; `calls`: (layer, texts) of every call."""

    def __init__(self, tokenizer, layers: int = 4, width: int = 8, seconds: float = 0.0):
        self.tokenizer, self.pooling, self.max_length = tokenizer, "mean", 128
        self.num_layers, self.hidden_size, self.layers = layers, width, list(range(1, layers + 1))
        self.open, self.seconds = threading.Event(), seconds
        self.calls: list[tuple[int, int]] = []

    def pooled(self, texts, layer, encoded=None):
        self.open.wait(timeout=30)
        time.sleep(self.seconds)
        self.calls.append((layer, len(texts)))
        return np.full((len(texts), self.hidden_size), float(layer), dtype=np.float32)

    def describe(self):
        return {"backend": "fake", "precision": "fp32"}


def call_asgi(app, method: str, path: str, chunks, headers=()) -> tuple[int, dict, bytes, int]:
    """One request straight through the ASGI app, its body sent chunk by chunk as a chunked upload arrives (no
    Content-Length): (status, headers, body, chunks the app asked for). TestClient cannot: it reads a streamed body
    whole before the app sees any of it."""
    pulled, sent = [0], []
    source = iter(chunks)

    async def receive():
        try:
            chunk = next(source)
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body, pulled[0]


async def post_asgi(app, body: dict, headers=()) -> tuple[int, dict, bytes]:
    """One POST /v1/embeddings straight through the ASGI app on the running event loop (the app's lifespan already
    started: `app.router.lifespan_context(app)`), so that many can be in flight at once in one test: (status,
    headers, body). The client stays connected until its answer."""
    payload, sent, answered = json.dumps(body).encode(), [], asyncio.Event()
    given = [False]

    async def receive():
        if not given[0]:
            given[0] = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/embeddings",
        "raw_path": b"/v1/embeddings",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload)), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, content


def openai_client(client, key: str = "unused"):
    """The official openai client talking to a TestClient (an httpx.Client): the client's own requests, in-process."""
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0, http_client=client)


# ---- a real process -----------------------------------------------------------------------------------------------
def request(url: str, method: str = "GET", body=None, raw: bytes | None = None, headers=None, timeout: float = 60):
    """(status, headers, body bytes) of one request on a connection of its own; an HTTP error is an answer too."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    sent = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(sent, timeout=timeout) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def post(url: str, body: dict, headers=None, timeout: float = 60) -> tuple[int, str, bytes]:
    """POST /v1/embeddings: (status, content type, body)."""
    status, got, content = request(url + "/v1/embeddings", "POST", body, headers=headers, timeout=timeout)
    return status, got.get("content-type", ""), content


class ServerProcess:
    """`matryoshka2d serve MODEL ... --port PORT` in a process (a session of its own, so a signal to its group
    reaches a parent and its workers as a terminal's Ctrl-C does), its stdout and stderr collected as they come.
    `code`: Python code run in place of the command-line entry (`-c`), which then calls it; `path`: folders put
    first on the PYTHONPATH (a sitecustomize.py there is loaded by every process it starts)."""

    def __init__(self, model, *options: str, code: str | None = None, path=(), **env: str):
        self.port, self.log = free_port(), []
        self.url = f"http://127.0.0.1:{self.port}"
        python_path = os.pathsep.join(filter(None, [*map(str, path), SRC, os.environ.get("PYTHONPATH")]))
        start = ["-c", code] if code is not None else ["-m", "matryoshka2d.cli"]
        command = [sys.executable, *start, "serve", "--model", str(model), "--port", str(self.port), *options]
        self.process = subprocess.Popen(
            command,
            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()

    def output(self) -> str:
        return "".join(self.log)

    def wait_ready(self, seconds: float = 180) -> "ServerProcess":
        """Until /health answers 200 (the process exiting first, or the time passing, fails the test)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited with {self.process.returncode}:\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"serve did not answer /health within {seconds} s:\n{self.output()[-3000:]}")

    def wait_for(self, pattern: str, seconds: float = 180) -> re.Match:
        """The first match of `pattern` in the output, waited for."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output())
            if found:
                return found
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the output:\n{self.output()[-3000:]}")

    def call(self, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
        status, _, content = request(self.url + path, method, body, raw)
        return status, json.loads(content)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        """To the command's process alone, as Kubernetes or systemd send it."""
        self.process.send_signal(signum)

    def stop(self) -> None:
        """Its whole group, at once (what a test leaves running)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class InProcess:
    """An app under FastAPI's TestClient (its lifespan runs for the block), with the calls of the process harness:
    `call` (status, JSON), `call_bytes` (status, body), and the official openai client on it. `backend`: what runs
    the model ("torch" or "onnx"), for the tests that allow for onnxruntime's rounding."""

    def __init__(self, app, backend: str = "torch"):
        from fastapi.testclient import TestClient

        self.app, self.backend, self.http = app, backend, TestClient(app)

    def __enter__(self) -> "InProcess":
        self.http.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.http.__exit__(*exc)

    def call(self, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
        status, content = self.call_bytes(method, path, body, raw)
        return status, json.loads(content)

    def call_bytes(self, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        reply = self.http.request(method, path, content=data, headers={"Content-Type": "application/json"})
        return reply.status_code, reply.content

    def client(self):
        return openai_client(self.http)


def onnx_graphs_of(model_folder, cache_folder, layers=(2,)):
    """The ONNX graph cache of `model_folder`'s `layers`, built into `cache_folder` (an export takes seconds: a
    module builds it once, then servers and backends read it)."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.serve.backends import OnnxBackend

    encoder = ElasticEncoder(str(model_folder), device="cpu")
    OnnxBackend(encoder, layers=list(layers), cache_folder=cache_folder, log=lambda _: None)
    return cache_folder
