"""The Ray watchdog (retrieval.ray_watchdog): what a local Ray leaves of a killed `index build --engine ray` is
ended (Linux: it reads /proc)."""

import sys
import time
from pathlib import Path

import pytest

from helpers.processes import alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the Ray watchdog reads /proc (Linux)")
def test_what_a_local_ray_leaves_of_a_build_killed_with_sigkill_is_ended():
    """A local Ray's agents outlived a killed `index build --engine ray` by 1-2 minutes: the watchdog the build
    starts ends every process descended from the build once the build is gone. Here stand-ins play Ray's
    processes: one the build started, and one that a child of the build (an agent, noted by the watchdog's first
    look) started after the watchdog and just before the build was killed, so no poll may have seen it: the
    watchdog's last look from the noted processes still finds it, whatever the machine's load."""
    import os
    import signal
    import subprocess

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    build = f"""
import subprocess, sys, time
from matryoshka2d.retrieval.ray_watchdog import watch
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
head = subprocess.Popen({sleeper!r}, **quiet)
agent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; sys.stdin.readline(); "
    "print(subprocess.Popen({sleeper!r}).pid, flush=True); time.sleep(120)"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
dog = watch()
agent.stdin.write("go\\n")
agent.stdin.flush()
grandchild = int(agent.stdout.readline())
print(head.pid, grandchild, dog.pid, flush=True)
time.sleep(120)
"""
    other = subprocess.Popen(sleeper)  # not the build's: left alone
    driver = subprocess.Popen([sys.executable, "-c", build], stdout=subprocess.PIPE, text=True)
    head, grandchild, dog = (int(n) for n in driver.stdout.readline().split())
    try:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        for _ in range(600):  # the watchdog acts at once; this only bounds the wait
            if not alive(dog):
                break
            time.sleep(0.05)
        assert not alive(head) and not alive(grandchild)
        assert alive(other.pid)
    finally:
        other.kill()
        other.wait()
        for pid in (head, grandchild, dog):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
