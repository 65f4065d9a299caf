"""`matryoshka2d demo`: the whole loop on the default backbone, each step printing what it produced.

1. a short elastic fine-tune (2dmse) of the model on the shared NLI triplets, cached in the cache directory so a
   second run reuses it; then exit heads fitted on the same sentences in closed form, and layer 0, the model's
   static cell (model2vec's token table of it, with a head fitted in closed form onto its own vectors; cached too);
2. its STS grid (layers 0..N x dims) on a few STS sets, with and without the heads from one pass, and the same
   grid as served in int8 (the ONNX graphs `serve --backend onnx --quantize int8` runs; needs onnxruntime);
3. the picker's choice of a (cell, backend) for a budget (default: half the full model's query encoding time with
   torch), over one frontier where the full model in int8 stands next to the shallow cells in fp32 and int8 and
   the static cell; the frontier without heads next to it; and in plain words whether the int8 full model is the
   one to deploy and what layer 0 gives for its time;
4. `matryoshka2d export` of that cell for its backend: a standalone sentence-transformers folder with only its
   layers (and its int8 ONNX graph when int8 is chosen);
5. a faiss index of a small SciFact corpus and a cascade search: shortlist with a narrow last-layer cell,
   rerank with the full cell, next to flat full-cell search.

`matryoshka2d demo --cells` is the older, quicker demo: a few sentences embedded at several cells, with their
similarities and time per cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from matryoshka2d.cli.args import command, positive_float, positive_int, reads_and_writes
from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.outputs import make_folder, open_for_writing


def step(number: int, title: str) -> float:
    print(f"\n[{number}/5] {title}", flush=True)
    return time.perf_counter()


def done(start: float, what: str) -> None:
    print(f"    -> {what} ({time.perf_counter() - start:.0f} s)", flush=True)


def fine_tune(args, root: Path) -> Path:
    """A short 2dmse fine-tune, reused from the cache directory when a finished one is there."""
    from matryoshka2d.models.backbones import cache_dir
    from matryoshka2d.training.config import TrainConfig
    from matryoshka2d.training.trainer import Trainer

    name = Path(args.model).name if os.sep in args.model else args.model
    # "-nosts": trained without the rows that hold an STS test sentence (the scores below are of unseen sentences)
    out = cache_dir() / "demo" / f"{name}-2dmse-{args.steps}steps-bs{args.batch_size}-nosts"
    if (out / "matryoshka2d.json").is_file():
        meta = ConfinedFolder(out, "model").read_json("matryoshka2d.json")
        print(f"    reusing the cached fine-tune {out} ({meta.get('steps')} steps; delete it to train again)")
        return out
    triplets = root / "nli" / "train_triplets.tsv"
    config = TrainConfig(
        data=[str(triplets)],
        output=str(out),
        model=args.model,
        method="2dmse",
        loss="angle",
        steps=args.steps,
        batch_size=args.batch_size,
        pooling=args.pooling,
        max_length=64,  # NLI sentences are short; keeps each step cheap on a CPU
        eval_file=str(root / "sts" / "raw" / "stsb_dev.tsv"),
        save_steps=max(10, args.steps // 3),  # a killed demo resumes from here
        device=args.device,
        exclude_sts_test=True,
        sts_data_dir=str(root),
    )
    print(f"    2dmse + AnglE loss, {args.steps} steps of {args.batch_size} triplets from {triplets}")
    return Trainer(config).run(resume=True, progress=not args.quiet)


def head_sentences(root: Path, limit: int) -> list[str]:
    """The first `limit` training sentences of the fine-tune's NLI file that are no STS test sentence: what the
    exit heads and the static cell are fitted on (no fit sees a sentence the grid scores)."""
    import itertools

    from matryoshka2d.evaluate.sts import LeftOutSentences, sts_test_sentence_keys
    from matryoshka2d.training.data import read_sentences

    unseen = LeftOutSentences(sts_test_sentence_keys(root))
    return list(itertools.islice(unseen.filter(read_sentences(root / "nli" / "train_triplets.tsv")), limit))


def save_beside(encoder, model_dir: Path, out: Path) -> None:
    """`encoder` saved to `out` (atomically) with the record of the model it was fitted on."""
    from matryoshka2d.training.checkpoints import save_model_atomically

    meta = ConfinedFolder(model_dir, "model").read_json("matryoshka2d.json")
    save_model_atomically(lambda folder: encoder.save(folder, metadata=meta), out)


def fit_heads_for(args, root: Path, model_dir: Path) -> Path:
    """Exit heads fitted in closed form on the fine-tune's own training sentences, cached beside it; the ridge
    strength chosen on STS-B dev as `heads fit` does by default (held-out squared error if the file is missing)."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.heads_fit import fit_heads
    from matryoshka2d.training.heads_run import ridge_selection

    select, dev = ridge_selection("auto", root / "sts" / "raw" / "stsb_dev.tsv")
    out = model_dir.with_name(f"{model_dir.name}-heads{args.head_sentences}-{select}")
    if (out / "matryoshka2d.json").is_file():
        print(f"    reusing the cached heads {out}")
        return out
    encoder = ElasticEncoder(str(model_dir), device=args.device)
    texts = head_sentences(root, args.head_sentences)
    heads, report = fit_heads(encoder, [texts[i : i + 512] for i in range(0, len(texts), 512)], select=select, dev=dev)
    encoder.set_exit_heads(heads)
    save_beside(encoder, model_dir, out)
    print(
        f"    {heads.describe()}, fitted on {report.sentences} training sentences in {report.seconds:.0f} s "
        f"(ridge strength: {heads.record['ridge_chosen_by']})"
    )
    return out


def static_cell_for(args, root: Path, model_dir: Path) -> Path:
    """Layer 0: the model's static cell in closed form (model2vec's token table of this model, then the ridge head
    onto the model's own unit vectors of the same training sentences the exit heads saw), cached beside the model
    like the heads. `distill --mode static` trains it further; the demo shows the untrained start, which is what
    the model gives for about a minute of work."""
    from matryoshka2d.models.encoder import ElasticEncoder
    from matryoshka2d.models.static import distill_table, fit_head

    out = model_dir.with_name(f"{model_dir.name}-static")
    if (out / "matryoshka2d.json").is_file():
        print(f"    reusing the cached static cell {out}")
        return out
    encoder = ElasticEncoder(str(model_dir), device=args.device)
    texts = head_sentences(root, args.head_sentences)
    targets = encoder.encode(texts, normalize=True)  # the full model's own vectors: the space its index is in
    cell = distill_table(encoder)
    report = fit_head(cell, texts, targets)
    encoder.set_static_cell(cell)
    save_beside(encoder, model_dir, out)
    print(
        f"    static cell (layer 0): model2vec's table of {cell.vocabulary:,} tokens made in "
        f"{cell.record['table_seconds']:.0f} s, its head fitted in closed form on {report['head_texts']} sentences "
        f"in {report['head_seconds']:.0f} s"
    )
    return out


def export_cell(encoder, layer: int, dim: int, out: Path, backend: str = "torch", sts_file=None) -> str:
    """`matryoshka2d export` of the picked cell on its backend: only `layer` layers and the first `dim` numbers, a
    folder that loads with SentenceTransformer(out) alone (and, for onnx-int8, its int8 ONNX graph), checked against
    encode(layer, dim) before it is put in place. The folder is the demo's own (inside --output), so a rerun
    replaces it."""
    from matryoshka2d.export.cell import export_cell as export

    onnx = {"fmt": "onnx", "quantize": "int8", "sts_file": sts_file} if backend == "onnx-int8" else {}
    report = export(encoder, layer, dim, out, overwrite=True, **onnx)
    kept = f"{report.parameters_kept:,} of {report.parameters_full:,} parameters"
    graph = "; onnx/cell_int8.onnx for onnxruntime" if onnx else ""
    return f"{out} ({kept}; loads with SentenceTransformer('{out}'){graph})"


def int8_grid(encoder, dims, root: Path, datasets, out: Path, log):
    """The same STS grid scored by the int8 ONNX graphs `serve --backend onnx --quantize int8` runs (built and
    cached in the model's folder), or None where onnxruntime is not installed."""
    from matryoshka2d.evaluate.results import write_outputs
    from matryoshka2d.evaluate.sts import evaluate_sts
    from matryoshka2d.export.onnx_graphs import ExportError, require_onnx
    from matryoshka2d.serve.served import BackendCells, make_backend

    try:
        require_onnx()
    except ExportError as exc:
        print(f"    int8 graphs not scored: {exc}")
        return None
    layers = list(range(1, encoder.num_layers + 1))
    cells = BackendCells(encoder, make_backend(encoder, "onnx-int8", layers, log=log), layers, dims)
    result = evaluate_sts(cells, root, datasets=datasets, log=log)
    write_outputs(result, out)
    return result


def small_scifact(source: Path, out: Path, n_queries: int, n_docs: int):
    """A BEIR folder with the first `n_queries` judged queries and a corpus of their relevant documents filled
    up to `n_docs` with the corpus's first documents."""
    from matryoshka2d.beir import load_beir, qrels_split

    split = qrels_split(source, None)
    full = load_beir(source, split)
    relevant = {d for rel in full.qrels[:n_queries] for d in rel}
    fill = [i for i in range(len(full.doc_ids)) if i not in relevant][: max(0, n_docs - len(relevant))]
    keep = sorted(relevant | set(fill))
    with open_for_writing(out / "corpus.jsonl", "w") as f:  # the one writer (a temporary file renamed into place)
        for i in keep:
            f.write(json.dumps({"_id": full.doc_ids[i], "text": full.doc_texts[i]}) + "\n")
    return full, keep, split


def int8_verdict(points: list[dict], chosen: dict, num_layers: int, hidden: int, budget: float) -> str:
    """Plain words on the full model in int8: does it fit the budget, and does it beat every shallow cell?"""
    full = next(p for p in points if p["backend"] == "onnx-int8" and (p["layer"], p["dim"]) == (num_layers, hidden))
    shallow = max((p for p in points if p["layer"] < num_layers), key=lambda p: p["score"])
    said = f"the full model in int8 ({full['score']:.2f} at {full['latency_ms']:.2f} ms/query)"
    if full["latency_ms"] > budget:
        return f"{said} does not fit the budget of {budget:.2f} ms/query"
    if (chosen["layer"], chosen["dim"], chosen["backend"]) == (num_layers, hidden, "onnx-int8"):
        beats = "scores higher than every shallow cell" if full["score"] > shallow["score"] else "scores best"
        return f"{said} fits the budget and {beats}: it is the recommendation"
    return (
        f"{said} fits the budget, but ({chosen['layer']},{chosen['dim']}) on {chosen['backend']} scores "
        f"{chosen['score']:.2f}"
    )


def static_point(points: list[dict], full_ms: float) -> str:
    """Plain words on layer 0, the static cell: its best point, its time against the full model's, and whether
    the frontier holds it."""
    zero = max((p for p in points if p["layer"] == 0), key=lambda p: p["score"])
    where = "on the frontier" if any(p["frontier"] for p in points if p["layer"] == 0) else "off the frontier"
    return (
        f"layer 0, the static cell: ({zero['layer']},{zero['dim']}) scores {zero['score']:.2f} at "
        f"{zero['latency_ms']:.3f} ms/query, {full_ms / zero['latency_ms']:.0f}x faster than the full model in torch "
        f"({where}; `distill --mode static` trains it towards the model's vectors)"
    )


def run_loop(args) -> int:
    """The five steps, each printing what it produced into --output."""
    from matryoshka2d.paths import data_dir

    begin = time.perf_counter()
    root = data_dir(args.data_dir)
    work = make_folder(Path(args.output), "--output")
    quiet = (lambda m: None) if args.quiet else (lambda m: print(f"    {m}", file=sys.stderr))
    model_dir = elastic_model(args, root)
    encoder, int8 = sts_grids(args, root, work, model_dir, quiet)
    chosen = pick_cell(args, work, model_dir, encoder, int8 is not None, quiet)
    layer, dim, backend = chosen["layer"], chosen["dim"], chosen["backend"]
    t = step(4, f"export cell ({layer},{dim}) for {backend}")
    sts_file = root / "sts" / "raw" / "stsb_test.tsv"
    done(t, export_cell(encoder, layer, dim, work / f"export-{layer}x{dim}", backend, sts_file))
    cascade_search(args, root, work, encoder, quiet)
    print(f"\nrecommended cell {chosen['reason']}")
    print("\n".join(f"  {line}" for line in chosen["deploy"]))
    print(f"demo finished in {time.perf_counter() - begin:.0f} s; everything is in {work}")
    return 0


def elastic_model(args, root: Path) -> Path:
    """Step 1: the fine-tune, its exit heads and its static cell (each cached): the folder of the model."""
    t = step(1, f"fine-tune {args.model} to be elastic (2dmse)")
    model_dir = fine_tune(args, root)
    dev = ConfinedFolder(model_dir, "model").read_json("matryoshka2d.json").get("final_eval", {})
    model_dir = static_cell_for(args, root, fit_heads_for(args, root, model_dir))
    done(t, f"{model_dir}; STS-B dev Spearman at the full model: {dev.get('spearman', '?')}")
    return model_dir


def sts_grids(args, root: Path, work: Path, model_dir: Path, quiet):
    """Step 2: the STS grid with and without heads from one pass, and as served in int8: (the encoder, the int8
    result or None where onnxruntime is missing)."""
    from matryoshka2d.evaluate.grid import EncoderCells
    from matryoshka2d.evaluate.results import cell_average, write_outputs
    from matryoshka2d.evaluate.sts import evaluate_sts
    from matryoshka2d.models.encoder import ElasticEncoder

    t = step(2, f"STS grid on {', '.join(args.sts)}: every layer (0: the static cell) x dims, with and without heads")
    encoder = ElasticEncoder(str(model_dir), device=args.device)
    dims = sorted({d for d in (32, 64, 128, 256) if d < encoder.hidden_size} | {encoder.hidden_size})
    cells = EncoderCells(encoder, encoder.layers, dims, show_progress=not args.quiet, compare_heads=True)
    result = evaluate_sts(cells, root, datasets=args.sts, log=quiet)
    write_outputs(result, work / "sts")
    without = evaluate_sts(cells.without_heads(), root, datasets=args.sts, log=quiet)
    write_outputs(without, work / "sts-no-heads")
    full = result.summary
    shallow = {True: result.summary.get("shallow_average"), False: without.summary.get("shallow_average")}
    int8 = int8_grid(encoder, dims, root, args.sts, work / "sts-int8", quiet)
    if int8 is not None:
        print(
            f"    as served in int8 (ONNX graphs, `serve --backend onnx --quantize int8`): full model "
            f"{int8.summary['average']:.2f} ({int8.summary['average'] - full['average']:+.2f} vs torch fp32) -> "
            f"{work / 'sts-int8'}"
        )
    static = cell_average(result.scores, result.metric)[(0, encoder.hidden_size)]
    done(
        t,
        f"{work / 'sts'}/results.md and heatmap.png (and sts-no-heads/); full model ({full['cell'][0]},"
        f"{full['cell'][1]}): {full['average']:.2f} Spearman; layers below it at full width: "
        f"{shallow[False]:.2f} without heads, {shallow[True]:.2f} with; the static cell (0,{encoder.hidden_size}): "
        f"{static:.2f}",
    )
    return encoder, int8


def pick_cell(args, work: Path, model_dir: Path, encoder, int8: bool, quiet) -> dict:
    """Step 3: the picker's choice for the budget over torch (and int8), and the same budget without heads: the
    recommendation pick.json records."""
    from matryoshka2d.pick.cost import layer_latency
    from matryoshka2d.pick.options import PickOptions
    from matryoshka2d.pick.picker import run_pick

    t = step(3, "pick a cell and a backend for a budget")
    backends = ["torch"] + (["onnx-int8"] if int8 else [])
    latency = {b: layer_latency(str(model_dir), None, False, quiet, b)[0] for b in backends}
    full_ms = latency["torch"][encoder.num_layers]
    budget = args.max_latency_ms or round(full_ms * args.budget_fraction, 3)
    print(f"    budget: query encoding <= {budget:.2f} ms/query (full model: {full_ms:.2f} ms/query with torch here)")
    fastest = min(ms for table in latency.values() for ms in table.values())
    if budget < fastest:  # fixed per-call costs dominate on tiny models or busy machines
        budget = fastest
        print(f"    nothing is that fast here; the budget becomes the fastest option's {budget:.2f} ms/query")
    results = [str(work / "sts")] + ([str(work / "sts-int8")] if int8 else [])
    options = PickOptions(results, str(work / "pick"), str(model_dir), backends, max_latency_ms=budget)
    run_pick(options, log=quiet)
    picked = json.loads((work / "pick" / "pick.json").read_text())
    chosen = picked["recommended"]
    torch_budget = max(budget, min(latency["torch"].values()))  # torch alone may not be that fast
    plain = PickOptions([str(work / "sts-no-heads")], str(work / "pick-no-heads"), str(model_dir), ["torch"])
    run_pick(dataclasses.replace(plain, max_latency_ms=torch_budget), log=quiet)
    plain = json.loads((work / "pick-no-heads" / "pick.json").read_text())["recommended"]
    print(
        f"    without heads (torch only) the same budget would give ({plain['layer']},{plain['dim']}) at "
        f"{plain['score']:.2f}"
    )
    if int8:
        print(f"    {int8_verdict(picked['points'], chosen, encoder.num_layers, encoder.hidden_size, budget)}")
    print(f"    {static_point(picked['points'], full_ms)}")
    where = f"{work / 'pick'}/pick.md and pick.png"
    done(t, f"recommended ({chosen['layer']},{chosen['dim']}) on {chosen['backend']} at {chosen['score']:.2f}; {where}")
    return chosen


def cascade_search(args, root: Path, work: Path, encoder, quiet) -> None:
    """Step 5: a faiss index of a small SciFact corpus at a narrow last-layer cell and the full cell, searched
    flat and as a cascade."""
    from matryoshka2d.evaluate.retrieval import rank_metrics
    from matryoshka2d.retrieval.index import build_index
    from matryoshka2d.retrieval.search import CellIndex

    N, D = encoder.num_layers, encoder.hidden_size
    # The query runs to the full cell's layer for the rerank anyway, so the shortlist cell saves search work
    # only through its width: the last layer at about a sixth of the width (64 of 384).
    small = (N, next((d for d in (32, 64, 128, 256) if d >= D // 6 and d < D), max(1, D // 4)))
    t = step(
        5, f"cascade search over a small SciFact corpus: shortlist with ({small[0]},{small[1]}), rerank with ({N},{D})"
    )
    full_set, keep, _ = small_scifact(root / "retrieval" / "scifact", work / "scifact-small", args.queries, args.docs)
    encoder.max_length = min(encoder.max_length, 128)  # abstracts cut to 128 tokens: a CPU-sized demo
    build_index(encoder, work / "scifact-small" / "corpus.jsonl", [small, (N, D)], work / "index", log=quiet)
    index = CellIndex(work / "index")
    queries = full_set.query_texts[: args.queries]
    qrels_pos = {full_set.doc_ids[i]: n for n, i in enumerate(keep)}
    qrels = [{qrels_pos[full_set.doc_ids[d]]: r for d, r in rel.items()} for rel in full_set.qrels[: args.queries]]
    rows = {}
    for name, kwargs in (("flat", {"cell": (N, D)}), ("cascade", {"cascade": (small, (N, D)), "shortlist": 100})):
        hits = index.search(encoder, queries, top_k=10, **kwargs)
        ranking = np.array([[qrels_pos[i] for i in ids] + [-1] * (10 - len(ids)) for ids in hits.ids])
        rows[name] = (hits, ranking, rank_metrics(ranking, qrels)["ndcg@10"])
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows["flat"][1], rows["cascade"][1], strict=True)])
    print(f"    {len(keep)} documents indexed at ({small[0]},{small[1]}) and ({N},{D}) in one pass -> {work / 'index'}")
    print(f"    query: {queries[0]}")
    titles = dict(zip(full_set.doc_ids, full_set.doc_texts, strict=True))
    for rank, doc in enumerate(rows["cascade"][0].ids[0][:3], start=1):
        print(f"      {rank}. [{doc}] {titles[doc][:90]}")
    for hits, _, ndcg in rows.values():
        print(
            f"    {hits.description}: nDCG@10 {ndcg:.2f} over {len(queries)} queries, search "
            f"{1000 * hits.search_seconds / len(queries):.3f} ms/query"
        )
    print("    (on a corpus this small flat search is already cheap; the cascade pays off on large indexes, where the")
    print("    small cell reads a fraction of the bytes per document: benchmarks/retrieval_cascade.py)")
    done(t, f"cascade finds {100 * overlap:.0f}% of flat search's top 10")


def cmd_demo(args) -> int:
    if args.cells:
        from matryoshka2d.cli.demo_cells import run_cells

        return run_cells(args)
    return run_loop(args)


def register(sub, model_args) -> None:
    p = command(
        sub,
        "demo",
        cmd_demo,
        help="the whole loop: elastic fine-tune, STS grid (torch and int8), pick a cell and backend, export, cascade "
        "search",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_args(p)
    p.add_argument("--cells", action="store_true", help="the quick demo: a few sentences at several cells, timed")
    p.add_argument("--steps", type=positive_int, default=60, help="fine-tuning steps")
    p.add_argument("--batch-size", type=positive_int, default=16, help="triplets per step")
    p.add_argument(
        "--head-sentences",
        type=positive_int,
        default=10000,
        help="training sentences the exit heads are fitted on",
    )
    p.add_argument("--sts", nargs="+", default=["stsb", "sts16"], help="STS sets for the grid")
    p.add_argument("--budget-fraction", type=positive_float, default=0.5, help="budget as a share of full query time")
    p.add_argument("--max-latency-ms", type=positive_float, help="budget in ms per query instead of --budget-fraction")
    p.add_argument("--queries", type=positive_int, default=50, help="SciFact queries searched")
    p.add_argument(
        "--docs", type=positive_int, default=1000, help="SciFact documents indexed, at least the relevant ones"
    )
    p.add_argument("--data-dir", help="shared data root (default: $MATRYOSHKA2D_DATA, else ../shared/data)")
    p.add_argument("--output", default="runs/demo", help="where the results go")
    p.add_argument("--quiet", action="store_true", help="no progress bars or detail lines")
    reads_and_writes(p, ("--model", "--data-dir"))
