"""The processes of `train --processes N` live and die together (issue 22): SIGTERM to the launcher stops every
worker, a SIGKILL'd launcher takes its workers with it, and a worker that dies is named with its cause.

These start real processes and send real signals. The end-to-end case trains a tiny model; the others run a
stand-in command (`idle`, in helpers/processes.py) in the workers, which needs no model and starts in seconds."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.processes import alive
from matryoshka2d.retrieval.ray_watchdog import descendants  # pid -> start time of every process under a pid

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)


def wait_for(condition, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {seconds} s")
        time.sleep(0.1)


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def start_idle_launcher(folder: Path) -> subprocess.Popen:
    code = (
        "import sys; from matryoshka2d.training.parallel import launch; from helpers.processes import idle; "
        f"sys.exit(launch(idle, [{str(folder)!r}], 2))"
    )
    return start(["-c", code], folder)


def worker_pids(folder: Path) -> list[int]:
    wait_for(lambda: len(list(folder.glob("rank-*.pid"))) == 2, 120, "both workers starting")
    return [int((folder / f"rank-{r}.pid").read_text()) for r in (0, 1)]


def cleanup(pids):
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_to_train_processes_2_leaves_no_process_alive(tiny_dir, files, tmp_path):
    """The acceptance case: a real two-process training run, SIGTERM to the launcher while both train; 10 s
    later no process of the run is alive, the launcher said why, and nobody printed a traceback."""
    out = tmp_path / "run"
    args = ["-m", "matryoshka2d.cli", "train", "--model", str(tiny_dir), "--pooling", "mean"]
    args += ["--data", str(files / "triplets.tsv"), "--eval-file", str(files / "dev.tsv"), "--batch-size", "8"]
    args += ["--steps", "1000000", "--save-steps", "0", "--log-every", "1", "--output", str(out), "--processes", "2"]
    launcher = start(args, tmp_path)
    run = []
    try:
        log = out / "train_log.jsonl"
        wait_for(lambda: log.is_file() and log.read_text().strip(), 240, "the first training step")
        run = descendants(launcher.pid)
        assert len([p for p in run if alive(p)]) >= 2  # both workers (and multiprocessing's resource tracker)
        launcher.send_signal(signal.SIGTERM)
        wait_for(lambda: launcher.poll() is not None and not any(alive(p) for p in run), 10, "every process ending")
        _, err = launcher.communicate()
        assert launcher.returncode == 128 + signal.SIGTERM
        assert "stopped by SIGTERM; all 2 processes were stopped" in err and "Traceback" not in err
    finally:
        cleanup([launcher.pid, *run])


def test_workers_die_with_a_sigkilled_launcher(tmp_path):
    launcher = start_idle_launcher(tmp_path)
    pids = []
    try:
        pids = worker_pids(tmp_path)
        launcher.kill()  # SIGKILL: no handler runs in the launcher
        launcher.wait(10)
        wait_for(lambda: not any(alive(p) for p in pids), 10, "the workers ending with their launcher")
    finally:
        cleanup([launcher.pid, *pids])


def test_a_killed_worker_is_named_with_its_signal(tmp_path):
    launcher = start_idle_launcher(tmp_path)
    pids = []
    try:
        pids = worker_pids(tmp_path)
        os.kill(pids[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=20)
        assert launcher.returncode == 1
        assert f"error: process 1 of 2 (pid {pids[1]}) was killed by SIGKILL; the other processes were stopped" in err
        assert "Traceback" not in err
        assert not any(alive(p) for p in pids)
    finally:
        cleanup([launcher.pid, *pids])


def test_lost_contact_errors_are_recognised_and_shortened():
    from matryoshka2d.training.parallel import _lost_contact, _reason, exit_cause

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37773: "
        "Connection reset by peer. This is typically caused by a remote worker hanging"
    )
    assert _lost_contact(gloo) and not _lost_contact(RuntimeError("shape mismatch"))
    assert _reason(gloo) == "Read error [127.0.0.1]:37773: Connection reset by peer"
    assert exit_cause(-signal.SIGTERM) == "was killed by SIGTERM" and exit_cause(7) == "exited with code 7"
