"""Open-loop overload, side by side: fixed full depth, a fixed shallow cell, the ladder of adaptive depth, and the
peers a user would run instead (llama.cpp's llama-server, infinity-emb's optimum engine).

    python benchmarks/serve_overload.py --model DIR [--query-model NAME=FOLDER ...] [--rates 0.5 1 1.5 2 3]
        [--seconds 60] [--target-ms 50] [--min-layer 2] [--shallow-layer 3] [--modes full shallow adaptive llama
        infinity] [--llama-server BIN --llama-model GGUF] [--infinity-venv DIR --infinity-folder DIR] [--timeout 2]
        [--server-core 0] [--client-core 1] [--pause python|PATTERN] [--logs DIR] [--results FILE.json]
        [--plot FILE.png]

Arrivals are a Poisson process at a fixed rate, each arrival one request of one SciFact query (how a query
reaches a search service), sent whether or not earlier ones were answered: an open loop. A closed loop of N
clients slows down with the server and never shows overload; here the offered rate is what it says, and a
request's latency counts from its scheduled arrival, so a client that falls behind counts against the server, not
for it (the client's own lag is printed). Each rate is a multiple of the full-depth capacity measured in the same
run (a closed loop of --capacity-clients at full depth for --capacity-seconds: requests per second). Before the
rates, a table of what the ladder can give: each rung's closed-loop capacity (--layer-seconds each), the share of
flat nDCG@10 kept when every query is encoded at that rung, and the server's own quality measure of it.

Our server is one `matryoshka2d serve --backend onnx --quantize int8 --adaptive-depth` process on --server-core
with one thread, the documents' model (--model) beside the query encoders distilled from it (--query-model); the
modes differ only in the request: `layer: N` (full), `layer: --shallow-layer` (shallow), no layer (adaptive: the
server's ladder chooses the rung per request). The peers serve the model's full depth on the same core with one
thread, each started afresh for each rate (they have no bound, so a rate would otherwise inherit the backlog of the
one before; ours reports its queue and is let empty it); how to make them: benchmarks/serve_capacity.py. The
client is this process on --client-core. Every request has a deadline (--timeout s from its scheduled arrival);
past it the request counts as a timeout. Goodput: answers (200) within the deadline per second.

After the rates, at each load: the nDCG share the ladder's answers kept beside the most any mix of the rungs could
keep at that load (the linear program over the rung table, `depth_bound`).

Quality of what was answered: the documents are the model's full-depth vectors of the SciFact corpus (made by the
same server, input_type "document"); every answered query vector is searched flat against them and its nDCG@10
set against the full-depth query vector's nDCG@10 for the same query: the share of flat full-depth quality the
answers kept. Server memory (RSS) is sampled through each span. At the end, a drain check: SIGTERM in the middle
of a span at 1.5x, how long the server takes to exit, its exit code, and whether any accepted request went
unanswered.

--pause stops nothing unless given: `--pause python` (every other Python process on the machine, training runs and
test suites among them) or a pkill -f pattern SIGSTOPs those processes for each timed span only and SIGCONTs them
after, also on errors and interrupts; what it stopped is printed. The servers' logs and the documents' vectors go to
--logs (default: runs/serve-overload in the checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import orjson

from common import DEFAULT_DATA, checkout_env, free_port
from serve_peers import peer_arguments, start_infinity_optimum, start_llama
from serving_harness import (
    ARGS,
    PAUSE,
    Pool,
    Server,
    closed_loop,
    machine_arguments,
    open_loop,
    request_bytes,
    set_up_machine,
    stop_everything,
    timed_span,
)


# ---- our server and the peers --------------------------------------------------------------------------------
def start_ours() -> Server:
    env = checkout_env()
    port = free_port()
    command = [sys.executable, "-m", "matryoshka2d.cli", "serve", "--model", ARGS.model, "--served-name", "bench"]
    command += ["--port", str(port), "--device", "cpu", "--log-level", "warning", "--backend", "onnx"]
    command += ["--quantize", "int8", "--truncate", "--adaptive-depth", "--target-ms", str(ARGS.target_ms)]
    command += ["--max-queued-texts", str(ARGS.max_queued_texts)]
    command += ["--max-queue-ms", str(ARGS.max_queue_ms)] if ARGS.max_queue_ms else []
    command += ["--min-layer", str(ARGS.min_layer)] if ARGS.min_layer else []
    command += ["--max-length", str(ARGS.max_length)] if ARGS.max_length else []
    command += ["--max-wait-ms", str(ARGS.max_wait_ms)] if ARGS.max_wait_ms is not None else []
    command += ["--max-batch", str(ARGS.max_batch)] if ARGS.max_batch is not None else []
    command += ["--layers", ARGS.serve_layers] if ARGS.serve_layers else []
    for query_model in ARGS.query_model or []:
        command += ["--query-model", query_model]
    command += ["--calibration-texts", *ARGS.calibration_texts] if ARGS.calibration_texts else []
    return Server("ours", command, port, env)


def start_peer(mode: str) -> Server:
    """A peer at the model's full depth, one core, one thread: llama.cpp's llama-server on the model as GGUF, or
    infinity-emb's optimum engine on its int8 ONNX folder (benchmarks/serve_peers.py; how to make each:
    benchmarks/serve_capacity.py's docstring)."""
    if mode == "llama":
        if not (ARGS.llama_server and ARGS.llama_model):
            raise SystemExit("--modes llama needs --llama-server and --llama-model")
        return start_llama(ARGS.llama_server, ARGS.llama_model, ARGS.llama_parallel, ARGS.llama_batch, ARGS.llama_batch)
    if not (ARGS.infinity_venv and ARGS.infinity_folder):
        raise SystemExit("--modes infinity needs --infinity-venv and --infinity-folder")
    return start_infinity_optimum(ARGS.infinity_venv, ARGS.infinity_folder)


def encode_all(server: Server, texts: list[str], layer: int | None, input_type: str | None = None) -> np.ndarray:
    """Vectors of `texts` from the server, one request per 32 texts, 4 at a time (a 429 retried after Retry-After)."""

    async def run():
        pool, out = Pool(server.port), [None] * len(texts)

        async def chunk(start: int):
            part = texts[start : start + 32]
            body = {"model": "bench", "input": part, "encoding_format": "base64", "layer": layer}
            if isinstance(layer, str):  # a rung by name, ENCODER@LAYER
                encoder, _, number = layer.rpartition("@")
                body["model"], body["layer"] = encoder, int(number) if encoder == "bench" else None
                if encoder != "bench":
                    del body["layer"]
            if input_type is not None:
                body = {k: v for k, v in body.items() if k != "layer"} | {"input_type": input_type}
            status, headers, raw = await pool.send(request_bytes("/v1/embeddings", body))
            for _ in range(10):  # a busy machine can put the server past its bound: it says when to retry
                if status != 429:
                    break
                await asyncio.sleep(float(headers.get("retry-after", 1)))
                status, headers, raw = await pool.send(request_bytes("/v1/embeddings", body))
            if status != 200:
                raise RuntimeError(f"encoding failed: {status} {raw[:300]!r}")
            for j, item in enumerate(orjson.loads(raw)["data"]):
                out[start + j] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")

        starts = list(range(0, len(texts), 32))
        for k in range(0, len(starts), 4):
            await asyncio.gather(*(chunk(s) for s in starts[k : k + 4]))
        return np.stack(out)

    return asyncio.run(run())


def document_vectors(server: Server, texts: list[str]) -> np.ndarray:
    """The corpus at full depth from the server (input_type "document"), unit rows; kept in the logs folder under a
    key of the model's weight files and the length, so that a second run of the same model reads them back."""
    import hashlib

    files = sorted(Path(ARGS.model).glob("*.safetensors"))
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files] + [ARGS.max_length, len(texts)]
    key = hashlib.sha256(json.dumps([str(Path(ARGS.model).resolve()), stamp]).encode()).hexdigest()[:16]
    cached = Path(ARGS.logs) / f"documents-{key}.npy"
    if cached.is_file():
        return np.load(cached)
    docs = encode_all(server, texts, None, "document")
    docs = docs / np.linalg.norm(docs, axis=1, keepdims=True)
    np.save(cached, docs)
    return docs


# ---- scoring ---------------------------------------------------------------------------------------------------
def ndcg_of(vectors: np.ndarray, qids: list[int], docs: np.ndarray, qrels) -> np.ndarray:
    """nDCG@10 of each row (the query qids[i]) searched flat against the documents."""
    from matryoshka2d.evaluate.retrieval import search

    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    ranked = search(unit.astype(np.float32), docs, 10)
    discount = 1.0 / np.log2(np.arange(2, 12))
    out = np.empty(len(qids))
    for i, (row, q) in enumerate(zip(ranked, qids, strict=True)):
        rel = qrels[q]
        gains = np.array([rel.get(int(d), 0) for d in row], dtype=np.float64)
        ideal = np.sort(np.fromiter(rel.values(), dtype=np.float64))[::-1][:10]
        out[i] = float(gains @ discount[: len(gains)]) / float(ideal @ discount[: len(ideal)])
    return out


def summarize(mode: str, multiple: float, rate: float, run: dict, docs, qrels, flat: np.ndarray) -> dict:
    records = run["records"]
    ok = [r for r in records if r[1] == 200]
    latencies = np.array([r[2] for r in ok]) * 1000
    within = int(np.sum(latencies <= ARGS.timeout * 1000))
    layers = [r[3] for r in ok]
    share = {str(n): layers.count(n) / len(layers) for n in sorted(set(layers))} if layers else {}
    quality = None
    if ok:
        vectors = np.stack([r[4] for r in ok])
        qids = [r[0] for r in ok]
        got = ndcg_of(vectors, qids, docs, qrels)
        quality = 100 * float(got.mean() / flat[qids].mean())
    status = [r[1] for r in records]
    return {
        "mode": mode,
        "load": multiple,
        "offered_per_s": rate,
        "sent": len(records),
        "answered": len(ok),
        "goodput_per_s": within / ARGS.seconds,
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else None,
        "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else None,
        "429": status.count(429),
        "timeouts": status.count("timeout"),
        "other_errors": len(records) - len(ok) - status.count(429) - status.count("timeout"),
        "layer_share": share,
        "ndcg_share_of_flat": quality,
        "client_lag_p99_ms": run["lag_p99_ms"],
        # what our server counted, by status: 200 answered, 429 refused over the bound, 499 accepted but its client
        # left before the answer (its texts were not run); a request the client gave up on before the server read
        # it is in none of these
        "server_statuses": run.get("server", {}),
        "rss_mb": [round(rss[0], 1), round(max(rss), 1), round(rss[-1], 1)]
        if (rss := [r for r in run["rss"] if r == r])
        else None,
    }


def rungs_of(server: Server) -> list[dict]:
    """The ladder our server runs (/v1/models: encoder, layer, its own quality measure); without --adaptive-depth,
    every layer of the model."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models/bench", timeout=10) as reply:
        described = json.loads(reply.read())
    ladder = described.get("adaptive_depth")
    if ladder:
        return [{"encoder": r["encoder"], "layer": r["layer"], "quality": r["quality"]} for r in ladder["rungs"]]
    return [{"encoder": "bench", "layer": n, "quality": None} for n in described["layers"]]


def depth_lever(server: Server, queries: list[str], docs, qrels, flat: np.ndarray, capacity: float) -> list[dict]:
    """What each rung of the ladder gives adaptive depth to work with: its closed-loop capacity (as the full depth's
    is measured), the share of flat full-depth nDCG@10 that all queries keep when encoded at it, and the server's own
    quality measure of it (mean cosine to the full depth on its calibration texts), to see how the one tracks the
    other."""
    rows = []
    qids = list(range(len(queries)))
    for rung in rungs_of(server):
        name = f"{rung['encoder']}@{rung['layer']}"
        quality = 100 * float(ndcg_of(encode_all(server, queries, name), qids, docs, qrels).mean() / flat.mean())
        wait_idle(server)
        with timed_span():
            rate = asyncio.run(closed_loop(server, ARGS.capacity_clients, ARGS.layer_seconds, name, queries))
        rows.append(
            {
                "rung": name,
                "layer": rung["layer"],
                "capacity_per_s": rate,
                "of_full": rate / capacity,
                "ndcg_share_of_flat": quality,
                "server_quality": rung["quality"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def wait_idle(server: Server) -> None:
    if server.kind == "ours":
        deadline = time.monotonic() + 60
        while server.queued() and time.monotonic() < deadline:
            time.sleep(0.2)
    time.sleep(ARGS.settle)


def drain_check(capacity: float, queries: list[str]) -> dict:
    """SIGTERM to a fresh server in the middle of an open-loop span at 1.5x: exit code, seconds to exit, and
    whether any request the server accepted went unanswered (a timeout, or an error other than 503)."""
    server = start_ours()
    wait_idle(server)

    async def run():
        loop = asyncio.get_running_loop()
        span = asyncio.create_task(open_loop(server, 1.5 * capacity, ARGS.drain_span, None, queries, 7))
        await asyncio.sleep(ARGS.drain_span / 2)
        sent = loop.time()
        server.process.send_signal(signal.SIGTERM)
        code = await loop.run_in_executor(None, server.process.wait, 60)
        took = loop.time() - sent
        return await span, code, took

    with timed_span():
        run_, code, took = asyncio.run(run())
    server.stop()
    status = [r[1] for r in run_["records"]]
    refused = sum(isinstance(s, str) and s.startswith("refused") for s in status)
    return {
        "exit_code": code,
        "seconds_to_exit": round(took, 2),
        "answered_200": status.count(200),
        "answered_503": status.count(503),
        "not_accepted_connection_closed": refused,
        "timeouts": status.count("timeout"),
        "other": len(status) - status.count(200) - status.count(503) - refused - status.count("timeout"),
    }


# ---- the run ---------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        required=True,
        help="the documents' model: one whose exits are aligned (distill --mode shared), or any with --query-model",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA / "retrieval" / "scifact")
    parser.add_argument("--split", default="train", help="qrels split (the shared SciFact has train: 809 queries)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--modes", nargs="+", default=["full", "adaptive"], help="full shallow adaptive llama infinity (any of them)"
    )
    parser.add_argument("--shallow-layer", type=int, default=3)
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument("--min-layer", type=int)
    parser.add_argument(
        "--query-model",
        action="append",
        metavar="NAME=FOLDER",
        help="a query encoder distilled from --model, served beside it: a rung of the ladder (repeat for more)",
    )
    parser.add_argument("--calibration-texts", nargs="+", help="our server's --calibration-texts")
    parser.add_argument("--serve-layers", help="our server's --layers (e.g. 6: the full depth's graph only)")
    parser.add_argument("--max-length", type=int, help="tokens per text for the server (default: the model's)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds from a request's arrival to its deadline")
    parser.add_argument(
        "--max-queued-texts",
        type=int,
        default=256,
        help="our server's bound on waiting texts: what it answers within the deadline at full depth, about",
    )
    parser.add_argument(
        "--max-queue-ms",
        type=float,
        default=1000.0,
        help="our server's bound in model time (serve --max-queue-ms; 0: none): half the deadline, the rest for the "
        "event loop and the batch that runs",
    )
    parser.add_argument(
        "--capacity",
        type=float,
        help="full depth's capacity in requests/s, not measured: the rates are multiples of it (to compare server "
        "options at the same rates across runs)",
    )
    parser.add_argument("--max-wait-ms", type=float, help="our server's --max-wait-ms (default: the server's own)")
    parser.add_argument("--max-batch", type=int, help="our server's --max-batch (default: the server's own)")
    parser.add_argument("--capacity-clients", type=int, default=64)
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument(
        "--layer-seconds", type=float, default=10.0, help="closed-loop seconds per layer, the depth table (0: none)"
    )
    parser.add_argument("--drain-span", type=float, default=8.0, help="seconds of the drain check's span (0: none)")
    machine_arguments(parser, settle=2.0, logs="serve-overload")
    peer_arguments(parser)
    parser.add_argument("--results", help="write every row as JSON here")
    parser.add_argument("--plot", help="latency against offered load, a line per mode, as PNG")
    parser.add_argument("--report", help="print the table (and --plot) of an earlier run's --results file, run nothing")
    parser.parse_args(namespace=ARGS)
    if ARGS.report:
        earlier = json.loads(Path(ARGS.report).read_text())
        report(earlier["capacity"], earlier["rows"], earlier.get("drain"), earlier.get("depth", []))
        if ARGS.plot:
            plot(earlier["rows"], ARGS.plot)
        return
    set_up_machine()

    from matryoshka2d.beir import load_beir

    data = load_beir(ARGS.data, ARGS.split)
    queries = data.query_texts
    with PAUSE.span():  # the server measures its layers' costs as it starts: on a quiet machine too
        ours = start_ours()
    config = json.loads(Path(ARGS.model, "config.json").read_text())
    ARGS.layers = int(config["num_hidden_layers"])
    started = time.monotonic()
    docs = document_vectors(ours, data.doc_texts)
    full_queries = encode_all(ours, queries, ARGS.layers)
    flat = ndcg_of(full_queries, list(range(len(queries))), docs, data.qrels)
    print(
        f"{len(data.doc_texts)} documents and {len(queries)} queries encoded at full depth in "
        f"{time.monotonic() - started:.0f} s; flat nDCG@10 at full depth {100 * flat.mean():.2f}"
    )
    if ARGS.capacity:
        capacity = ARGS.capacity
        print(f"full-depth capacity: {capacity:.1f} requests/s (given: --capacity, not measured)", flush=True)
    else:
        with timed_span():
            capacity = asyncio.run(
                closed_loop(ours, ARGS.capacity_clients, ARGS.capacity_seconds, ARGS.layers, queries)
            )
        print(
            f"full-depth capacity: {capacity:.1f} requests/s ({ARGS.capacity_clients} closed-loop clients)", flush=True
        )
    depth = depth_lever(ours, queries, docs, data.qrels, flat, capacity) if ARGS.layer_seconds > 0 else []
    layer_of = {"full": ARGS.layers, "shallow": ARGS.shallow_layer, "adaptive": None, "infinity": None, "llama": None}
    rows = []
    for mode in ARGS.modes:
        for multiple in ARGS.rates:
            # the peers have no bound and no way to say what waits: a fresh server per rate, so that no rate
            # inherits the backlog of the one before (ours reports its queue, and wait_idle empties it)
            server = start_peer(mode) if mode in ("infinity", "llama") else ours
            rate = multiple * capacity
            wait_idle(server)
            before = server.statuses()
            with timed_span():
                run = asyncio.run(
                    open_loop(server, rate, ARGS.seconds, layer_of[mode], queries, seed=int(10 * multiple))
                )
            wait_idle(server)  # what the server still held is answered (or found gone) before it is counted
            after = server.statuses()
            run["server"] = {k: int(after[k] - before.get(k, 0)) for k in after if after[k] > before.get(k, 0)}
            rows.append(summarize(mode, multiple, rate, run, docs, data.qrels, flat))
            print(json.dumps(rows[-1]), flush=True)
            if ARGS.results:
                partial = {"capacity": capacity, "depth": depth, "rows": rows}
                Path(ARGS.results).write_text(json.dumps(partial, indent=1))
            if server is not ours:
                server.stop()
    ours.stop()
    drain = drain_check(capacity, queries) if ARGS.drain_span > 0 else None
    report(capacity, rows, drain, depth)
    if ARGS.results:
        results = {"capacity": capacity, "depth": depth, "rows": rows, "drain": drain}
        Path(ARGS.results).write_text(json.dumps(results, indent=1))
    if ARGS.plot:
        plot(rows, ARGS.plot)


def depth_bound(depth: list[dict], load: float) -> float | None:
    """The largest nDCG share any choice of layers could keep at `load` (a multiple of full depth's capacity), from
    the layer table: a share f_n of the requests answered at layer n, each costing 1 / (layer n's capacity) of the
    core, with the core's time for `load` x full depth's capacity requests a second at most all of it. A linear
    program (the optimum mixes at most two layers); None when even the fastest layer cannot keep up."""
    from scipy.optimize import linprog

    quality = [d["ndcg_share_of_flat"] for d in depth]
    seconds_per_request = [1 / d["of_full"] for d in depth]  # in units of full depth's at the run's capacity
    solved = linprog(
        c=[-q for q in quality],
        A_ub=[seconds_per_request],
        b_ub=[1 / load],
        A_eq=[[1.0] * len(depth)],
        b_eq=[1.0],
        bounds=[(0, 1)] * len(depth),
    )
    return -solved.fun if solved.success else None


def report(capacity: float, rows: list[dict], drain: dict | None, depth: list[dict]) -> None:
    print(
        f"\nfull-depth capacity {capacity:.1f} requests/s; deadline {ARGS.timeout:g} s; {ARGS.seconds:g} s per rate\n"
    )
    if depth:
        print(
            "| rung | capacity/s | of full depth's | nDCG share, every query at this rung | the server's measure "
            "(mean cosine to the full depth, calibration texts) |"
        )
        print("|---|---:|---:|---:|---:|")
        for d in depth:
            share, measure = d["ndcg_share_of_flat"], d.get("server_quality")
            measure = f"{measure:.3f}" if measure is not None else "-"
            print(
                f"| {d.get('rung', d['layer'])} | {d['capacity_per_s']:.1f} | {d['of_full']:.2f}x | {share:.1f}% | "
                f"{measure} |"
            )
        print()
    print(
        "| mode | load | offered/s | p50 ms | p99 ms | goodput/s | 429 | timeouts | other | layers | nDCG share "
        "| server: accepted, client gone (499) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        layers = ", ".join(f"{n}: {100 * s:.0f}%" for n, s in r["layer_share"].items())
        p50, p99 = (f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("p50_ms", "p99_ms"))
        quality = f"{r['ndcg_share_of_flat']:.1f}%" if r["ndcg_share_of_flat"] is not None else "-"
        server = r.get("server_statuses") or {}
        accepted = f"{server.get('200', 0) + server.get('499', 0)}, {server.get('499', 0)}" if server else "-"
        print(
            f"| {r['mode']} | {r['load']:g}x | {r['offered_per_s']:.0f} | {p50} | {p99} | {r['goodput_per_s']:.1f} | "
            f"{r['429']} | {r['timeouts']} | {r['other_errors']} | {layers} | {quality} | {accepted} |"
        )
    by = {(r["mode"], r["load"]): r for r in rows}
    print()
    for load in sorted({r["load"] for r in rows}):
        a = by.get(("adaptive", load))
        for peer in ("llama", "infinity"):
            p = by.get((peer, load))
            if a and p and p["goodput_per_s"]:
                print(f"goodput, adaptive / {peer} at {load:g}x: {a['goodput_per_s'] / p['goodput_per_s']:.2f}x")
        f = by.get(("full", load))
        if a and f and f["goodput_per_s"]:
            print(f"goodput, adaptive / fixed full depth at {load:g}x: {a['goodput_per_s'] / f['goodput_per_s']:.2f}x")
    adaptive = [r for r in rows if r["mode"] == "adaptive" and r["ndcg_share_of_flat"] is not None]
    if depth and adaptive:
        print("\nnDCG share, adaptive depth against the most any choice of layers keeps at that load (depth_bound):")
        for r in adaptive:
            bound = depth_bound(depth, r["load"])
            most = f"{bound:.1f}%" if bound is not None else "none keeps up"
            print(f"  {r['load']:g}x: {r['ndcg_share_of_flat']:.1f}% of flat; at most {most}")
    if drain:
        print(f"\ndrain on SIGTERM at 1.5x: {json.dumps(drain)}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        timed = [r for r in mine if r["p99_ms"] is not None]  # a rate at which nothing was answered has no p99
        axes[0].plot([r["load"] for r in timed], [r["p99_ms"] for r in timed], marker="o", label=mode)
        axes[1].plot([r["load"] for r in mine], [r["goodput_per_s"] for r in mine], marker="o", label=mode)
    axes[0].set(xlabel="offered load (x full-depth capacity)", ylabel="p99 latency (ms)", yscale="log")
    axes[1].set(xlabel="offered load (x full-depth capacity)", ylabel="goodput (answers within deadline / s)")
    axes[0].legend()
    fig.suptitle(f"Open-loop overload: {Path(ARGS.model).name}, int8, one core")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    try:
        main()
    finally:
        stop_everything()
