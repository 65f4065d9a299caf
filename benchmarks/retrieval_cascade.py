"""Cascade search against flat full-cell search at scale, measured side by side in one run.

Index: the SciFact corpus plus distinct texts of the shared data as distractors (every `sentence`,
`sentence1/2`, `anchor/positive/negative`, `premise/hypothesis` of the TSV files outside sts/senteval_tok,
which repeats sts/raw lowercased), built with `matryoshka2d index build`'s code (one encoder pass for every
cell, resumable: re-run the same command after a kill). Queries: the SciFact queries with relevance
judgements. For each small cell, a cascade (shortlist from the small cell, rerank with the full cell's stored
vectors) is compared with flat search at the full cell: the share of flat's top 10 the cascade finds, search
time per query (one query per call, best of --repeats passes over all queries), and SciFact nDCG@10 of both.

    OMP_NUM_THREADS=1 python benchmarks/retrieval_cascade.py --model runs/2dmse --small 6:64 6:128 \
        --work runs/bench/cascade [--max-distractors 20000] [--max-length 128]

`--memory` measures instead the cascade that keeps memory small against faiss HNSW on the full cell: tiers
`LAYER:DIM/STORAGE[/flat|/ivf]` (an HNSW graph, M=32, on the small cell's float32, float16 (SQfp16), int8 (SQ8)
or sign-bit vectors, a flat binary index, or inverted lists) shortlist, and the full cell's float16 vectors,
memory-mapped from disk, rerank exactly (`--tier-ef` sets the HNSW tiers' efSearch apart from the shortlist);
against HNSW32 on the full cell (float32) and flat search. The corpus is encoded once, for the layers the cells
need at full width (shards kept: a killed run resumes), and every index is built, then loaded and searched in a
process of its own, which reports its resident memory over its own baseline: anonymous (the index, which must
stay in RAM) and file-backed (the pages of the float16 file the reranks touched: page cache, which the kernel
can drop and read again). For each: build time, the share of flat's top 10 and queries/s (one query per call,
one thread) at each search setting. Then HNSW and each HNSW cascade, at their fastest setting that keeps >= 99% of
flat's top 10, are searched in turns in one process (`--rounds`), for a queries/s ratio that sees one load.

    OMP_NUM_THREADS=1 python benchmarks/retrieval_cascade.py --memory --model minilm-l6 --max-length 128 \
        --tiers 6:128/float32 6:128/int8 6:384/binary 6:384/binary/flat --work runs/cascade-208k
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_DATA, header
from matryoshka2d.beir import load_beir
from matryoshka2d.cells import Cell
from matryoshka2d.cells import unit_rows as unit
from matryoshka2d.evaluate.retrieval import rank_metrics
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.retrieval.cascade import overlap_at
from matryoshka2d.retrieval.faiss_indexes import factory_string, hnsw_graph, make_index, searchable
from matryoshka2d.retrieval.index import build_index
from matryoshka2d.retrieval.search import CellIndex, cascade_search, flat_search, query_vectors
from matryoshka2d.retrieval.shards import STORAGES, cell_name, load_shards, read_manifest

TEXT_COLUMNS = {"sentence", "sentence1", "sentence2", "anchor", "positive", "negative", "premise", "hypothesis"}


def distractors(data: Path, limit: int | None) -> list[str]:
    seen: dict[str, None] = {}
    for path in sorted(data.rglob("*.tsv")):
        if "senteval_tok" in path.parts:
            continue
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            head = [h.strip() for h in next(reader, [])]
            columns = [i for i, h in enumerate(head) if h in TEXT_COLUMNS]
            for row in reader:
                for i in columns:
                    if i < len(row) and row[i].strip():
                        seen.setdefault(row[i].strip())
    texts = list(seen)
    return texts[:limit] if limit is not None else texts


def timed(search_one, n: int, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = np.concatenate([search_one(i) for i in range(n)])
        best = min(best, time.perf_counter() - start)
    return out, 1000 * best / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a 2D-trained model (or minilm-l6 for RAW)")
    parser.add_argument("--full", default="6:384", help="the full cell (6:384)")
    parser.add_argument("--small", nargs="+", default=["6:64", "6:128"], help="small cells to shortlist with")
    parser.add_argument("--shortlist", type=int, default=100)
    parser.add_argument("--max-distractors", type=int, help="at most this many distractor texts (default: all)")
    parser.add_argument("--max-length", type=int, default=256, help="document truncation in tokens (256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, required=True, help="where the corpus file and the index go")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--memory", action="store_true", help="the cascade against HNSW on the full cell (above)")
    parser.add_argument("--tiers", nargs="+", default=["6:128/float32", "6:128/int8", "6:384/binary"])
    parser.add_argument("--ef", nargs="+", type=int, default=[16, 32, 64, 128, 256, 512], help="full-cell HNSW")
    parser.add_argument("--shortlists", nargs="+", type=int, default=[100, 200, 400, 800], help="cascade tiers")
    parser.add_argument("--nprobe", nargs="+", type=int, default=[16, 32, 64], help="IVF tiers: lists visited")
    parser.add_argument(
        "--ef-construction",
        type=int,
        default=40,
        help="efConstruction of every HNSW graph here, the full cell's and the tiers' (faiss's default: 40)",
    )
    parser.add_argument(
        "--tier-ef",
        nargs="+",
        type=int,
        help="HNSW tiers: efSearch values, each with every shortlist up to it (default: efSearch = the shortlist)",
    )
    parser.add_argument("--exact-only", action="store_true", help="--memory: only the exact shortlists table")
    parser.add_argument(
        "--rounds", type=int, default=7, help="HNSW and each cascade at their first >= 99%% setting, searched in turns"
    )
    args = parser.parse_args()
    print(header())
    full = Cell.parse(args.full, "--full")
    smalls = [Cell.parse(s, "--small") for s in args.small]
    scifact = load_beir(args.data_dir / "retrieval" / "scifact", "train")
    extra = distractors(args.data_dir, args.max_distractors)
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.jsonl"
    if not corpus.is_file():
        with corpus.open("w", encoding="utf-8") as f:
            for doc_id, text in zip(scifact.doc_ids, scifact.doc_texts, strict=True):
                f.write(json.dumps({"_id": doc_id, "text": text}) + "\n")
            for i, text in enumerate(extra):
                f.write(json.dumps({"_id": f"distractor-{i}", "text": text}) + "\n")
    encoder = ElasticEncoder(args.model, max_length=args.max_length, device="cpu")
    if args.memory:
        memory_benchmark(args, encoder, scifact, corpus, extra)
        return
    t0 = time.perf_counter()
    build_index(encoder, corpus, [*smalls, full], args.work / "index", shard_size=4096, log=print)
    print(f"index ready in {time.perf_counter() - t0:.0f} s (0 if it was already built)")
    index = CellIndex(args.work / "index")
    n_docs = len(index.ids)
    position = {d: i for i, d in enumerate(index.ids)}
    qrels = [{position[scifact.doc_ids[d]]: r for d, r in rel.items()} for rel in scifact.qrels]
    exclude = np.array([position.get(q, -1) for q in scifact.query_ids])
    t0 = time.perf_counter()
    vectors = query_vectors(encoder, scifact.query_texts, [*smalls, full])
    encode_ms = 1000 * (time.perf_counter() - t0) / len(scifact.query_texts)
    n = len(scifact.query_texts)
    print(
        f"\n{n_docs} documents ({len(scifact.doc_ids)} SciFact + {len(extra)} distractors), {n} queries, "
        f"model {encoder.name}, documents truncated to {args.max_length} tokens; query encoding {encode_ms:.1f} "
        f"ms/query (all cells, one pass)"
    )
    flat_index = index.index(full)
    flat, flat_ms = timed(
        lambda i: flat_search(flat_index, vectors[full][i : i + 1], 10, exclude[i : i + 1])[0], n, args.repeats
    )
    flat_ndcg = rank_metrics(flat, qrels)["ndcg@10"]
    print("| search | top-10 overlap with flat | ms/query | speed-up | SciFact nDCG@10 |")
    print("|---|---:|---:|---:|---:|")
    print(f"| flat ({full[0]},{full[1]}) | 100.0% | {flat_ms:.3f} | 1.00x | {flat_ndcg:.2f} |")
    for small in smalls:
        small_index = index.index(small)
        ranking, ms = timed(
            lambda i, s=small, si=small_index: cascade_search(
                si,
                flat_index,
                vectors[s][i : i + 1],
                vectors[full][i : i + 1],
                args.shortlist,
                10,
                exclude[i : i + 1],
            )[0],
            n,
            args.repeats,
        )
        print(
            f"| cascade ({small[0]},{small[1]}) top {args.shortlist} -> ({full[0]},{full[1]}) | "
            f"{overlap_at(ranking, flat, 10):.1f}% | {ms:.3f} | {flat_ms / ms:.2f}x | "
            f"{rank_metrics(ranking, qrels)['ndcg@10']:.2f} |"
        )


# ---- --memory: the cascade against HNSW on the full cell, each index in a process of its own ----------------

HNSW_M = 32
IVF_LISTS = 1024  # about 4 sqrt(n) at 208k vectors


def memory_status() -> dict[str, float]:
    """This process's resident memory in MiB: all of it, anonymous, and file-backed (mapped files)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def child_build(job: dict) -> dict:
    """Build one index from a .npy of unit vectors and write it; the build time is the measurement."""
    import faiss

    vectors = np.load(job["vectors"])
    start = time.perf_counter()
    if job["kind"] == "ivf":  # a fixed number of inverted lists here (index build's ivf_lists gives 1,824)
        code = factory_string("flat", job["storage"], len(vectors))  # the storage's faiss code: Flat, SQ8, ...
        index = faiss.index_factory(vectors.shape[1], f"IVF{IVF_LISTS},{code}", faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.add(vectors)
    else:  # what `index build` makes, with this run's efConstruction
        index = make_index(vectors, job["kind"], job["storage"], ef_construction=job["ef_construction"])
    seconds = time.perf_counter() - start
    if job["storage"] == "binary":
        faiss.write_index_binary(index, job["out"])
    else:
        faiss.write_index(index, job["out"])
    return {"build_seconds": seconds, "file_mb": os.path.getsize(job["out"]) / 1e6}


def child_search(job: dict) -> dict:
    """Load one index (and the float16 rerank file, memory-mapped), run every setting, report memory."""
    import faiss

    queries_small, queries_full = np.load(job["queries_small"]), np.load(job["queries_full"])
    reference = np.load(job["reference"]) if job.get("reference") else None
    before = memory_status()
    index = searchable(faiss.read_index_binary(job["index"]) if job["binary"] else faiss.read_index(job["index"]))
    loaded = memory_status()
    rerank = np.load(job["rerank"], mmap_mode="r") if job.get("rerank") else None
    hnsw = hnsw_graph(index) if job["hnsw"] else None
    ivf = faiss.extract_index_ivf(index) if job.get("ivf") else None
    rows = []
    n = len(queries_full)
    for ef, shortlist in job["settings"]:
        if hnsw is not None:
            hnsw.efSearch = ef
        if ivf is not None:
            ivf.nprobe = ef  # an IVF tier's first setting is the number of lists visited
        best, ranking = float("inf"), None
        for _ in range(job["repeats"]):
            start = time.perf_counter()
            if rerank is None:
                ranking = np.concatenate([flat_search(index, queries_full[i : i + 1], 10)[0] for i in range(n)])
            else:
                ranking = np.concatenate(
                    [
                        cascade_search(index, rerank, queries_small[i : i + 1], queries_full[i : i + 1], shortlist, 10)[
                            0
                        ]
                        for i in range(n)
                    ]
                )
            best = min(best, time.perf_counter() - start)
        row = {"ef": ef, "shortlist": shortlist, "ms": 1000 * best / n}
        if reference is not None:
            row["overlap"] = overlap_at(ranking, reference, 10)
        else:
            np.save(job["save_ranking"], ranking)
        rows.append(row)
    after = memory_status()
    return {
        "rows": rows,
        "index_anon_mb": loaded["RssAnon"] - before["RssAnon"],
        "anon_after_mb": after["RssAnon"] - before["RssAnon"],
        "file_after_mb": after["RssFile"] - before["RssFile"],
    }


def child_race(job: dict) -> dict:
    """HNSW on the full cell and a cascade searched in turns in one process (their order swapped every round),
    so that both see the same machine load: the fair queries/s ratio on a busy machine."""
    import faiss

    full_index = faiss.read_index(job["full_index"])
    hnsw_graph(full_index).efSearch = job["ef"]
    small_index = searchable(
        faiss.read_index_binary(job["small_index"]) if job["binary"] else faiss.read_index(job["small_index"])
    )
    if job.get("nprobe"):
        faiss.extract_index_ivf(small_index).nprobe = job["nprobe"]
    else:
        hnsw_graph(small_index).efSearch = job["tier_ef"]
    rerank = np.load(job["rerank"], mmap_mode="r")
    qs, qf = np.load(job["queries_small"]), np.load(job["queries_full"])
    n = len(qf)

    def hnsw():
        for i in range(n):
            flat_search(full_index, qf[i : i + 1], 10)

    def cascade():
        for i in range(n):
            cascade_search(small_index, rerank, qs[i : i + 1], qf[i : i + 1], job["shortlist"], 10)

    times = {"hnsw": [], "cascade": []}
    for round_ in range(job["rounds"]):
        order = [("hnsw", hnsw), ("cascade", cascade)]
        for name, run in order if round_ % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            run()
            times[name].append(1000 * (time.perf_counter() - start) / n)
    return times


def exact_shortlists(cells, full, path, shortlists: list[int], n_docs: int) -> None:
    """How much of flat's top 10 an exact scan of each smaller cell (float32, and its sign bits) puts in its
    shortlist: the most any index on that cell can keep."""
    import faiss

    queries_full = np.load(path(f"q-{cell_name(full)}.npy"))
    reference_index = faiss.IndexFlatIP(full[1])
    reference_index.add(np.load(path(f"{cell_name(full)}.f32.npy")))
    _, reference = reference_index.search(queries_full, 10)
    del reference_index
    print(f"\nexact shortlists of {n_docs} documents: share of flat ({full[0]},{full[1]})'s top 10 in them")
    print(f"| cell | {' | '.join(f'top {s}' for s in shortlists)} |\n|---|{'---:|' * len(shortlists)}")
    for cell in cells:
        docs, queries = np.load(path(f"{cell_name(cell)}.f32.npy")), np.load(path(f"q-{cell_name(cell)}.npy"))
        for kind in ("float32", "binary"):
            if kind == "float32":
                index = faiss.IndexFlatIP(cell[1])
                index.add(docs)
                _, found = index.search(queries, max(shortlists))
            else:
                index = faiss.IndexBinaryFlat(8 * ((cell[1] + 7) // 8))
                index.add(np.packbits(docs > 0, axis=1))
                _, found = index.search(np.packbits(queries > 0, axis=1), max(shortlists))
            shares = [
                100 * np.mean([len(set(r) & set(f[:s])) / 10 for r, f in zip(reference, found, strict=True)])
                for s in shortlists
            ]
            print(f"| ({cell[0]},{cell[1]}) {kind} | {' | '.join(f'{x:.1f}%' for x in shares)} |")


def run_child(kind: str, job: dict) -> dict:
    """One measurement in a fresh process (so that its memory is its own), answered as JSON on stdout."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(job)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {kind} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_benchmark(args, encoder, scifact, corpus: Path, extra: list[str]) -> None:
    full = Cell.parse(args.full, "--full")
    tiers = []
    for spec in args.tiers:
        parts = spec.split("/")
        cell = Cell.parse(parts[0], "--tiers")
        storage = parts[1] if len(parts) > 1 else "float32"
        kind = parts[2] if len(parts) > 2 else "hnsw"
        if storage not in STORAGES or kind not in ("hnsw", "flat", "ivf"):
            raise SystemExit(f"--tiers {spec!r}: write LAYER:DIM/float32|float16|int8|int8-direct|binary[/flat|/ivf]")
        if kind == "ivf" and storage not in ("float32", "float16", "int8"):
            raise SystemExit(f"--tiers {spec!r}: an IVF tier holds float32, float16 or int8 vectors")
        tiers.append((cell, storage, kind))
    width = encoder.hidden_size
    layers = sorted({full[0], *(c[0] for c, _, _ in tiers)})
    wanted = [[n, width] for n in layers]
    built = args.work / "index" / "manifest.json"
    manifest = read_manifest(args.work / "index") if built.is_file() else {}
    if not (manifest.get("complete") and all(c in manifest["cells"] for c in wanted)):
        # Every layer a cell needs, at full width: the cells are leading slices of these, renormalised.
        t0 = time.perf_counter()
        manifest = build_index(
            encoder, corpus, [tuple(c) for c in wanted], args.work / "index", shard_size=4096, keep_shards=True,
            log=print,
        )  # fmt: skip
        print(f"encoded in {time.perf_counter() - t0:.0f} s")
    if not manifest.get("shards"):
        raise SystemExit(f"{args.work / 'index'}: built without --keep-shards; the per-layer vectors are gone")
    mem = args.work / "memory"
    mem.mkdir(exist_ok=True)
    shards = load_shards(args.work / "index", read_manifest(args.work / "index"))
    ids = [str(i) for s in shards for i in s["ids"]]
    cells = sorted({full, *(c for c, _, _ in tiers)})

    def path(name: str) -> str:
        return str(mem / name)

    for cell in cells:
        if not Path(path(f"{cell_name(cell)}.f32.npy")).is_file():
            layer = np.concatenate([s[cell_name((cell[0], width))] for s in shards])
            np.save(path(f"{cell_name(cell)}.f32.npy"), unit(layer[:, : cell[1]]))
    if not Path(path("rerank.f16.npy")).is_file():
        np.save(path("rerank.f16.npy"), np.load(path(f"{cell_name(full)}.f32.npy")).astype(np.float16))
    queries = query_vectors(encoder, scifact.query_texts, cells)
    for cell in cells:
        np.save(path(f"q-{cell_name(cell)}.npy"), queries[cell])
    n = len(scifact.query_texts)
    print(
        f"\n{len(ids)} documents ({len(scifact.doc_ids)} SciFact + {len(extra)} distractors), {n} queries, model "
        f"{encoder.name}, documents truncated to {args.max_length} tokens; one query per call, one thread, best of "
        f"{args.repeats}; memory: resident MiB over each search process's own baseline"
    )
    qfull = path(f"q-{cell_name(full)}.npy")
    exact_shortlists(cells, full, path, args.shortlists, len(ids))
    if args.exact_only:
        return
    summary = []

    def measure(label, vectors, storage, kind, settings, rerank, small_queries, reference=True):
        index_file = path("".join(c if c.isalnum() else "_" for c in label) + ".index")
        built = run_child(
            "build",
            {
                "vectors": vectors,
                "storage": storage,
                "kind": kind,
                "out": index_file,
                "ef_construction": args.ef_construction,
            },
        )
        job = {
            "index": index_file,
            "binary": storage == "binary",
            "hnsw": kind == "hnsw",
            "ivf": kind == "ivf",
            "rerank": rerank,
            "queries_small": small_queries,
            "queries_full": qfull,
            "settings": settings,
            "repeats": args.repeats,
        }
        if reference:
            job["reference"] = path("flat-top10.npy")
        else:
            job["save_ranking"] = path("flat-top10.npy")
        result = run_child("search", job)
        result.update(
            built, label=label, index=index_file, binary=storage == "binary", hnsw=kind == "hnsw", ivf=kind == "ivf"
        )
        result["queries_small"] = small_queries
        summary.append(result)
        print(
            f"\n{label}: built in {built['build_seconds']:.1f} s ({built['file_mb']:.0f} MB file); index in RAM "
            f"{result['index_anon_mb']:.0f} MB; after the searches: anonymous +{result['anon_after_mb']:.0f} MB, "
            f"file-backed +{result['file_after_mb']:.0f} MB"
        )
        if reference:
            print("| efSearch (IVF: nprobe) | shortlist | top-10 overlap with flat | ms/query | queries/s |")
            print("|---:|---:|---:|---:|---:|")
            for row in result["rows"]:
                print(
                    f"| {row['ef']} | {row['shortlist'] or '-'} | {row['overlap']:.2f}% | {row['ms']:.3f} | "
                    f"{1000 / row['ms']:.0f} |"
                )
        return result

    flat = measure(f"flat ({full[0]},{full[1]}) float32", path(f"{cell_name(full)}.f32.npy"), "float32", "flat",
                   [[0, 0]], None, qfull, reference=False)  # fmt: skip
    print("| search | top-10 overlap with flat | ms/query | queries/s |\n|---|---:|---:|---:|")
    print(f"| flat | 100.0% | {flat['rows'][0]['ms']:.3f} | {1000 / flat['rows'][0]['ms']:.0f} |")
    hnsw = measure(f"HNSW{HNSW_M} ({full[0]},{full[1]}) float32", path(f"{cell_name(full)}.f32.npy"), "float32",
                   "hnsw", [[ef, 0] for ef in args.ef], None, qfull)  # fmt: skip
    for cell, storage, kind in tiers:
        settings = [[max(s, 16), s] for s in args.shortlists]
        if kind == "hnsw" and args.tier_ef:  # the walk's breadth apart from how many candidates are reranked
            settings = [[ef, s] for ef in args.tier_ef for s in args.shortlists if s <= ef]
        if kind == "ivf":
            settings = [[nprobe, s] for nprobe in args.nprobe for s in args.shortlists]
        name = {"hnsw": f"HNSW{HNSW_M}", "flat": "flat", "ivf": f"IVF{IVF_LISTS}"}[kind]
        label = f"{name} ({cell[0]},{cell[1]}) {storage} -> rerank"
        measure(label, path(f"{cell_name(cell)}.f32.npy"), storage, kind, settings, path("rerank.f16.npy"),
                path(f"q-{cell_name(cell)}.npy"))  # fmt: skip

    def first_at(result, share):
        """The fastest setting that keeps `share`% of flat's top 10 (timed one after another)."""
        return min((r for r in result["rows"] if r["overlap"] >= share), key=lambda r: r["ms"], default=None)

    target = first_at(hnsw, 99.0)
    print(
        "\n| index | RAM MiB, anonymous | + file-backed MiB | bytes/vector in RAM | build s | fastest setting >= 99% "
        "| queries/s there | RAM vs HNSW | queries/s vs HNSW |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for result in summary[1:]:
        hit = first_at(result, 99.0)
        knob = "nprobe" if result["ivf"] else "ef"
        where = "none"
        if hit:
            where = f"{knob} {hit['ef']}" + (f", shortlist {hit['shortlist']}" if hit["shortlist"] else "")
        qps = f"{1000 / hit['ms']:.0f}" if hit else "-"
        ram_ratio = f"{100 * result['anon_after_mb'] / hnsw['anon_after_mb']:.0f}%"
        qps_ratio = f"{target['ms'] / hit['ms']:.2f}x" if hit and target else "-"
        print(
            f"| {result['label']} | {result['anon_after_mb']:.0f} | {result['file_after_mb']:.0f} | "
            f"{2**20 * result['anon_after_mb'] / len(ids):.0f} | {result['build_seconds']:.0f} | {where} | {qps} | "
            f"{ram_ratio} | {qps_ratio} |"
        )
    if target is not None and args.rounds:
        for result in summary[2:]:
            hit = first_at(result, 99.0)
            if hit is None or not (result["hnsw"] or result["ivf"]):
                continue
            race = run_child(
                "race",
                {
                    "full_index": hnsw["index"],
                    "ef": target["ef"],
                    "small_index": result["index"],
                    "binary": result["binary"],
                    "shortlist": hit["shortlist"],
                    "tier_ef": hit["ef"],
                    "nprobe": hit["ef"] if result["ivf"] else None,
                    "rerank": path("rerank.f16.npy"),
                    "queries_small": result["queries_small"],
                    "queries_full": qfull,
                    "rounds": args.rounds,
                },
            )
            h, c = np.median(race["hnsw"]), np.median(race["cascade"])
            probe = f" nprobe {hit['ef']}" if result["ivf"] else f" efSearch {hit['ef']}"
            print(
                f"\nin turns, {args.rounds} rounds in one process: HNSW ef {target['ef']} median {h:.3f} ms/query "
                f"({1000 / h:.0f} queries/s), {result['label']} shortlist {hit['shortlist']}{probe} median "
                f"{c:.3f} ms/query "
                f"({1000 / c:.0f} queries/s): the cascade at {h / c:.2f}x HNSW's queries/s; per round "
                f"{', '.join(f'{a / b:.2f}x' for a, b in zip(race['hnsw'], race['cascade'], strict=True))}"
            )
    for result in summary[2:]:
        hit95 = first_at(result, 95.0)
        if hit95:
            print(
                f"{result['label']}: fastest >= 95% at shortlist {hit95['shortlist']} ({hit95['overlap']:.1f}%, "
                f"{1000 / hit95['ms']:.0f} queries/s)"
            )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        job = json.loads(sys.argv[3])
        print(json.dumps({"build": child_build, "search": child_search, "race": child_race}[sys.argv[2]](job)))
    else:
        main()
