"""Capacity at a latency objective: the highest Poisson rate each server keeps with p99 <= --slo-ms and no error.

    python benchmarks/serve_capacity.py [--model minilm-l6] [--span 12] [--precision 0.05] [--slo-ms 100]
        [--llama-server BIN --llama-model GGUF [--llama-parallel 16] [--llama-batch 512] [--llama-sweep P:B ...]]
        [--infinity-venv DIR --infinity-folder DIR] [--server-core 0] [--client-core 1] [--pause python|PATTERN]
        [--logs DIR] [--results FILE.json]

The servers, one at a time, each pinned with taskset to --server-core with one thread:
- ours: `matryoshka2d serve --backend onnx --quantize int8 --layers N` (N: the model's depth), full depth;
- llama.cpp's `llama-server` on the model as GGUF Q8_0, `--embedding --pooling mean -t 1 -tb 1 --parallel P
  --batch-size B --ubatch-size B` (--llama-sweep: the closed-loop capacity of each P:B, the best one then measured);
- infinity-emb `--engine optimum` (its dynamic-int8 ONNX graph, ONNX Runtime) on the folder infinity_peer.py makes.
The client is serving_harness.py's (raw asyncio streams, keep-alive connections) on --client-core; each request is
one SciFact query (the same queries for all), sent on a Poisson schedule whether or not earlier ones were answered;
a request's latency counts from its scheduled arrival, and past --timeout s from it a request is a timeout.

For each server: its closed-loop capacity (--closed-clients clients for --closed-seconds) is the first guess; an
open-loop span of --span s at a rate passes when every request was answered 200 within the deadline and p99 <=
--slo-ms. From the guess the rate steps by --step until one rate passes and one fails, then bisects until the two
are within --precision of each other (at most --max-spans spans): the passing rate is the capacity at the SLO (a
rate that passes above one that failed, noise, does not count: the highest pass below every fail). Then
one span at --overload x that rate: goodput (200s within the SLO, and within the deadline, per second), p99 and
errors. One client's round trip (--round-trips sequential requests, p50) for every server; for ours also the offline
limit of the same int8 graph, measured in a child process on the server core with one thread: 1000 / (ms per text in
calls of 64 through OnnxBackend.pooled), and one query per call (p50). Between spans a server is let empty what it
holds (single requests until one is answered within a quarter of the SLO).

--pause stops nothing unless given: `--pause python` (every other Python process) or a pkill -f pattern SIGSTOPs
those processes for each timed span and SIGCONTs them after (serving_harness's timed_span); what it stopped is
printed. The servers' logs go to --logs (default: runs/serve-capacity in the checkout).

Making the peers (the commands in full, as the set-up that first ran this made them):
- llama-server: `pip download --no-binary :all: --no-deps llama-cpp-python` (0.3.36 vendors llama.cpp 0c1e570),
  unpack, in vendor/llama.cpp: `cmake -B build -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-server -j2` (the native build
  stops with an illegal instruction on the Xeon here); the GGUF: `python convert_hf_to_gguf.py MINILM_DIR --outtype
  q8_0 --outfile minilm-l6-Q8_0.gguf` in a venv with torch, transformers 4.57.6, numpy 2.2, sentencepiece and the
  source's gguf-py (MINILM_DIR: `python -c "from matryoshka2d.models.backbones import minilm_dir;
  print(minilm_dir())"`).
- infinity: a venv with `pip install torch==2.13.0 'infinity-emb[server,optimum]==0.0.78'`, then
  `python benchmarks/infinity_peer.py --layers 6 --venv VENV` prints the optimum folder (L6-onnx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import DEFAULT_DATA, checkout_env
from serve_peers import peer_arguments, start_infinity_optimum, start_llama, start_ours_fixed
from serving_harness import (
    ARGS,
    Pool,
    Server,
    closed_loop,
    machine_arguments,
    open_loop,
    set_up_machine,
    stop_everything,
    timed_span,
)


# ---- ours, offline: the same graph without the server ----------------------------------------------------------
def offline_probe() -> None:
    """(In the child process, on the server core, one thread.) The served graph (--ours-precision) of the model's
    full depth through OnnxBackend: ms per text in calls of 64 (the best of --offline-rounds rounds over the same
    queries) and the p50 of one query per call; one JSON line on stdout."""
    import torch

    from matryoshka2d.beir import load_beir
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.serve.backends import OnnxBackend

    torch.set_num_threads(1)
    queries = load_beir(ARGS.data, ARGS.split).query_texts
    encoder = ElasticEncoder(ARGS.model, device="cpu")
    full = encoder.num_layers
    quantize = None if ARGS.ours_precision == "fp32" else ARGS.ours_precision
    backend = OnnxBackend(encoder, quantize, [full], threads=1, log=lambda _message: None)
    backend.load()
    texts = queries[: 64 * ARGS.offline_calls]
    best = float("inf")
    for _ in range(ARGS.offline_rounds):
        start = time.perf_counter()
        for i in range(0, len(texts), 64):
            backend.pooled(texts[i : i + 64], full)
        best = min(best, (time.perf_counter() - start) * 1000 / len(texts))
    single = []
    for text in queries[: ARGS.round_trips]:
        start = time.perf_counter()
        backend.pooled([text], full)
        single.append((time.perf_counter() - start) * 1000)
    print(json.dumps({"ms_per_text_in_64": best, "one_query_p50_ms": float(np.median(single)), "layer": full}))


def offline_limit() -> dict:
    command = ["taskset", "-c", str(ARGS.server_core), sys.executable, __file__, "--offline-probe"]
    command += ["--model", ARGS.model, "--data", str(ARGS.data), "--split", ARGS.split]
    command += ["--offline-calls", str(ARGS.offline_calls), "--offline-rounds", str(ARGS.offline_rounds)]
    command += ["--round-trips", str(ARGS.round_trips), "--ours-precision", ARGS.ours_precision]
    with timed_span():
        done = subprocess.run(command, env=checkout_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the offline probe failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["limit_per_s"] = 1000 / result["ms_per_text_in_64"]
    return result


# ---- one server ------------------------------------------------------------------------------------------------
PHASES: dict[str, list[float]] = {}  # our server's x-matryoshka2d-phases of the last round_trip, ms by phase


def round_trip(server: Server, queries: list[str], count: int) -> list[float]:
    """`count` requests one after another on one keep-alive connection: each round trip in ms (and, from our
    server, each request's phases as it timed them, in PHASES)."""
    PHASES.clear()

    async def run():
        pool, loop, out = Pool(server.port), asyncio.get_running_loop(), []
        for i in range(count):
            start = loop.time()
            status, headers, _ = await pool.send(server.body(queries[i % len(queries)], None))
            if status != 200:
                raise RuntimeError(f"{server.kind}: {status} to a single request")
            out.append((loop.time() - start) * 1000)
            for part in filter(None, headers.get("x-matryoshka2d-phases", "").split(",")):
                phase, _, ms = part.partition("=")
                PHASES.setdefault(phase, []).append(float(ms))
        for _, writer in pool.idle:
            writer.close()
        return out

    return asyncio.run(run())


def wait_quiet(server: Server, queries: list[str]) -> None:
    """Let a server answer what it still holds from a span: single requests until one comes back within a quarter
    of the SLO (a peer has no queue length to ask), at most a minute."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if round_trip(server, queries, 1)[0] <= ARGS.slo_ms / 4:
            break
        time.sleep(0.5)
    time.sleep(ARGS.settle)


def span(server: Server, rate: float, queries: list[str], seed: int, seconds: float | None = None) -> dict:
    """One open-loop span at `rate`: its latencies and errors, and whether it keeps the SLO."""
    seconds = seconds or ARGS.span
    ARGS.seconds = seconds
    wait_quiet(server, queries)
    with timed_span():
        run = asyncio.run(open_loop(server, rate, seconds, None, queries, seed))
    status = [r[1] for r in run["records"]]
    latencies = np.array([r[2] for r in run["records"] if r[1] == 200]) * 1000
    p99 = float(np.percentile(latencies, 99)) if len(latencies) else None
    errors = len(status) - status.count(200)
    row = {
        "rate_per_s": rate,
        "sent": len(status),
        "answered": status.count(200),
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else None,
        "p99_ms": p99,
        "timeouts": status.count("timeout"),
        "errors": errors,  # every answer but a 200 (a timeout among them)
        "statuses": {str(s): status.count(s) for s in sorted(set(status), key=str) if s != 200},
        "goodput_slo_per_s": int(np.sum(latencies <= ARGS.slo_ms)) / seconds,
        "goodput_deadline_per_s": int(np.sum(latencies <= ARGS.timeout * 1000)) / seconds,
        "client_lag_p99_ms": run["lag_p99_ms"],
        "keeps_slo": errors == 0 and p99 is not None and p99 <= ARGS.slo_ms,
    }
    p50, p99s = (f"{row[k]:.1f}" if row[k] is not None else "-" for k in ("p50_ms", "p99_ms"))
    print(
        f"  {server.kind} at {rate:.1f}/s: p50 {p50} ms, p99 {p99s} ms, errors {errors}{kinds(row)}, "
        f"client lag p99 {row['client_lag_p99_ms']:.1f} ms -> {'keeps' if row['keeps_slo'] else 'misses'} the SLO",
        flush=True,
    )
    return row


def kinds(row: dict) -> str:
    """The span's errors by kind, after their count ('' when none)."""
    return f" {row['statuses']}" if row["statuses"] else ""


def capacity_at_slo(server: Server, queries: list[str], guess: float) -> tuple[float | None, list[dict]]:
    """The highest rate that keeps the SLO, to --precision: step from the guess until a pass and a fail bracket it,
    then bisect (geometrically) between them."""
    spans: list[dict] = []
    passes, fails = [], []
    passed = None
    rate = guess * ARGS.start_fraction
    while len(spans) < ARGS.max_spans:
        row = span(server, rate, queries, seed=len(spans))
        spans.append(row)
        (passes if row["keeps_slo"] else fails).append(rate)
        # On a noisy machine a rate can pass above one that failed: only a pass below every fail counts, so the
        # answer is a rate that kept the SLO with no lower rate seen to miss it
        failed = min(fails, default=None)
        passed = max((p for p in passes if failed is None or p < failed), default=None)
        if passed is not None and failed is not None:
            if failed / passed - 1 <= ARGS.precision:
                break
            rate = (passed * failed) ** 0.5
        elif passed is None:
            rate /= ARGS.step
        else:
            rate *= ARGS.step
    return passed, spans


def measure(server: Server, queries: list[str], name: str) -> dict:
    wait_quiet(server, queries)
    with timed_span():
        trips = round_trip(server, queries, ARGS.round_trips)
    print(f"{name}: one client's round trip p50 {np.median(trips):.2f} ms ({ARGS.round_trips} requests)", flush=True)
    phases = {phase: float(np.median(ms)) for phase, ms in PHASES.items()}
    if phases:  # where the server's own time went (medians); the rest is HTTP outside the app, loopback, client
        shown = ", ".join(f"{phase} {ms:.2f}" for phase, ms in phases.items())
        total = sum(phases.values())
        print(f"{name}: the server's phases, ms (p50 of each): {shown}; their sum {total:.2f}", flush=True)
    wait_quiet(server, queries)
    with timed_span():
        closed = asyncio.run(closed_loop(server, ARGS.closed_clients, ARGS.closed_seconds, None, queries))
    print(f"{name}: closed-loop capacity {closed:.1f}/s ({ARGS.closed_clients} clients)", flush=True)
    capacity, spans = capacity_at_slo(server, queries, closed)
    result = {
        "server": name,
        "round_trip_p50_ms": float(np.median(trips)),
        "phases_p50_ms": phases,
        "closed_loop_per_s": closed,
        "capacity_at_slo_per_s": capacity,
        "spans": spans,
    }
    if capacity:
        overload = span(server, ARGS.overload * capacity, queries, seed=100, seconds=ARGS.overload_span or ARGS.span)
        result["overload"] = overload
    # with every span passing, the search ran out of spans going up: the rate found is only a lower bound
    result["lower_bound_only"] = all(row["keeps_slo"] for row in spans)
    bound = " (a lower bound: no span failed within --max-spans)" if result["lower_bound_only"] else ""
    print(f"{name}: capacity at p99 <= {ARGS.slo_ms:g} ms: {capacity or 0:.1f}/s{bound}", flush=True)
    return result


def llama_sweep(queries: list[str]) -> tuple[int, int, list[dict]]:
    """The closed-loop capacity of llama-server at each --llama-sweep PARALLEL:BATCH; the best setting."""
    rows = []
    for setting in ARGS.llama_sweep:
        parallel, batch = (int(x) for x in setting.split(":"))
        server = start_llama(ARGS.llama_server, ARGS.llama_model, parallel, batch, batch)
        try:
            wait_quiet(server, queries)
            with timed_span():
                rate = asyncio.run(closed_loop(server, ARGS.closed_clients, ARGS.closed_seconds, None, queries))
        finally:
            server.stop()
        rows.append({"parallel": parallel, "batch": batch, "closed_loop_per_s": rate})
        print(f"llama-server --parallel {parallel} --batch-size/--ubatch-size {batch}: {rate:.1f}/s", flush=True)
    best = max(rows, key=lambda r: r["closed_loop_per_s"])
    return best["parallel"], best["batch"], rows


# ---- the run ---------------------------------------------------------------------------------------------------
def report(results: list[dict], offline: dict | None) -> dict:
    print(f"\ncapacity at an SLO: the highest Poisson rate with p99 <= {ARGS.slo_ms:g} ms and no error (deadline")
    print(f"{ARGS.timeout:g} s), one query per request, {ARGS.span:g} s spans, precision {ARGS.precision:.0%}\n")
    print(
        f"| server | one client, p50 ms | closed loop/s | capacity at SLO/s | at {ARGS.overload:g}x: goodput "
        "within SLO/s | within deadline/s | p99 ms | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    if offline:
        print(
            f"| offline, the same {ARGS.ours_precision} graph (OnnxBackend) | {offline['one_query_p50_ms']:.2f} | - | "
            f"{offline['limit_per_s']:.1f} ({offline['ms_per_text_in_64']:.2f} ms a text in calls of 64) "
            "| - | - | - | - |"
        )
    for r in results:
        o = r.get("overload") or {}
        cap = f"{r['capacity_at_slo_per_s']:.1f}" if r["capacity_at_slo_per_s"] else "none kept"
        over = (
            f"{o['goodput_slo_per_s']:.1f} | {o['goodput_deadline_per_s']:.1f} | "
            f"{o['p99_ms']:.0f} | {o['errors']}{kinds(o)}"
            if o and o.get("p99_ms") is not None
            else "- | - | - | -"
        )
        print(f"| {r['label']} | {r['round_trip_p50_ms']:.2f} | {r['closed_loop_per_s']:.1f} | {cap} | {over} |")
    by = {r["server"]: r for r in results}
    ratios = {}
    ours = (by.get("ours") or {}).get("capacity_at_slo_per_s")
    print()
    for peer in ("llama", "infinity"):
        theirs = (by.get(peer) or {}).get("capacity_at_slo_per_s")
        if ours and theirs:
            ratios[f"ours_over_{peer}"] = ours / theirs
            print(f"capacity at the SLO, ours / {by[peer]['label']}: {ours / theirs:.2f}x")
    if ours and offline:
        ratios["ours_over_offline_limit"] = ours / offline["limit_per_s"]
        closed = by["ours"]["closed_loop_per_s"]
        ratios["ours_closed_loop_over_offline_limit"] = closed / offline["limit_per_s"]
        print(f"ours at the SLO / the offline limit of the same graph: {ours / offline['limit_per_s']:.0%}")
        print(f"ours in a closed loop / the offline limit: {closed / offline['limit_per_s']:.0%}")
        stack = by["ours"]["round_trip_p50_ms"] - offline["one_query_p50_ms"]
        ratios["stack_ms"] = stack
        print(
            f"the stack: one client's round trip {by['ours']['round_trip_p50_ms']:.2f} ms against offline one query "
            f"{offline['one_query_p50_ms']:.2f} ms: {stack:+.2f} ms"
        )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6", help="our model (short name or folder), served at full depth")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA / "retrieval" / "scifact")
    parser.add_argument("--split", default="train")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="the p99 objective")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds from a request's arrival to its deadline")
    parser.add_argument("--span", type=float, default=12.0, help="seconds of each open-loop span")
    parser.add_argument("--precision", type=float, default=0.05, help="bisect until fail / pass - 1 is at most this")
    parser.add_argument("--max-spans", type=int, default=10, help="open-loop spans per server at most")
    parser.add_argument(
        "--start-fraction", type=float, default=0.9, help="the first span's rate, a share of the closed-loop capacity"
    )
    parser.add_argument("--step", type=float, default=1.25, help="factor between rates until a pass and a fail")
    parser.add_argument("--overload", type=float, default=2.0, help="goodput at this multiple of the capacity")
    parser.add_argument("--overload-span", type=float, help="seconds of the overload span (default: --span)")
    parser.add_argument("--closed-clients", type=int, default=64)
    parser.add_argument("--closed-seconds", type=float, default=8.0)
    parser.add_argument("--round-trips", type=int, default=300, help="one client's sequential requests")
    parser.add_argument("--offline-calls", type=int, default=8, help="calls of 64 queries per offline round")
    parser.add_argument("--offline-rounds", type=int, default=3)
    parser.add_argument("--no-offline", action="store_true", help="skip the offline limit of our graph")
    parser.add_argument("--servers", nargs="+", default=["ours", "llama", "infinity"])
    parser.add_argument(
        "--ours-args", default="", help="more options for our serve, one string (e.g. '--max-queued-texts 256')"
    )
    parser.add_argument(
        "--ours-precision",
        choices=["int8", "fp32"],
        default="int8",
        help="the graph ours serves (and the offline probe runs): int8 (serve --quantize int8) or fp32; fp32 compares "
        "two versions of the server on a graph that did not change between them",
    )
    parser.add_argument(
        "--ours-src",
        help="the source tree (its src/ folder) whose serve runs as ours, e.g. a git worktree of an older commit: a "
        "change measured in turns against the code before it (default: this checkout's; use with --no-offline, the "
        "offline probe runs this checkout's graph)",
    )
    peer_arguments(parser)
    parser.add_argument(
        "--llama-sweep",
        nargs="*",
        default=[],
        metavar="PARALLEL:BATCH",
        help="closed-loop capacity of llama-server at each setting first; the best is measured (else --llama-*)",
    )
    machine_arguments(parser, settle=1.0, logs="serve-capacity")
    parser.add_argument("--results", help="write the results as JSON here")
    parser.add_argument("--offline-probe", action="store_true", help=argparse.SUPPRESS)
    parser.parse_args(namespace=ARGS)
    if ARGS.offline_probe:
        offline_probe()
        return
    set_up_machine()
    from matryoshka2d.beir import load_beir
    from matryoshka2d.models.backbones import resolve

    queries = load_beir(ARGS.data, ARGS.split).query_texts
    folder = Path(resolve(ARGS.model)[0])
    ARGS.layers = int(json.loads((folder / "config.json").read_text())["num_hidden_layers"])
    print(f"{len(queries)} SciFact queries ({ARGS.split}); {ARGS.model}: {ARGS.layers} layers, served at full depth")

    offline = None
    if "ours" in ARGS.servers and not ARGS.no_offline:
        offline = offline_limit()
        print(
            f"offline, the same {ARGS.ours_precision} graph on the server core, one thread: "
            f"{offline['ms_per_text_in_64']:.2f} ms a "
            f"text in calls of 64 (limit {offline['limit_per_s']:.1f}/s), one query {offline['one_query_p50_ms']:.2f} "
            "ms (p50)",
            flush=True,
        )
    results, sweep = [], []
    for name in ARGS.servers:
        if name == "llama" and not (ARGS.llama_server and ARGS.llama_model):
            print("llama-server skipped: --llama-server and --llama-model not given")
            continue
        if name == "infinity" and not (ARGS.infinity_venv and ARGS.infinity_folder):
            print("infinity skipped: --infinity-venv and --infinity-folder not given")
            continue
        if name == "ours":
            quantize = None if ARGS.ours_precision == "fp32" else ARGS.ours_precision
            server = start_ours_fixed(ARGS.model, ARGS.layers, ARGS.ours_args.split(), ARGS.ours_src, quantize)
            flag = f" --quantize {quantize}" if quantize else ""
            label = f"ours: serve --backend onnx{flag} --layers {ARGS.layers}"
            if ARGS.ours_src:
                label += f" (the code in {ARGS.ours_src})"
        elif name == "llama":
            if ARGS.llama_sweep:
                ARGS.llama_parallel, ARGS.llama_batch, sweep = llama_sweep(queries)
            b = ARGS.llama_batch
            server = start_llama(ARGS.llama_server, ARGS.llama_model, ARGS.llama_parallel, b, b)
            label = f"llama-server {Path(ARGS.llama_model).name}, --parallel {ARGS.llama_parallel} -b/-ub {b} -t 1"
        else:
            server = start_infinity_optimum(ARGS.infinity_venv, ARGS.infinity_folder)
            label = "infinity-emb --engine optimum (int8 ONNX)"
        try:
            results.append({**measure(server, queries, name), "label": label})
        finally:
            server.stop()
        if ARGS.results:
            Path(ARGS.results).write_text(json.dumps({"offline": offline, "servers": results}, indent=1))
    ratios = report(results, offline)
    if ARGS.results:
        out = {"args": {k: str(v) for k, v in vars(ARGS).items()}, "offline": offline, "servers": results}
        Path(ARGS.results).write_text(json.dumps({**out, "llama_sweep": sweep, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    try:
        main()
    finally:
        stop_everything()
