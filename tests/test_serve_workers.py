"""`serve --workers N` (serve/workers.py, issue 53 item 3): N processes on one port, each a whole server; started
together and drained together on SIGTERM or a terminal's Ctrl-C, the shared port open and answering 503 until every
worker has answered what it accepted (issue 61, item 2); a bad --workers value, or a worker that fails to start,
ends the server with a message and a non-zero code.

Real processes: what is tested is the kernel spreading connections, signals and exit codes. A `sitecustomize.py` on
the workers' PYTHONPATH says when a worker's model call starts (with its pid), or fails every worker but the first
at start."""

import json
import os
import re
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.models import wide_bert_folder
from helpers.server import ServerProcess, post, request
from matryoshka2d.cli import main
from matryoshka2d.serve.workers import WORKER_ENV

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="two workers need two CPUs"
)

# Loaded by every process the tests start (PYTHONPATH): in a worker (WORKER_ENV set), a model call of a text holding
# "slow" says so (with its pid) and lasts 1 s more (the texts alone took 0.3 s on a quiet Xeon: every accepted
# request was answered before the drain's new requests came); with FAIL_LATER_WORKERS, every worker but the first
# to start fails where the model loads, with a message of its own.
SITECUSTOMIZE = f"""
import os, sys, time
if {WORKER_ENV!r} in os.environ:
    from matryoshka2d.serve import backends
    real = backends.TorchBackend.pooled
    def pooled(self, texts, layer, encoded=None):
        if any("slow" in text for text in texts):
            print(f"MODEL CALL STARTED in {{os.getpid()}}", file=sys.stderr, flush=True)
            time.sleep(1)
        return real(self, texts, layer, encoded)
    backends.TorchBackend.pooled = pooled
    marker = os.environ.get("FAIL_LATER_WORKERS")
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))  # the first worker to start creates it
        except FileExistsError:
            from matryoshka2d.serve import loading
            def no_room(*a, **kw):
                raise ValueError("this worker found no memory for its model")
            loading.load_encoder = no_room
"""
LONG = "a slow one: red cat sleeps on the old mat " * 40  # about 440 tokens


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tokenizer):
    """A random BERT of 12 layers x 384, as a folder: a text of 440 tokens is about a second of a core."""
    return wide_bert_folder(tmp_path_factory.mktemp("wide"), tokenizer)


def two_workers(model, tmp_path, *options, **env) -> ServerProcess:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return ServerProcess(
        model, "--pooling", "mean", "--served-name", "tiny", "--workers", "2", *options, path=[tmp_path], **env
    )


def ready_pids(server: ServerProcess) -> set[int]:
    found = server.wait_for(r"serve: 2 workers ready on \S+ \(pids (\d+), (\d+)\)")
    return {int(found[1]), int(found[2])}


def health_worker(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=30) as reply:  # a connection of its own each time
        assert json.loads(reply.read())["status"] == "ok"
        return int(reply.headers["x-matryoshka2d-worker"])


def test_two_workers_answer_on_one_port_and_sigterm_keeps_it_open_with_503s_until_both_answered_what_they_took(
    wide_model, tmp_path
):
    # requests of seconds queue here on purpose: no deadline refuses them (the default, 2 s, would)
    server = two_workers(wide_model, tmp_path, "--drain-seconds", "120", "--max-queue-ms", "600000")
    try:
        pids = ready_pids(server)
        assert server.process.pid not in pids
        # A terminal's Ctrl-C is SIGINT to every process of its group: the workers, in a group of their own, hear it
        # once (from the parent); in the parent's group its copy would be their second, which ends the drain at once.
        assert {os.getpgid(pid) for pid in pids}.isdisjoint({os.getpgid(server.process.pid)})
        # the kernel spreads connections: 32 of them reach both workers (all on one: a chance of 2 in 2^32)
        assert {health_worker(server.url) for _ in range(32)} == pids
        status, _, body = post(server.url, {"model": "tiny", "input": ["red cat", "blue dog"]})
        assert status == 200 and len(json.loads(body)["data"]) == 2
        with ThreadPoolExecutor(8) as pool:  # each on a connection of its own, until both workers run one
            taken = [pool.submit(post, server.url, {"model": "tiny", "input": f"{i} {LONG}"}) for i in range(8)]
            deadline = time.monotonic() + 120
            while {int(p) for p in re.findall(r"MODEL CALL STARTED in (\d+)", server.output())} != pids:
                assert time.monotonic() < deadline, server.output()[-3000:]
                time.sleep(0.05)
            time.sleep(1.0)  # the other requests reach their workers (each queues behind its worker's call)
            signalled = time.monotonic()
            server.signal(signal.SIGTERM)  # to the parent alone, as Kubernetes or systemd send it
            while server.output().count("Draining: new requests get 503") < 2:  # the parent forwarded it to both
                assert time.monotonic() < deadline, server.output()[-3000:]
                time.sleep(0.02)
            during = [
                request(server.url + "/v1/embeddings", "POST", {"model": "tiny", "input": "new"}) for _ in range(10)
            ]
            health = [request(server.url + "/health") for _ in range(4)]
            answered_meanwhile = sum(t.done() for t in taken)
            code = server.process.wait(timeout=180)
            took = time.monotonic() - signalled
            answers = [t.result(timeout=30) for t in taken]
    finally:
        server.stop()
    output = server.output()
    assert code == 0, output[-3000:]
    assert [status for status, _, _ in during] == [503] * 10, output[-3000:]  # none refused or reset
    assert all(headers["connection"] == "close" for _, headers, _ in during)
    assert [status for status, _, _ in health] == [503] * 4
    assert answered_meanwhile < len(taken)  # the new requests came while accepted ones still ran
    assert [status for status, _, _ in answers] == [200] * len(answers), answers  # every accepted one answered
    assert took < 120, output[-3000:]  # within the drain
    assert "Traceback" not in output and "while serving" not in output, output[-3000:]


def test_a_worker_failing_at_start_stops_the_started_one_and_ends_the_server_with_its_error(tiny_dir, tmp_path):
    server = two_workers(tiny_dir, tmp_path, FAIL_LATER_WORKERS=str(tmp_path / "first-worker"))
    try:
        code = server.process.wait(timeout=180)
    finally:
        server.stop()
    output = server.output()
    assert code == 2, output[-3000:]
    assert "matryoshka2d serve: error: this worker found no memory for its model" in output  # its line, as it said it
    assert "workers ready" not in output and "Traceback" not in output, output[-3000:]
    # the first worker, loaded and waiting to listen, was stopped with it: nothing answers on the port
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "/health", timeout=2)


def test_workers_below_one_or_above_the_cpus_are_refused_before_anything_loads(tiny_dir, monkeypatch, capsys):
    from matryoshka2d.serve import loading

    monkeypatch.setattr(loading, "load_encoder", lambda *a, **kw: pytest.fail("the model was loaded"))
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
