"""The encoder pass of `index build --engine ray`: Ray Data `map_batches` over the corpus's shards, with one
model per actor.

The driver (the `index build` process) reads the corpus and cuts it into the same shards as a local build;
each shard that the manifest does not name yet becomes one row of a Ray dataset (its number and texts). An
actor pool of `workers` actors, each holding one ElasticEncoder loaded from the same model name or folder,
encodes a shard at a time, every indexed cell from one pass, and returns the vectors. The driver writes each
shard's file as it arrives (atomically, then the manifest names it), so the files land where the build
directory is, whatever node encoded them, and a killed build resumes from the shards already written. Each
actor reports its model's weights checksum, and a shard from a different model is refused.

Workers must be able to import matryoshka2d and load the model (same version and folder on every node of a
cluster). Locally, without `--address`, a Ray instance is started for the build and stopped after it; a watchdog
ends what is left of it when the build ends, also when it is killed (retrieval/ray_watchdog.py).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlparse

import numpy as np

from matryoshka2d.cells import Cell
from matryoshka2d.retrieval.ray_watchdog import watch
from matryoshka2d.retrieval.shards import IndexBuildError, cell_name, encode_cells, model_identity

CONNECT_TIMEOUT = 5.0  # seconds to wait for a Ray head to accept a connection


def require_ray(local: bool = False):
    if local and "ray" not in sys.modules:
        # A Ray started for one build serves this machine only: its servers listen on 127.0.0.1 rather than on
        # every interface (read by ray when it is imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        import ray.data  # the Data library is ray's [data] extra
    except ImportError:
        from matryoshka2d.extras import install_line  # the package is on no index: the checkout's extra

        raise IndexBuildError(f"--engine ray needs Ray Data: {install_line('ray')}") from None
    return ray


def check_address(address: str) -> None:
    """Fail fast, naming the address, when nothing listens there: ray.init itself retries for minutes."""
    if address in ("auto", "local"):
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise IndexBuildError(f"--address {address!r}: write it as host:port (the head's GCS port, 6379 by default)")
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        raise IndexBuildError(
            f"--address {address}: no Ray cluster answers there ({exc.strerror or exc}); start one with `ray start "
            "--head` or fix the address. Nothing was changed"
        ) from None


class ShardEncoder:
    """A Ray Data actor: one model, loaded once; each batch row is a shard, answered with its cells' vectors."""

    def __init__(self, model: str, pooling: str, max_length: int, cells: list[Cell], batch_size: int):
        import torch

        from matryoshka2d.models.encoder import ElasticEncoder

        torch.set_num_threads(1)  # one CPU per actor: the pool, not the threads, spreads the work
        self.encoder = ElasticEncoder(model, pooling=pooling, max_length=max_length, device="cpu")
        self.checksum = model_identity(self.encoder)["weights_sha256"]
        self.cells, self.batch_size = [Cell(*c) for c in cells], batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, list] = {"shard": [], "checksum": [], "rows": []}
        for cell in self.cells:
            out[cell_name(cell)] = []
        for number, texts in zip(batch["shard"], batch["texts"], strict=True):
            arrays = encode_cells(self.encoder, [str(t) for t in texts], self.cells, self.batch_size)
            out["shard"].append(int(number))
            out["checksum"].append(self.checksum)
            out["rows"].append(len(texts))
            for name, vectors in arrays.items():
                out[name].append(vectors.tobytes())  # float32 bytes: no variable-shape tensor columns
        return {k: np.array(v, dtype=object if k not in ("shard", "rows") else np.int64) for k, v in out.items()}


def encode_on_ray(
    encoder,
    pending: Iterable[tuple[int, list[tuple[str, str]]]],
    cells: Sequence[Cell],
    batch_size: int,
    finished: Callable[[int, list[str], list[str], dict[str, np.ndarray]], None],
    address: str | None = None,
    workers: int | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Encode the pending shards on Ray and hand each one, as it arrives, to `finished` (which writes it)."""
    ray = require_ray(local=address is None)
    model = encoder.location  # a folder every worker loads (short names resolve to one)
    if model is None:
        raise IndexBuildError(
            "--engine ray loads the model by name or folder on every worker; this encoder was built in memory: "
            "save it (encoder.save(folder)) and build from the folder"
        )
    blocks = dict(pending)
    if not blocks:
        return
    started, watchdog = False, None
    if not ray.is_initialized():
        if address:
            check_address(address)
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            except (ConnectionError, RuntimeError) as exc:
                raise IndexBuildError(f"--address {address}: could not join the Ray cluster ({exc})") from None
        else:
            watchdog = watch()  # ends this Ray's processes with this one, also on kill -9: see ray_watchdog.py
            ray.init(num_cpus=workers, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        started = True
    try:
        import ray.data

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.enable_operator_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # our own log says what runs where
        actors = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        expected = model_identity(encoder)["weights_sha256"]
        log(
            f"  ray: {len(blocks)} shards to encode on {actors} actors (one model each), cluster "
            f"{ray.get_runtime_context().gcs_address}"
        )
        rows = [{"shard": number, "texts": [t for _, t in block]} for number, block in sorted(blocks.items())]
        dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            ShardEncoder,
            fn_constructor_kwargs={
                "model": str(model),
                "pooling": encoder.pooling,
                "max_length": encoder.max_length,
                "cells": [list(c) for c in cells],
                "batch_size": batch_size,
            },
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=min(actors, len(rows))),
            num_cpus=1,
            batch_format="numpy",
        )
        try:
            for row in dataset.iter_rows():
                number = int(row["shard"])
                if row["checksum"] != expected:
                    raise IndexBuildError(
                        f"--engine ray: a worker's model {model} has other weights (sha256 {row['checksum'][:12]}...) "
                        f"than this process's ({expected[:12]}...); every node must load the same model. Shard "
                        f"{number} was not written"
                    )
                n = int(row["rows"])
                arrays = {
                    cell_name(c): np.frombuffer(row[cell_name(c)], dtype=np.float32).reshape(n, c[1]).copy()
                    for c in cells
                }
                block = blocks[number]
                finished(number, [i for i, _ in block], [t for _, t in block], arrays)
        except IndexBuildError:
            raise
        except Exception as exc:  # a worker's error arrives wrapped by Ray; say where it came from
            first = str(exc).strip().splitlines()
            raise IndexBuildError(
                f"--engine ray: the encoder pass failed on a Ray worker ({type(exc).__name__}: "
                f"{first[-1] if first else ''}); finished shards are kept, run the same command again to resume"
            ) from None
    finally:
        if started:
            ray.shutdown()
        if watchdog is not None:
            watchdog.stdin.close()  # sets it off: whatever the shutdown left of this node goes now
