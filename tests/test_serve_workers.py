"""`serve --workers N` (deploy/workers.py, issue 53 item 3): N processes on one port, each a whole server; started
together and drained together on SIGTERM or a terminal's Ctrl-C; a bad --workers value, or a worker that fails to
start, ends the server with a message and a non-zero code.

Real processes: what is tested is the kernel spreading connections, signals and exit codes. Each worker's model is
the tiny random BERT; a `sitecustomize.py` on the workers' PYTHONPATH slows model calls of texts holding "slow"
(so a request is surely in flight when the signal comes) or fails every worker but the first at start."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from matryoshka2d.cli import main
from matryoshka2d.deploy.workers import WORKER_ENV
from test_serve_guards import free_port, post

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="two workers need two CPUs"
)

# Loaded by every process the tests start (PYTHONPATH): in a worker (WORKER_ENV set), a model call of a text holding
# "slow" says so (with its pid) and takes SLOW_SECONDS; with FAIL_LATER_WORKERS, every worker but the first to start
# fails where the model loads, with a message of its own.
SITECUSTOMIZE = f"""
import os, sys, time
if {WORKER_ENV!r} in os.environ:
    from matryoshka2d.deploy import backends
    real = backends.TorchBackend.pooled
    def pooled(self, texts, layer, encoded=None):
        if any("slow" in text for text in texts):
            print(f"MODEL CALL STARTED in {{os.getpid()}}", file=sys.stderr, flush=True)
            time.sleep(float(os.environ.get("SLOW_SECONDS", "0")))
        return real(self, texts, layer, encoded)
    backends.TorchBackend.pooled = pooled
    marker = os.environ.get("FAIL_LATER_WORKERS")
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))  # the first worker to start creates it
        except FileExistsError:
            from matryoshka2d.cli import args
            def no_room(*a, **kw):
                raise ValueError("this worker found no memory for its model")
            args.load_encoder = no_room
"""


class Server:
    """`serve --workers 2` with the tiny model, in a session of its own (so a signal to its group reaches the parent
    and the workers, as a terminal's Ctrl-C does); its combined output collected as it comes."""

    def __init__(self, tiny_dir, tmp_path, *options, **env):
        (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.port, self.log = free_port(), []
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "matryoshka2d.cli", "serve", "--model", str(tiny_dir), "--pooling", "mean"]
        self.process = subprocess.Popen(
            [*command, "--served-name", "tiny", "--port", str(self.port), "--workers", "2", *options],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()

    def output(self) -> str:
        return "".join(self.log)

    def wait_for(self, pattern: str, seconds: float = 180) -> re.Match:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output())
            if found:
                return found
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in the output:\n{self.output()[-3000:]}")

    def ready_pids(self) -> set[int]:
        found = self.wait_for(r"serve: 2 workers ready on \S+ \(pids (\d+), (\d+)\)")
        return {int(found[1]), int(found[2])}

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def servers():
    started = []
    yield started
    for server in started:
        server.stop()


def health_worker(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=30) as reply:  # a connection of its own each time
        assert json.loads(reply.read())["status"] == "ok"
        return int(reply.headers["x-matryoshka2d-worker"])


def slow_requests_in_both_workers(server: Server, pids: set[int], requests: int = 12):
    """`requests` slow requests, each on a connection of its own, until both workers run one: (the pool, the
    futures of their (status, content type, body))."""
    pool = ThreadPoolExecutor(requests)
    replies = [pool.submit(post, server.url, {"model": "tiny", "input": f"a slow one {i}"}) for i in range(requests)]
    deadline = time.monotonic() + 60
    while {int(p) for p in re.findall(r"MODEL CALL STARTED in (\d+)", server.output())} != pids:
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.05)
    time.sleep(0.5)  # the other requests reach their workers (each queues behind its worker's call)
    return pool, replies


def test_two_workers_answer_on_one_port_and_sigterm_drains_both_answering_what_they_accepted(
    tiny_dir, tmp_path, servers
):
    server = Server(tiny_dir, tmp_path, "--drain-seconds", "20", SLOW_SECONDS="1.5")
    servers.append(server)
    pids = server.ready_pids()
    assert server.process.pid not in pids
    # A terminal's Ctrl-C is SIGINT to every process of its group: the workers, in a group of their own, hear it once
    # (from the parent); in the parent's group its copy would be their second signal, which ends the drain at once.
    assert {os.getpgid(pid) for pid in pids}.isdisjoint({os.getpgid(server.process.pid)})
    # the kernel spreads connections: 32 of them reach both workers (all on one: a chance of 2 in 2^32)
    assert {health_worker(server.url) for _ in range(32)} == pids
    status, _, body = post(server.url, {"model": "tiny", "input": ["red cat", "blue dog"]})
    assert status == 200 and len(json.loads(body)["data"]) == 2
    pool, replies = slow_requests_in_both_workers(server, pids)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)  # to the parent alone, as Kubernetes or systemd send it
    code = server.process.wait(timeout=60)
    took = time.monotonic() - signalled
    answers = [r.result(timeout=30) for r in replies]
    pool.shutdown()
    output = server.output()
    assert code == 0, output[-3000:]
    assert [status for status, _, _ in answers] == [200] * len(answers), answers  # every accepted one answered
    assert took < 20, output[-3000:]  # within the drain
    assert "Traceback" not in output and "while serving" not in output, output[-3000:]


def test_a_worker_failing_at_start_stops_the_started_one_and_ends_the_server_with_its_error(
    tiny_dir, tmp_path, servers
):
    server = Server(tiny_dir, tmp_path, FAIL_LATER_WORKERS=str(tmp_path / "first-worker"))
    servers.append(server)
    code = server.process.wait(timeout=180)
    output = server.output()
    assert code == 2, output[-3000:]
    assert "matryoshka2d serve: error: this worker found no memory for its model" in output  # its line, as it said it
    assert "workers ready" not in output and "Traceback" not in output, output[-3000:]
    # the first worker, loaded and waiting to listen, was stopped with it: nothing answers on the port
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "/health", timeout=2)


def test_workers_below_one_or_above_the_cpus_are_refused_before_anything_loads(tiny_dir, monkeypatch, capsys):
    from matryoshka2d.cli import args as cli_args

    monkeypatch.setattr(cli_args, "load_encoder", lambda *a, **kw: pytest.fail("the model was loaded"))
    command = ["serve", "--model", str(tiny_dir), "--port", "0"]
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--workers", "0"])
    assert exit_.value.code == 2 and "--workers: must be at least 1, got 0" in capsys.readouterr().err
    cpus = len(os.sched_getaffinity(0))
    assert main([*command, "--workers", str(cpus + 1)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error  # one line
    assert (
        f"--workers {cpus + 1}: more than the {cpus} CPUs this process may use" in error and f"at most {cpus}" in error
    )
