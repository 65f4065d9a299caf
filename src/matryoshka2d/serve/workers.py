"""`serve --workers N`: N server processes on one port, each a whole `serve` (its own model, micro-batcher, bounds
and /metrics), so that a machine's cores all answer.

How it works. The `serve` the user starts becomes the parent: it checks --workers and the port, then runs the same
server N times (`python -m matryoshka2d.serve`, with the ServerConfig as JSON in CONFIG_ENV and `workers` 1, so a
worker never starts workers of its own, and every check of the config runs in each worker exactly as in a
one-process server). The environment variable WORKER_ENV tells a worker it is one: it holds one end of a socket
pair to the parent, the port, and the worker's number.

- Listening: each worker listens with a socket of its own bound with SO_REUSEPORT, and the kernel spreads the
  incoming connections across the listeners by a hash of each connection's addresses. A keep-alive connection stays
  with the worker that accepted it, so connections, not requests, are what must be spread evenly; the hash does
  that. One socket bound by the parent and inherited by every worker (uvicorn's own --workers) leaves the choice to
  whichever worker's accept() wakes first, which under light load is mostly the same one, and a keep-alive client
  then stays on it.
- Start-up: the first worker runs alone until its model is loaded (an ONNX graph is built once and cached on disk,
  written atomically), then the others start together and read the graphs from the cache. No worker listens until
  every worker has loaded: each worker's own port check (the same as a one-process server's) would refuse a port a
  sibling already listens on. Then all listen, each says it is serving, and the parent prints one line. A worker that
  fails to start (its error line is its own: workers write to the parent's stdout and stderr) stops the others,
  and the parent exits with its code; a server is never left half started.
- Stopping: SIGTERM or SIGINT to the parent is forwarded, one for one, to every worker, which drains as a
  one-process server does (503 to new requests, the accepted ones answered within --drain-seconds, exit 0); a
  second signal ends the drains at once, a third leaves without waiting, as in one process. A worker that has
  answered what it accepted says "drained" and keeps listening (answering 503) until the parent, once every living
  worker has said so, tells them all to exit: a listener of the SO_REUSEPORT group that closed while the others
  drained would reset the connections the kernel had queued on it. The workers run in a
  process group of their own, so a Ctrl-C in a terminal (SIGINT to the terminal's whole foreground group) reaches
  the parent alone and each worker gets exactly one signal: had it come to the workers directly as well, the
  parent's forwarded copy would be their second, which ends the drain at once. The parent exits 0 when every worker
  exited 0, else with the first other code (128 + the signal for a worker killed by one).
- A worker that dies while serving: the parent says so on stderr, drains the others and exits non-zero, so that
  whatever supervises the server (systemd, Kubernetes, Docker's restart policy) restarts it whole; the parent
  restarts nothing itself, since a worker that died once (out of memory, a crash in a native library) would
  likely die again, and a server that keeps restarting its parts hides that from the supervisor.
- A parent that dies (SIGKILL) closes its end of every socket pair: a worker sees that and drains as on SIGTERM.

--workers above the CPUs this process may use (`os.sched_getaffinity`) is refused: a worker keeps a core busy
with its model, so more workers than CPUs only share the cores (each with its own copy of the model in memory).
Each worker's model gets CPUs / N threads (OMP_NUM_THREADS, unless it is set), not every core. Linux only: other
systems' SO_REUSEPORT does not spread connections across listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from matryoshka2d.serve.config import ServerConfig

__all__ = ["CONFIG_ENV", "WORKER_ENV", "WorkerChannel", "serve_in_workers"]

WORKER_ENV = "MATRYOSHKA2D_SERVE_WORKER"  # "FD PORT INDEX COUNT" in a worker's environment, absent elsewhere
CONFIG_ENV = "MATRYOSHKA2D_SERVE_CONFIG"  # the worker's ServerConfig, as JSON (ServerConfig.to_json)
# Past the drain, how long the parent waits for a worker before it kills it: uvicorn's own backstop in each worker
# ends it 5 s after the drain (serve/process.py), so this is only for a worker stuck where no signal reaches.
KILL_AFTER_DRAIN_SECONDS = 15.0


def check_workers(workers: int) -> int:
    """The CPUs this process may use, when `workers` fit them."""
    if not sys.platform.startswith("linux"):
        raise ValueError(
            f"--workers {workers}: several workers need Linux, whose SO_REUSEPORT spreads connections across them; "
            f"here ({sys.platform}) run one worker per port behind a balancer"
        )
    cpus = len(os.sched_getaffinity(0))
    if workers > cpus:
        raise ValueError(
            f"--workers {workers}: more than the {cpus} CPUs this process may use; each worker keeps a core busy "
            f"with its own model, so more only share the cores; give at most {cpus}"
        )
    return cpus


def serve_in_workers(config: ServerConfig) -> int:
    """Run the server of `config` as `config.workers` processes listening on its host and port; the exit code of
    the whole (the module's docstring says how)."""
    cpus = check_workers(config.workers)
    port = config.port or _free_port(config.host)  # every worker must take the same port: chosen here, once
    one = dataclasses.replace(config, workers=1, port=port)
    command = [sys.executable, "-m", "matryoshka2d.serve"]
    env = {**os.environ, CONFIG_ENV: one.to_json()}
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // config.workers)))  # torch's threads, and onnxruntime's
    pool = _Pool(command, env, port, config.workers, config.drain_seconds)
    return pool.run(config.host)


@dataclass
class _Worker:
    number: int  # 1..N, as messages name it
    process: subprocess.Popen
    channel: socket.socket  # the parent's end of the pair
    state: str = "starting"  # then "loaded" (its model is in memory), "serving", and "drained" after a signal
    told_to_exit: bool = False
    heard: bytes = b""
    forwarded: int = 0  # how many of the parent's signals it was sent

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():  # poll() reaps: a pid already reaped may belong to another process now
            os.kill(self.process.pid, signum)


@dataclass
class _Pool:
    command: list[str]
    env: dict
    port: int
    count: int
    drain_seconds: float
    workers: list[_Worker] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)  # those the parent got, each forwarded to every worker
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)

    def run(self, host: str) -> int:
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {s: signal.signal(s, self._forward) for s in handled}
        try:
            return self._run(host)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for worker in self.workers:
                worker.channel.close()
            self.selector.close()

    def _run(self, host: str) -> int:
        self._start(1)
        if not self._wait_until("loaded"):  # the first builds (or reads) the graphs alone: the others find them cached
            return self._failed_at_start()
        for number in range(2, self.count + 1):
            self._start(number)
        if not self._wait_until("loaded"):
            return self._failed_at_start()
        for worker in self.workers:
            with contextlib.suppress(OSError):  # one that died since it loaded: _wait_until sees it gone
                worker.channel.sendall(b"listen\n")
        if not self._wait_until("serving"):
            return self._failed_at_start()
        pids = ", ".join(str(w.process.pid) for w in self.workers)
        print(
            f"serve: {self.count} workers ready on http://{host}:{self.port} (pids {pids}), each with its own model, "
            "bounds and /metrics; the kernel spreads connections across them; SIGTERM or Ctrl-C drains them all",
            file=sys.stderr,
            flush=True,
        )
        while not self.signals and all(w.alive() for w in self.workers):
            self._listen(0.2)
        if self.signals:  # a drain: each worker exits 0 once it has answered what it accepted
            return self._exit_code(self._wait_for_exits())
        dead = next(w for w in self.workers if not w.alive())
        print(
            f"matryoshka2d serve: error: worker {dead.number} of {self.count} (pid {dead.process.pid}) "
            f"{_exit_cause(dead.process.returncode)} while serving; draining the others and exiting",
            file=sys.stderr,
            flush=True,
        )
        self._stop(signal.SIGTERM)
        self._wait_for_exits()
        return _code(dead.process.returncode) or 1

    def _start(self, number: int) -> None:
        ours, theirs = socket.socketpair()
        env = {**self.env, WORKER_ENV: f"{theirs.fileno()} {self.port} {number} {self.count}"}
        # A process group of its own: a terminal's Ctrl-C reaches the parent alone, which forwards it once.
        process = subprocess.Popen(self.command, env=env, pass_fds=(theirs.fileno(),), process_group=0)
        theirs.close()
        worker = _Worker(number, process, ours)
        self.workers.append(worker)
        self.selector.register(ours, selectors.EVENT_READ, worker)
        self._catch_up(worker)  # a signal that came while it was being started

    def _forward(self, signum, _frame) -> None:
        self.signals.append(signum)
        for worker in self.workers:
            self._catch_up(worker)

    def _catch_up(self, worker: _Worker) -> None:
        """Send `worker` the parent's signals it was not sent yet, each once (the handler may interrupt this, in
        the same thread: the count is taken before each is sent)."""
        while worker.forwarded < len(self.signals):
            worker.forwarded += 1
            worker.signal(self.signals[worker.forwarded - 1])

    def _listen(self, timeout: float) -> None:
        """Read what the workers said within `timeout` seconds: each line moves a worker to that state."""
        for key, _ in self.selector.select(timeout):
            worker: _Worker = key.data
            try:
                data = worker.channel.recv(4096)
            except OSError:
                data = b""
            if not data:  # the worker is gone (its exit is read by poll)
                self.selector.unregister(worker.channel)
                continue
            worker.heard += data
            *lines, worker.heard = worker.heard.split(b"\n")
            for line in lines:
                worker.state = line.decode(errors="replace")

    def _wait_until(self, state: str) -> bool:
        """Every worker started so far reached `state`: True; a worker exited, or a signal came, first: False."""
        while not self.signals and all(w.alive() for w in self.workers):
            if all(w.state == state for w in self.workers):
                return True
            self._listen(0.1)
        return False

    def _failed_at_start(self) -> int:
        if self.signals:  # stopped while starting (each worker was sent the signal): as one process stopped so
            return self._exit_code(self._wait_for_exits()) or 128 + self.signals[0]
        failed = next(w for w in self.workers if not w.alive())
        self._stop(signal.SIGTERM)
        self._wait_for_exits()
        code = failed.process.returncode
        if code != 2:  # 2: the command's own error, whose one line the worker printed
            print(
                f"matryoshka2d serve: error: worker {failed.number} of {self.count} (pid {failed.process.pid}) "
                f"{_exit_cause(code)} while starting; the other workers were stopped",
                file=sys.stderr,
                flush=True,
            )
        return _code(code) or 1

    def _stop(self, signum: int) -> None:
        for worker in self.workers:
            worker.signal(signum)

    def _wait_for_exits(self) -> list[int]:
        """Every worker's exit code, each waited for until the drain's end (and a backstop past it); once every
        living worker has drained, all are told to exit together."""
        deadline = time.monotonic() + self.drain_seconds + KILL_AFTER_DRAIN_SECONDS
        while any(w.alive() for w in self.workers) and time.monotonic() < deadline:
            self._listen(0.1)
            self._release_when_all_drained()
        for worker in self.workers:
            if worker.alive():
                print(
                    f"matryoshka2d serve: worker {worker.number} (pid {worker.process.pid}) did not exit "
                    f"{self.drain_seconds + KILL_AFTER_DRAIN_SECONDS:g} s after it was stopped; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                worker.process.kill()
            worker.process.wait()
        return [w.process.returncode for w in self.workers]

    def _release_when_all_drained(self) -> None:
        living = [w for w in self.workers if w.alive()]
        if living and all(w.state == "drained" for w in living):
            for worker in living:
                if not worker.told_to_exit:
                    worker.told_to_exit = True
                    with contextlib.suppress(OSError):  # one that died meanwhile: its exit is read by poll
                        worker.channel.sendall(b"exit\n")

    @staticmethod
    def _exit_code(codes: list[int]) -> int:
        return next((_code(c) for c in codes if c != 0), 0)


def _code(returncode: int) -> int:
    """A process's exit status as a shell reports it: 128 + the signal for one killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def _exit_cause(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _free_port(host: str) -> int:
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.bind(address)
        return sock.getsockname()[1]


@dataclass
class WorkerChannel:
    """A worker's side: its end of the socket pair to the parent, the port and its number."""

    sock: socket.socket
    port: int
    number: int
    count: int
    released: asyncio.Event | None = None  # set when the parent says every worker has drained, or is gone

    @classmethod
    def from_environment(cls) -> WorkerChannel | None:
        """This process's channel when it is a worker of `serve --workers N`, else None. The variable is taken out
        of the environment: a process this one starts is not a worker."""
        value = os.environ.pop(WORKER_ENV, None)
        if value is None:
            return None
        fd, port, number, count = map(int, value.split())
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)
        return cls(sock, port, number, count)

    def listener_when_told(self, host: str) -> socket.socket:
        """Say the model is loaded, wait until every worker's is, then listen on the shared port (SO_REUSEPORT)."""
        self.sock.sendall(b"loaded\n")
        told = b""
        while not told.endswith(b"\n"):
            part = self.sock.recv(64)
            if not part:
                raise ValueError(
                    f"worker {self.number} of {self.count}: the serve --workers process that started it "
                    "is gone; not serving"
                )
            told += part
        family, kind, proto, _, address = socket.getaddrinfo(
            host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # one listener of the workers' group
        try:
            sock.bind(address)
        except OSError as exc:  # another program took the port while the models loaded
            sock.close()
            raise ValueError(f"--host {host} --port {self.port}: cannot listen there ({exc.strerror})") from None
        sock.listen(2048)
        return sock

    def serving(self, server) -> None:
        """Called by the server once it listens: tell the parent; drain (as on SIGTERM) if the parent goes; and hear
        when every worker has drained ("exit")."""
        self.sock.sendall(b"serving\n")
        loop = asyncio.get_running_loop()
        self.released = asyncio.Event()

        def told() -> None:
            try:
                data = self.sock.recv(64)
            except OSError:
                data = b""
            if data and b"exit" not in data:
                return
            if not data:  # the parent is gone: drain as on SIGTERM, and wait for nobody
                loop.remove_reader(self.sock.fileno())
                server.handle_exit(signal.SIGTERM, None)
            self.released.set()

        loop.add_reader(self.sock.fileno(), told)

    async def drained(self) -> None:
        """Tell the parent this worker has answered what it accepted, and wait until every worker has (or the
        parent is gone): only then does it stop listening."""
        try:
            self.sock.sendall(b"drained\n")
        except OSError:
            return  # the parent is gone
        if self.released is not None:
            await self.released.wait()
