"""The server as a process: `run(config)` checks the address, loads what the config asks for, and serves it with
uvicorn until a signal drains it; `serve --workers N` runs N such processes on one port (serve/workers.py).

The drain, as a load balancer needs it. From SIGTERM or SIGINT (Ctrl-C) until the last request accepted before it is
answered (or `--drain-seconds` pass), the listener stays open and every new request, `/health` included, is answered
at once with a 503 `server_shutting_down` and `Connection: close` (admission.Guard), so a balancer's check sees the
replica going and moves on, and no client finds its connection refused or reset. Then the server shuts down as
uvicorn does (listeners closed, idle connections closed) and the process exits 0: a drain that worked, not a death
by signal. What the drain cannot finish by its deadline is answered 503 in OpenAI's shape. A second signal ends the
drain at once; a third leaves without waiting, as uvicorn's second Ctrl-C does. uvicorn alone closes its listeners
as soon as it is told to stop, which refuses every connection of the drain.

A worker of `serve --workers N` drains the same way on the shared port, and keeps its listener open until every
worker has answered what it accepted: a listener that closes early hands the connections queued on it to nobody
(SO_REUSEPORT resets them), so the parent tells all to close together (serve/workers.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys

import uvicorn
from fastapi import FastAPI

from matryoshka2d import outputs
from matryoshka2d.serve.admission import Admission
from matryoshka2d.serve.app import build_app
from matryoshka2d.serve.config import LOG_LEVELS, ServerConfig
from matryoshka2d.serve.engine import Models
from matryoshka2d.serve.workers import WorkerChannel

# How often the drain looks whether the requests it accepted are all answered (uvicorn's own loop ticks at 0.1 s).
DRAIN_POLL_SECONDS = 0.05
# uvicorn's own wait for connections and tasks once the drain has ended: a backstop only, since by then every
# accepted request was answered (or cut, at the drain's deadline, with a 503).
GRACEFUL_SHUTDOWN_SECONDS = 5.0


def run(config: ServerConfig) -> int:
    """Serve `config` until a signal drains the server; the exit code (0 for a drain). With `workers` above 1, as N
    processes on one port. The address is checked before the model loads. Files written (only the ONNX graph
    cache) go through the one writer, checked against what the server reads (matryoshka2d.outputs)."""
    if outputs.current_scope() is not None:  # `matryoshka2d serve` opened it, over the same inputs
        return _run(config)
    with outputs.command_scope("--onnx-cache", config.inputs()):
        return _run(config)


def _run(config: ServerConfig) -> int:
    if config.workers > 1:  # N processes on one port, each a whole server (serve/workers.py)
        from matryoshka2d.serve.workers import check_workers, serve_in_workers

        check_workers(config.workers)
        check_listen(config.host, config.port)  # once here, before any worker loads a model
        return serve_in_workers(config)
    check_listen(config.host, config.port)
    from matryoshka2d.serve.loading import load_models

    models = load_models(config)
    app = build_app(config, models)
    print(start_lines(config, models), file=sys.stderr)
    serve_app(app, config)
    return 0


def check_listen(host: str, port: int) -> None:
    """The address can be listened on, checked before the model loads: a port out of range or taken, or a host
    that is not this machine's, is a message naming the flag (uvicorn would fail with a traceback, or only after
    the model loaded)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            sock.bind(address)
        except OSError as exc:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None


def start_lines(config: ServerConfig, models: Models) -> str:
    """What the server says when it starts: what it serves, where, and its guards (never the key itself)."""
    main, name = models.main, models.name
    kind = f"onnx {config.quantize or 'fp32'}" if config.backend == "onnx" else "torch"
    layers = "" if config.layers is None else f" (layers {', '.join(map(str, config.layers))})"
    lines = [
        f"serving {name} ({kind}): {main.num_layers} layers{layers} x {main.hidden_size} dims on http://"
        f"{config.host}:{config.port} (POST /v1/embeddings, GET /v1/models, GET /health); cells by name: "
        f"{name}@<layer>x<dimensions>"
    ]
    guards = [
        f"at most {config.max_queued_texts} texts waiting, nor a request the model could not answer within "
        f"{config.max_queue_ms:g} ms (429 past either); calls within {config.target_ms:g} ms (the latency objective)"
    ]
    guards.append("API key required (Authorization: Bearer)" if config.api_key else "no API key (open to all)")
    guards.append("event loop and HTTP parser: {} and {}".format(*event_loop_and_parser()))
    if models.ladder is not None:
        rungs = ", ".join(f"{r.name} ({r.quality:.3f})" for r in models.ladder.rungs)
        guards.append(f"adaptive depth: rungs {rungs}")
    if config.query_cell is not None:
        guards.append(f"input_type query -> {name}@{config.query_cell.label}")
    lines.append("; ".join(guards))
    return "\n".join(lines)


def serve_app(app: FastAPI, config: ServerConfig) -> None:
    """Run `app` (build_app's) in one uvicorn worker until a signal drains it (see the module's docstring); a model
    call still running at the end is not waited for (it cannot be interrupted, and the drain would end as late as
    it does). As one worker of `serve --workers N`, it listens on the port the workers share once all have loaded,
    and tells the parent (serve/workers.py)."""
    freeze_what_is_loaded()
    worker = WorkerChannel.from_environment()  # one of `serve --workers N` (serve/workers.py), else None
    sockets = [worker.listener_when_told(config.host)] if worker is not None else None  # once every worker loaded
    loop, parser = event_loop_and_parser()
    settings = uvicorn.Config(
        app,
        host=config.host,
        port=worker.port if worker is not None else config.port,
        workers=1,
        log_level=config.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        loop=loop,
        http=parser,
        # uvicorn formats every request's access line (client address, path) whenever its access logger has a
        # handler, whether or not the level lets the line out: above info nothing is printed, so nothing is made
        access_log=LOG_LEVELS.index(config.log_level) >= LOG_LEVELS.index("info"),
    )
    DrainingServer(settings, app.state.admission, config.drain_seconds, sockets, worker).run()
    if app.state.engine.busy():  # Python's exit would join the model's thread, and wait out its call
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def event_loop_and_parser() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser, named: uvloop and httptools (libuv's loop and llhttp's parser, in C;
    installed with uvicorn[standard] wherever they build), else asyncio's loop and h11, in Python. uvicorn's "auto"
    picks the same; naming them says which runs (the start line prints it)."""
    from importlib.util import find_spec

    return ("uvloop" if find_spec("uvloop") else "asyncio"), ("httptools" if find_spec("httptools") else "h11")


def freeze_what_is_loaded() -> None:
    """Move every object alive now (the model, its tokenizer, torch / onnxruntime / FastAPI and their modules: about
    200,000 objects) out of the garbage collector's reach. Python's full collection walks every tracked object while
    it holds the GIL: about 200 ms on this machine's shared core, with the event loop and the model thread both
    stopped, whenever enough of the requests' objects have survived into the oldest generation. What is loaded
    before serving lives as long as the process and never needs collecting; the requests' own objects still are
    collected (gc.freeze is CPython's tool for exactly this, in long-running servers)."""
    gc.collect()
    gc.freeze()


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, except that SIGTERM or SIGINT (Ctrl-C) drains (see the module's docstring) before uvicorn
    shuts down, and is not raised again afterwards (uvicorn raised SIGINT again: exit 130, with tracebacks).
    `worker`: the channel to the parent of `serve --workers N`, which says when every worker has drained."""

    def __init__(
        self,
        config: uvicorn.Config,
        admission: Admission,
        drain_seconds: float = 30.0,
        sockets: list[socket.socket] | None = None,
        worker: WorkerChannel | None = None,
    ):
        super().__init__(config)
        self.admission, self.drain_seconds = admission, drain_seconds
        self.loop: asyncio.AbstractEventLoop | None = None
        self.signals = 0
        self.listeners, self.worker = sockets, worker
        self.drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets if sockets is not None else self.listeners)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.worker is not None:
            self.worker.serving(self)

    def handle_exit(self, sig, frame):
        if sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self.signals += 1
        self.admission.draining = True  # from here on every new request is answered 503 (admission.Guard)
        if self.signals > 2 or self.loop is None:  # a third signal, or one before the server runs: leave now
            self.should_exit = True
            self.force_exit = self.signals > 2
        else:  # a signal handler runs between two steps of the loop: the drain runs on it
            self.loop.call_soon_threadsafe(self._drain_step)

    def _drain_step(self) -> None:
        if self.signals == 1:
            self.admission.drain(self.drain_seconds)  # its deadline cuts what is still in flight then
            self.drain_task = self.loop.create_task(self._exit_when_drained())
            logging.getLogger("uvicorn.error").info(
                "Draining: new requests get 503 on the open port; %d accepted ones answered within %g s (pid %d)",
                len(self.admission.in_flight),
                self.drain_seconds,
                os.getpid(),
            )
        else:  # a second signal: the drain ends now
            self.admission.cut_in_flight()

    async def _exit_when_drained(self) -> None:
        """Listen (answering 503) until every request accepted before the drain is answered, then let uvicorn shut
        down; a worker first waits for its siblings (serve/workers.py)."""
        while self.admission.in_flight:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if self.worker is not None:
            await self.worker.drained()
        self.should_exit = True
