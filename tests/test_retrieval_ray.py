"""`index build --engine ray`: the encoder pass on Ray Data (one model per actor) equals the in-process build,
and a driver killed with SIGKILL resumes from the shards it wrote. One Ray session serves the whole module
(starting Ray takes seconds)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.data import write_corpus
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.retrieval.index import build_index
from matryoshka2d.retrieval.search import CellIndex

# The module's Ray listens on 127.0.0.1 only (ray reads this when it is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="ray (the [ray] extra, in dev) is not installed")

SRC = str(Path(__file__).resolve().parents[1] / "src")
CELLS = [(1, 8), (4, 32)]
WORDS = ["cats", "dogs", "rain", "guitars", "banks", "snow", "bikes", "music", "code", "tea", "sea", "hills"]
MANY = [{"_id": f"m{i}", "text": f"item {i} is about {WORDS[i % 12]} and {WORDS[(i * 7) % 12]}"} for i in range(600)]


@pytest.fixture(scope="module")
def ray_session():
    os.environ["PYTHONPATH"] = SRC + os.pathsep + os.environ.get("PYTHONPATH", "")  # workers import matryoshka2d
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield context.address_info["gcs_address"]
    ray.shutdown()


def shards_of(directory):
    return {p.name: np.load(p) for p in sorted((directory / "shards").glob("shard-*.npz"))}


def assert_same_build(got_dir, want_dir):
    got, want = shards_of(got_dir), shards_of(want_dir)
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name]["ids"], want[name]["ids"])
        for n, d in CELLS:
            np.testing.assert_allclose(got[name][f"cell-{n}x{d}"], want[name][f"cell-{n}x{d}"], rtol=0, atol=1e-6)
    assert CellIndex(got_dir).ids == CellIndex(want_dir).ids
    for cell in CELLS:
        a, b = CellIndex(got_dir).index(cell), CellIndex(want_dir).index(cell)
        np.testing.assert_allclose(a.reconstruct_n(0, a.ntotal), b.reconstruct_n(0, b.ntotal), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def local_build(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    corpus = write_corpus(root / "corpus.jsonl", MANY)
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    build_index(encoder, corpus, CELLS, root / "local", shard_size=20, keep_shards=True, log=lambda m: None)
    return root, corpus


def test_a_ray_build_killed_with_sigkill_resumes_and_equals_the_in_process_build(
    ray_session, local_build, tiny_dir, tmp_path, capsys
):
    """Two workers; the driver is killed (SIGKILL) once it has written a shard, a half-written shard and a
    temporary file are left behind, and the same command resumes: every shard, encoded on Ray, equals the
    in-process build (same ids, vectors within 1e-6). One test, since every Ray actor pool costs seconds."""
    root, corpus = local_build
    out = tmp_path / "killed"
    args = ["index", "build", "--model", str(tiny_dir), "--pooling", "mean", "--corpus", str(corpus)]
    args += ["--cells", "1:8,4:32", "--shard-size", "20", "--keep-shards", "--output", str(out)]
    args += ["--engine", "ray", "--workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen(
        [sys.executable, "-m", "matryoshka2d.cli", *args, "--address", ray_session],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Ray's workers start at low priority: on a loaded machine the first shard can take minutes.
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and driver.poll() is None:
        try:
            if json.loads((out / "manifest.json").read_text())["shards"]:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    if driver.poll() is not None:
        pytest.fail(f"the driver ended (exit code {driver.returncode}) before it could be killed")
    driver.send_signal(signal.SIGKILL)  # kill -9 once the first shard is in the manifest
    driver.wait()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shards"] and not manifest["complete"], "the driver wrote no shard in 900 s"
    # What a driver killed while writing leaves: a temporary file and a shard the manifest does not name.
    missing = next(f"shard-{i:05d}.npz" for i in range(30) if f"shard-{i:05d}.npz" not in manifest["shards"])
    (out / "shards" / missing).write_bytes(b"PK\x03\x04 half a shard")
    (out / "shards" / "shard-00029.tmp.npz").write_bytes(b"PK\x03\x04")
    assert main(args) == 0  # the same command, in this process (on the module's Ray session)
    err = capsys.readouterr().err
    assert f"resuming after {len(manifest['shards'])} finished shards" in err
    assert f"{30 - len(manifest['shards'])} shards to encode on 2 actors" in err
    assert json.loads((out / "manifest.json").read_text())["complete"]
    assert not list((out / "shards").glob("*.tmp.npz"))
    assert_same_build(out, root / "local")


def test_a_ray_address_that_does_not_answer_is_named(tiny_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl", MANY[:5])
    args = ["index", "build", "--model", str(tiny_dir), "--corpus", str(corpus), "--cells", "1:8"]
    args += ["--output", str(tmp_path / "o"), "--engine", "ray"]
    start = time.monotonic()
    assert main([*args, "--address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--address 127.0.0.1:1: no Ray cluster answers there" in err and "Nothing was changed" in err
    assert time.monotonic() - start < 30 and not (tmp_path / "o").exists()
    assert main([*args, "--address", "nowhere"]) == 2
    assert "write it as host:port" in capsys.readouterr().err
    assert main([*args[:-2], "--workers", "2"]) == 2
    assert "--address and --workers are for --engine ray" in capsys.readouterr().err
