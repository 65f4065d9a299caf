"""What the serving benchmarks do to the machine they run on: they stop no other process unless a user names it
(--pause, --pause-training), never stop what they started themselves, continue what they stopped and print it; and
what they write or run by default lies in the checkout or is asked for."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
SLEEP = "987.654"  # a sleep no other process on the machine runs: what the pattern below names
PATTERN = r"sleep 987\.654"


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(CHECKOUT / "benchmarks"))


@pytest.fixture
def outsider():
    """A process that is not this one's descendant (started by a shell that exits at once), as the machine's other
    work is: its id."""
    shell = subprocess.run(
        ["sh", "-c", f"sleep {SLEEP} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    pid = int(shell.stdout)
    yield pid
    subprocess.run(["kill", "-CONT", str(pid)], check=False)
    subprocess.run(["kill", str(pid)], check=False)


def state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped)."""
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]


def settled_state(pid: int, expected: str) -> str:
    """The state once a signal sent to the process has taken effect (expected), or what it is after 5 s."""
    deadline = time.monotonic() + 5
    while state(pid) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return state(pid)


def test_pause_stops_what_it_names_for_the_span_and_prints_it(benchmarks, outsider, capsys):
    from pausing import Pause

    ours = subprocess.Popen(["sleep", SLEEP])  # matches the pattern too, but this process started it
    try:
        pause = Pause("--pause", PATTERN)
        with pause.span():
            assert settled_state(outsider, "T") == "T"
            assert state(ours.pid) != "T"
        assert settled_state(outsider, "S") != "T"
    finally:
        ours.kill()
        ours.wait()
    printed = capsys.readouterr().out
    assert f"--pause {PATTERN!r}: stopping 1 during timed spans: {outsider} sleep {SLEEP}" in printed


def test_pause_never_stops_the_processes_that_started_it(outsider):
    """A shell (or `timeout`) that started the benchmark holds the pattern in its own command line."""
    matching = (
        f"import sys; sys.path.insert(0, {str(CHECKOUT / 'benchmarks')!r}); from pausing import Pause; "
        f"print(sorted(Pause('--pause', {PATTERN!r}).matching()))"
    )
    shell = subprocess.run(
        ["sh", "-c", f'"$0" -c "$1"; echo "shell $$" # sleep {SLEEP}', sys.executable, matching],
        capture_output=True,
        text=True,
        check=True,
    )
    listed, shell_line = shell.stdout.splitlines()

    assert listed == f"[{outsider}]"
    assert shell_line.startswith("shell ") and shell_line.split()[1] not in listed


def test_pause_continues_what_it_stopped_when_the_span_fails(benchmarks, outsider):
    from pausing import Pause

    pause = Pause("--pause", PATTERN)
    with pytest.raises(RuntimeError, match="the span failed"), pause.span():
        assert settled_state(outsider, "T") == "T"
        raise RuntimeError("the span failed")
    assert settled_state(outsider, "S") != "T"
    assert pause.stopped == []


def test_pause_without_a_pattern_stops_nothing(benchmarks, outsider, capsys):
    from pausing import Pause

    pause = Pause("--pause")
    with pause.span():
        time.sleep(0.1)
        assert state(outsider) != "T"
    assert pause.describe() == "--pause: not given, no other process is stopped during timed spans"
    assert capsys.readouterr().out == ""


def test_the_serving_harness_stops_nothing_and_logs_in_the_checkout_by_default(benchmarks):
    from serving_harness import machine_arguments

    parser = argparse.ArgumentParser()
    machine_arguments(parser, settle=1.0, logs="serve-capacity")
    given = parser.parse_args([])

    assert given.pause is None
    assert Path(given.logs) == CHECKOUT / "runs" / "serve-capacity"
    assert parser.parse_args(["--pause", "python"]).pause == "python"


def test_serve_load_refuses_an_infinity_server_without_its_venv():
    done = subprocess.run(
        [sys.executable, str(CHECKOUT / "benchmarks" / "serve_load.py"), "--servers", "onnx", "infinity-optimum"],
        capture_output=True,
        text=True,
        check=False,
    )

    assert done.returncode == 2
    assert "--servers infinity-optimum needs --infinity-venv VENV" in done.stderr
