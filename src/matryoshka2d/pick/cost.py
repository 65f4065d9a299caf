"""Cost as served: the time to encode at each layer, measured with the backend that will serve it, on this machine.

Two numbers per (layer, backend):

- one query: ms for one text per call (how a query arrives at a server), through the server's own backend object
  (serve/backends.py: tokenizer, model call, pooling; serve/served.py names the backends). Per text the fastest
  of a few runs (other processes only ever add time), then the median over texts; layers take turns round by
  round, so a change in machine load touches them all alike.
- batched (`--batch B`): ms per text when B texts go in one call, the throughput of an offline pass.

An exit at layer n runs n layers, so both depend on the layer, not the width. They depend on the architecture,
the machine, the backend and the threads, not on the weights: they are measured once per such key and cached in
the cache directory (`--remeasure` refreshes them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from matryoshka2d.evaluate.results import cpu_name
from matryoshka2d.outputs import write_json
from matryoshka2d.serve.timing import measure_batched, measure_latency


def cost_key(info: dict, backend: str = "torch", batch: int | None = None) -> str:
    """What a timing depends on: the architecture, the machine, the backend and the threads."""
    import torch

    parts = [info.get(k) for k in ("architecture", "layers", "transformer_size", "hidden_size", "parameters")]
    key = f"{'/'.join(map(str, parts))} | {cpu_name()} x{os.cpu_count()} | torch threads {torch.get_num_threads()}"
    if backend != "torch":  # torch's key is the one caches written before backends were timed hold
        key += f" | backend {backend}"
    return key + (f" | batch {batch}" if batch else "")


def load_timed(model: str, pooling: str | None, recorded: str | None):
    """The encoder pick times, and its weights checksum. Results evaluated with a folder's exit heads left off
    (`--no-heads`) recorded the checksum without them: when that is the one that matches, the heads stay off for
    the timing too."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.identity import weights_sha256

    encoder = ElasticEncoder(model, pooling=pooling, device="cpu")
    checksum = weights_sha256(encoder)
    if recorded and checksum != recorded and encoder.exit_heads is not None:
        heads = encoder.exit_heads
        encoder.set_exit_heads(None)
        if weights_sha256(encoder) == recorded:
            return encoder, recorded
        encoder.set_exit_heads(heads)
    return encoder, checksum


def _read_cache(path) -> dict:
    """The timing cache's table; a damaged one (not JSON, not UTF-8, a number too long to read, not an object) is
    re-measured, not fatal."""
    if path.is_file():
        try:
            table = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError and int-digit limits alike
            return {}
        if isinstance(table, dict):
            return table
    return {}


def _usable(record) -> bool:
    """Whether a cached timing holds what pick reads: ms per layer (numbers under whole-number keys) and a date."""
    if not isinstance(record, dict) or not isinstance(record.get("date"), str):
        return False
    ms = record.get("ms_per_query")
    return (
        isinstance(ms, dict)
        and bool(ms)
        and all(
            k.isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for k, v in ms.items()
        )
    )


def layer_latency(
    model,
    pooling: str | None,
    remeasure: bool,
    log: Callable[[str], None],
    backend: str = "torch",
    batch: int | None = None,
) -> tuple[dict[int, float], dict]:
    """ms per query at every layer of `model` (a name, or an ElasticEncoder already loaded) with `backend`, from
    the cache or measured now; with `batch`, ms per text in calls of `batch` texts instead. And the timing record."""
    from matryoshka2d.models.backbones import cache_dir
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.serve.served import make_backend

    encoder = ElasticEncoder(model, pooling=pooling, device="cpu") if isinstance(model, str) else model
    key = cost_key(encoder.info(), backend, batch)
    cache = cache_dir() / "layer_latency.json"
    table = _read_cache(cache)
    what = f"ms per text in calls of {batch}" if batch else "encode time per query"
    if _usable(table.get(key)) and not remeasure:
        record = table[key]
        log(f"{what} per layer ({backend}): cached {record['date']} ({cache})")
    else:
        log(f"measuring {what} per layer of {encoder.name} with the {backend} backend...")
        layers = encoder.layers  # layer 0 too where the model holds a static cell (models.static)
        served = make_backend(encoder, backend, layers, log=log)
        ms = measure_batched(served, layers, batch) if batch else measure_latency(served, layers)
        record = {
            "ms_per_query": {str(k): v for k, v in ms.items()},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "model_measured": encoder.name,
            "backend": backend,
            **({"batch": batch} if batch else {}),
        }
        table = _read_cache(cache)  # another process may have added a key meanwhile
        table[key] = record
        # Through the one writer: a temporary file renamed into place, so a pick killed mid-write leaves the old
        # cache whole, and a cache file that is a link (into a model folder, say) is replaced, not written through.
        write_json(cache, table, indent=1)
    return {int(k): v for k, v in record["ms_per_query"].items()}, {**record, "key": key}
