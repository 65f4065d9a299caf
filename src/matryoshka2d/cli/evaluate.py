"""`matryoshka2d eval sts|classification|retrieval|mteb` and `matryoshka2d report`.

Each eval command builds the default cell embedder (one encoder pass per dataset, widths by slicing), runs
the evaluator and writes results.json, results.md, results.csv and heatmap.png into --output. `eval mteb` runs
mteb's tasks on chosen cells (a pair's query side included) and also writes mteb's own files, a folder per cell.
"""

from __future__ import annotations

import sys
from pathlib import Path

from matryoshka2d.cli.args import (
    DEVICE_HELP,
    MODEL_HELP,
    POOLING_CHOICES,
    POOLING_HELP,
    command,
    command_group,
    count,
    layer_ranges,
    only_static_layers,
    positive_float,
    positive_int,
    reads_and_writes,
    refuse_pooling_at_static_cell,
    token_length,
    width_ranges,
)
from matryoshka2d.evaluate.grid import EncoderCells, parse_ints
from matryoshka2d.evaluate.mteb_run import INSTALL as INSTALL_MTEB  # mteb itself is imported by `eval mteb` only
from matryoshka2d.outputs import TEMPORARY_MARK, write_text

REDUCER_SAMPLES = 2000  # corpus sentences a reducer is fitted on, unless --reducer-samples says


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def _served(args) -> str:
    """The backend named by --backend and --quantize (deploy/served.py), checked before any model is loaded."""
    from matryoshka2d.deploy.served import backend_name

    if args.quantize and args.backend != "onnx":
        raise ValueError("--quantize int8 applies to --backend onnx (the torch backend scores in fp32)")
    if args.backend == "onnx":
        if getattr(args, "compare_heads", False):
            raise ValueError(
                "--compare-heads scores torch's cells with and without heads from one pass; drop it with "
                "--backend onnx (the graphs hold the heads)"
            )
        if args.device not in (None, "cpu"):
            raise ValueError(f"--backend onnx runs on the CPU (onnxruntime); drop --device {args.device}")
    return backend_name(args.backend, args.quantize)


def _check_layers(args) -> None:
    """Before anything loads: --pooling where every layer asked for is 0, the static cell, would do nothing."""
    if only_static_layers(args.layers):
        refuse_pooling_at_static_cell(args, "--layers")


def _embedder(args, default_cells=None):
    """The encoder named by --model, wrapped to give the cells of --layers x --dims (or the defaults), computed
    by torch or by the serving backend's graphs (--backend onnx [--quantize int8])."""
    from matryoshka2d.cli.args import load_encoder

    backend = _served(args)
    encoder = load_encoder(
        args, max_length=args.max_length, log=_log, **({"device": "cpu"} if backend != "torch" else {})
    )
    layers, dims = parse_ints(args.layers, "layers"), parse_ints(args.dims, "dims")
    if default_cells is not None:
        default_layers, default_dims = default_cells(encoder.num_layers, encoder.hidden_size)
        layers, dims = layers or default_layers, dims or default_dims
    if backend != "torch":
        from matryoshka2d.deploy.served import BackendCells, make_backend
        from matryoshka2d.evaluate import grid

        layers, dims = grid.check_cells(  # before any graph is built
            layers or encoder.layers,
            dims or grid.default_dims(encoder.hidden_size),
            encoder.num_layers,
            encoder.hidden_size,
            static=encoder.static_cell is not None,
        )
        served = make_backend(encoder, backend, layers, batch_size=args.batch_size, log=_log)
        return BackendCells(encoder, served, layers, dims, show_progress=not args.quiet)
    compare = bool(getattr(args, "compare_heads", False))
    if compare and encoder.exit_heads is None:
        raise ValueError(f"--compare-heads: {encoder.name} has no exit heads to compare (heads fit makes them)")
    return EncoderCells(
        encoder, layers, dims, batch_size=args.batch_size, show_progress=not args.quiet, compare_heads=compare
    )


def _evaluate(args, run, embedder) -> int:
    """Run one evaluator; with --compare-heads also on the cells without heads from the same pass: results
    in --output and --output/no-heads, and the gain per cell."""
    result = run(embedder)
    code = _finish(result, args.output)
    if not getattr(args, "compare_heads", False):
        return code
    without = run(embedder.without_heads())
    _finish(without, str(Path(args.output) / "no-heads"))
    metric = result.metric
    gains = {(r["layer"], r["dim"]): r[metric] for r in result.average}
    print(f"exit heads, {result.task} {metric} average: without -> with (gain)")
    for row in without.average:
        cell = (row["layer"], row["dim"])
        if cell in gains and row.get(metric) is not None:
            print(f"  ({cell[0]},{cell[1]}): {row[metric]:.2f} -> {gains[cell]:.2f} ({gains[cell] - row[metric]:+.2f})")
    return code


def _finish(result, output: str) -> int:
    from matryoshka2d.evaluate.results import write_outputs

    paths = write_outputs(result, output)
    summary = result.summary
    if summary.get("average") is not None:
        layer, dim = summary["cell"]
        line = f"{result.task} {result.metric}: {summary['average']:.2f} at layer {layer}, dim {dim}"
        if "shallow_average" in summary:
            line += f"; shallow average (layers {summary['shallow_layers']}): {summary['shallow_average']:.2f}"
        print(line)
    print(f"{len(result.scores)} scores in {result.seconds['total']:.1f} s -> {', '.join(map(str, paths))}")
    return 0


def cmd_sts(args) -> int:
    from matryoshka2d.evaluate.sts import evaluate_sts
    from matryoshka2d.paths import data_dir

    _check_layers(args)
    if not args.reducer and (args.reducer_corpus or args.reducer_samples is not None):
        raise ValueError("--reducer-corpus and --reducer-samples set how --reducer is fitted; they need --reducer")
    if args.reducer and args.backend != "torch":  # before the model loads or a graph is built
        raise ValueError(
            f"--reducer {args.reducer} reduces the vectors torch computes; it does not run on --backend "
            f"{args.backend} (the served graphs give truncated cells): drop one of them"
        )
    root = data_dir(args.data_dir)
    embedder = _embedder(args)
    if args.reducer:  # post-hoc PCA / Isomap / LLE cells instead of truncated ones (matryoshka2d.compress.reducers)
        from matryoshka2d.compress.reducers import reducer_cells

        if args.compare_heads:
            raise ValueError("--compare-heads and --reducer exclude each other: a reducer makes its own cells")
        dims = parse_ints(args.dims, "dims")
        samples = args.reducer_samples or REDUCER_SAMPLES
        embedder = reducer_cells(embedder, args.reducer, dims, args.reducer_corpus, root, samples, _log)
    return _evaluate(
        args, lambda cells: evaluate_sts(cells, root, variant=args.variant, datasets=args.datasets, log=_log), embedder
    )


def cmd_classification(args) -> int:
    from matryoshka2d.evaluate.classification import default_cells, evaluate_classification
    from matryoshka2d.paths import data_dir

    _check_layers(args)
    directory = Path(args.classification_dir) if args.classification_dir else data_dir(args.data_dir) / "classification"
    embedder = _embedder(args, default_cells)
    return _evaluate(
        args,
        lambda cells: evaluate_classification(
            cells,
            directory,
            datasets=args.datasets,
            label_column=args.label_column,
            folds=args.folds,
            log=_log,
            patience=args.c_patience,
        ),
        embedder,
    )


def pick_split(directory: Path, split: str | None) -> str:
    """--split, else 'test' when the folder has it, else the folder's only qrels file."""
    from matryoshka2d.evaluate.retrieval import qrels_split

    return qrels_split(directory, split)


def cmd_retrieval(args) -> int:
    from matryoshka2d.evaluate.retrieval import evaluate_retrieval
    from matryoshka2d.paths import data_dir

    _check_layers(args)
    if args.doc_cache and not (args.cascade or args.query_layer or args.query_model or args.storage):
        raise ValueError(
            "--doc-cache keeps the documents' pooled states for --cascade, --query-layer, --query-model or "
            "--storage; a grid evaluation does not use it"
        )
    if any((args.corpus, args.queries, args.qrels)):
        return _from_files(args)
    dirs = [Path(d) for d in args.dataset_dir] if args.dataset_dir else [data_dir(args.data_dir) / "retrieval/scifact"]
    splits = {pick_split(d, args.split) for d in dirs}
    if len(splits) > 1:
        raise ValueError(f"the dataset folders would use different splits ({', '.join(sorted(splits))}); pass --split")
    split = splits.pop()
    _log(f"retrieval split: {split}")
    if args.cascade or args.query_layer or args.query_model or args.storage:
        if args.backend != "torch":
            raise ValueError(
                "--backend onnx scores grids; --cascade, --query-layer, --query-model and --storage run on torch"
            )
        return _cascade(args, dirs, split)
    return _evaluate(args, lambda cells: evaluate_retrieval(cells, dirs, split=split, log=_log), _embedder(args))


def _from_files(args) -> int:
    """--corpus, --queries and --qrels: the three files of one data set wherever they are, read as a BEIR folder (a
    temporary one of links, named after the corpus's folder; the split is the qrels file's name)."""
    import tempfile

    given = {"--corpus": args.corpus, "--queries": args.queries, "--qrels": args.qrels}
    if missing := [flag for flag, value in given.items() if not value]:
        raise ValueError(f"--corpus, --queries and --qrels go together: {' and '.join(missing)} missing")
    if args.dataset_dir:
        raise ValueError("give --dataset-dir or --corpus/--queries/--qrels, not both")
    for flag, value in given.items():
        if not Path(value).is_file():
            raise FileNotFoundError(f"{flag} {value}: no such file")
    if not args.queries.endswith(".jsonl"):
        raise ValueError(f"--queries {args.queries}: give the queries as an uncompressed .jsonl file")
    corpus, qrels = Path(args.corpus).resolve(), Path(args.qrels).resolve()
    split = args.split or qrels.stem
    # A folder of links outside every output, named as the one writer names its temporary folders.
    with tempfile.TemporaryDirectory(prefix=f"matryoshka2d-beir{TEMPORARY_MARK}") as tmp:
        folder = Path(tmp) / (corpus.parent.name or "dataset")
        (folder / "qrels").mkdir(parents=True)
        (folder / ("corpus.jsonl.gz" if corpus.name.endswith(".gz") else "corpus.jsonl")).symlink_to(corpus)
        (folder / "queries.jsonl").symlink_to(Path(args.queries).resolve())
        (folder / "qrels" / f"{split}.tsv").symlink_to(qrels)
        args.corpus = args.queries = args.qrels = None
        args.dataset_dir, args.split = [str(folder)], split
        return cmd_retrieval(args)


def _cascade(args, dirs: list[Path], split: str) -> int:
    """--cascade / --query-layer / --query-model / --storage: flat full-cell search next to the cascade, shallow
    queries, query encoders and storage tiers."""
    import json

    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.cli.retrieval import parse_cascade
    from matryoshka2d.retrieval.cascade import cascade_markdown, evaluate_cascade

    encoder = load_encoder(args, max_length=args.max_length, log=_log)
    result = evaluate_cascade(
        encoder,
        dirs,
        split,
        parse_cascade(args.cascade),
        args.shortlist,
        parse_ints(args.query_layer, "query-layer"),
        args.batch_size,
        _log,
        not args.quiet,
        args.doc_cache,
        [  # a pair folder (export --query-model) stands for its query route
            (e.query_encoder or e)
            for m in args.query_model or ()
            for e in [load_encoder(args, model=m, pooling=None, max_length=args.max_length, log=_log)]
        ],
        args.storage or (),
    )
    out = Path(args.output)
    write_text(out / "cascade.json", json.dumps(result, indent=1) + "\n", "--output")
    write_text(out / "cascade.md", cascade_markdown(result), "--output")
    print(cascade_markdown(result).split("\n\n", 1)[1])
    print(f"-> {out / 'cascade.json'}, {out / 'cascade.md'}")
    return 0


def _cells(values, option: str) -> list[tuple[int, int]]:
    """--cells / --query-cell items: LAYERxDIM (6x384; 6:384 is read too), each checked against the model later."""
    import re

    cells = []
    for value in values or ():
        for part in str(value).replace(",", " ").split():
            match = re.fullmatch(r"(\d{1,9})\s*[xX:]\s*(\d{1,9})", part)
            if match is None or int(match[2]) < 1:
                raise ValueError(f"{option} {part!r}: give LAYERxDIM, e.g. 6x384 (layer 0 is the static cell)")
            cells.append((int(match[1]), int(match[2])))
    return list(dict.fromkeys(cells))


def cmd_mteb(args) -> int:
    """mteb's tasks (local files first, else mteb's by name) on each cell of --cells, mteb's result files in
    OUTPUT/<layer>x<dim>, our grid of main scores in OUTPUT/results.*; a card in the model folder that holds OUTPUT
    gets them as its model-index."""
    from matryoshka2d.evaluate.mteb_run import require_mteb

    require_mteb()  # before anything else: without mteb nothing here runs
    from matryoshka2d.cli.args import check_new_output, load_encoder
    from matryoshka2d.evaluate import mteb_encoder, mteb_tasks
    from matryoshka2d.evaluate.mteb_run import evaluate_mteb
    from matryoshka2d.paths import data_dir

    if args.query_model and args.query_cell:
        raise ValueError("--query-model and --query-cell are each a pair's query side: give one of them")
    cells = _cells(args.cells, "--cells")
    query_cell = _cells([args.query_cell], "--query-cell")[0] if args.query_cell else None
    output = Path(args.output)
    check_new_output(output, args.overwrite)  # results already there are replaced only with --overwrite
    try:
        root = data_dir(args.data_dir)
    except FileNotFoundError:
        if args.data_dir:
            raise
        root = None  # no shared data: the tasks come from --task-dir or from mteb
    catalogue = mteb_tasks.local_catalogue(root, args.task_dir or ())
    names = args.tasks or (mteb_tasks.local_catalogue(None, args.task_dir).names() if args.task_dir else None)
    tasks = mteb_tasks.resolve_tasks(names or ["STSBenchmark"], catalogue)  # before the model loads
    encoder = load_encoder(args, max_length=args.max_length, log=_log)
    full = (encoder.num_layers, query_cell[1] if query_cell else encoder.hidden_size)
    cells = cells or [full]
    documents = mteb_encoder.SharedPass(encoder, cells, args.batch_size, not args.quiet)  # checks every cell
    if args.query_model:
        student = load_encoder(args, model=args.query_model, pooling=None, max_length=args.max_length, log=_log)
        query = mteb_encoder.query_model_side(encoder, student.query_encoder or student, cells, args.batch_size)
    elif query_cell:
        query = mteb_encoder.query_cell_side(encoder, query_cell, cells, args.batch_size)
    else:
        query = mteb_encoder.pair_folder_side(encoder, cells, args.batch_size)
    from matryoshka2d.models.identity import weights_sha256

    revision = weights_sha256(encoder)[:12]  # the weights the cells are cut from name mteb's revision folder
    encoders = {cell: mteb_encoder.CellEncoder(documents, cell, query, revision) for cell in cells}
    shared = [documents, *([query.queries] if query is not None else [])]
    settings = {"query_side": query.label if query is not None else None, "cells": [list(c) for c in cells]}
    result = evaluate_mteb(
        encoders, tasks, output, shared, documents.embedder, settings, batch_size=args.batch_size, log=_log
    )
    code = _finish(result, args.output)
    _refresh_card(encoder, output)
    return code


def _refresh_card(encoder, output: Path) -> None:
    """When OUTPUT lies inside the --model folder and the folder has a card (README.md), the card's front matter
    gets every mteb result in the folder as its model-index (models.card.refresh_model_index); the rest of the card
    is left as it is. The card is the one file of the model folder this writes, allowed here by name of the folder."""
    from matryoshka2d.models.card import refresh_model_index
    from matryoshka2d.outputs import allow_folder

    folder = Path(encoder.location) if encoder.location else None
    if folder is None or not folder.is_dir() or not output.resolve().is_relative_to(folder.resolve()):
        return
    if not (folder / "README.md").is_file():
        _log(f"{folder} has no model card (README.md): none was written; a save of the model writes one with them")
        return
    allow_folder(folder)
    card = refresh_model_index(folder, Path(str(encoder.name)).name)
    if card is not None:
        print(f"model card -> {card} (model-index: the mteb results in {folder})")


def cmd_report(args) -> int:
    from matryoshka2d.cli.report_compression import COMPRESSION_OPTIONS, report_compression
    from matryoshka2d.evaluate.report import write_report

    if args.results[0] == "compression":
        return report_compression(args)
    if given := [name for name in COMPRESSION_OPTIONS if getattr(args, name) not in (None, False)]:
        raise ValueError(f"--{given[0]} belongs to `report compression`; `report RESULTS` puts results side by side")
    paths = write_report(args.results, args.output, names=args.names)
    print(f"report -> {', '.join(map(str, paths))}")
    return 0


# What an evaluation reads (the options each command has) and the files it writes into --output.
EVAL_READS = ("--model", "--data-dir", "--reducer-corpus", "--classification-dir", "--dataset-dir", "--corpus")
EVAL_READS += ("--queries", "--qrels", "--query-model")
EVAL_WRITES = ("results.json", "results.md", "results.csv", "heatmap.png", "cascade.json", "cascade.md", "no-heads")


def _common(p, model_args, caches: tuple[str, ...] = ()) -> None:
    reads_and_writes(p, EVAL_READS, files=EVAL_WRITES, caches=caches)
    model_args(p)
    p.add_argument("--layers", nargs="+", type=layer_ranges, help="layers to evaluate: 1 2 3, 1,2,3 or 1-6")
    p.add_argument("--dims", nargs="+", type=width_ranges, help="leading dims to evaluate: 64 128 384, or 64,128,384")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--max-length", type=token_length, help="truncate texts to this many tokens (default: the model's)")
    p.add_argument("--data-dir", help="shared data root (default: $MATRYOSHKA2D_DATA, else ../shared/data)")
    p.add_argument("--output", required=True, help="directory for results.json/.md/.csv and heatmap.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--backend",
        choices=["torch", "onnx"],
        default="torch",
        help="what computes the cells: torch, or the ONNX graphs `serve --backend onnx` serves (built and cached "
        "the same way; results record each graph's sha256)",
    )
    p.add_argument("--quantize", choices=["int8"], help="onnx backend: score the dynamic int8 graphs")
    p.add_argument(
        "--compare-heads",
        action="store_true",
        help="also score every cell without the exit heads, from the same encoder pass (into OUTPUT/no-heads)",
    )


def register(sub, model_args) -> None:
    esub = command_group(
        sub, "eval", help="evaluate every (layer, dim) cell: sts, classification, retrieval; mteb", dest="task"
    )

    p = command(
        esub,
        "sts",
        cmd_sts,
        help="Spearman x 100 of cosine vs gold on STS12-16, STS-B, SICK-R",
        description="Default cells: every layer x dims 8, 16, 32, ... doubling, and the hidden size.",
    )
    _common(p, model_args)
    p.add_argument("--variant", choices=["raw", "senteval_tok"], default="raw", help="text as released or tokenised")
    p.add_argument("--datasets", nargs="+", help="subset of sts12 sts13 sts14 sts15 sts16 stsb sickr")
    p.add_argument(
        "--reducer",
        choices=["pca", "isomap", "lle"],
        help="reduce each layer's full vector to --dims with a reducer fitted on a corpus (default dims: those "
        "below the hidden size)",
    )
    p.add_argument("--reducer-corpus", help="sentences to fit it on (default: DATA/nli/train_triplets.tsv)")
    p.add_argument(
        "--reducer-samples", type=positive_int, help=f"first N distinct corpus sentences ({REDUCER_SAMPLES})"
    )

    p = command(
        esub,
        "classification",
        cmd_classification,
        help="SentEval-style logistic regression accuracy per cell",
        description="Default cells: layers at each quarter of the depth (minilm-l6: 2, 3, 4, 6) x dims 32, 128 and "
        "the hidden size. Every <name>_{train,dev,test}.tsv or <name>_all.tsv set in the directory is evaluated.",
    )
    _common(p, model_args)
    p.add_argument("--classification-dir", help="folder of <name>_<split>.tsv files (default: DATA/classification)")
    p.add_argument("--datasets", nargs="+", help="names to evaluate (default: all found), e.g. sst2 trec mrpc")
    p.add_argument("--label-column", default="label", help="column holding the class (TREC: label or fine_label)")
    p.add_argument(
        "--folds", type=positive_int, default=10, help="k of the k-fold cross-validation (SentEval test: 10)"
    )
    p.add_argument(
        "--c-patience",
        type=count,
        default=2,
        help="stop the search over C after this many larger values in a row score below the best (2); 0 tries "
        "every C, exactly as SentEval",
    )

    p = command(
        esub,
        "retrieval",
        cmd_retrieval,
        help="nDCG@10, MRR@10, Recall@100 on BEIR-layout folders",
        description="Default cells: every layer x dims 8, 16, 32, ... doubling, and the hidden size.",
    )
    _common(p, model_args, caches=("--doc-cache",))  # the documents' pooled states
    p.add_argument("--dataset-dir", nargs="+", help="BEIR folders (default: DATA/retrieval/scifact)")
    p.add_argument("--split", help="qrels/<split>.tsv (default: test, or the folder's only split)")
    p.add_argument("--corpus", help="a BEIR corpus file (JSON lines: _id, text, title), with --queries and --qrels")
    p.add_argument("--queries", help="a BEIR queries file (JSON lines: _id, text)")
    p.add_argument("--qrels", help="a qrels TSV (query-id, corpus-id, score); the split is its name")
    p.add_argument(
        "--cascade",
        help="small:full cells, e.g. 2:128,6:384: compare a cascade (shortlist from the small cell, rerank with the "
        "full one) with flat full-cell search; writes cascade.json/.md instead of the grid",
    )
    p.add_argument("--shortlist", type=positive_int, default=100, help="cascade candidates from the small cell (100)")
    p.add_argument(
        "--query-layer",
        nargs="+",
        type=layer_ranges,
        help="also encode queries with only this many layers against full-depth documents; several (1,3,5) give "
        "a row each from one document pass",
    )
    p.add_argument(
        "--query-model",
        nargs="+",
        help="query encoders distilled from --model (`distill --mode query`, or `--mode static`: queries at its "
        "layer 0): each a row of its own queries against the model's full-depth documents",
    )
    p.add_argument(
        "--storage",
        nargs="+",
        choices=["float16", "int8", "int8-direct", "binary"],
        help="also search the full cell's documents as an index of this storage holds them (binary and int8-direct: "
        "a --shortlist rescored with float16 vectors, as `search` does), a row each, next to flat float32",
    )
    p.add_argument(
        "--doc-cache",
        help="with --cascade / --query-layer: keep the documents' pooled layer states in this folder, keyed by the "
        "backbone's checksum, pooling, max length and the corpus, so that models sharing a backbone (with and "
        "without heads, other heads) encode the corpus once",
    )

    p = command(
        esub,
        "mteb",
        cmd_mteb,
        help="MTEB's tasks on chosen cells, a query/document pair or layer 0 (needs the mteb extra)",
        description="Runs mteb's tasks through each cell of --cells (default: the full cell): local files first "
        "(the shared data's STS sets by mteb's names STS12-16, STSBenchmark, SICK-R; SciFact; classification sets; "
        "--task-dir), else mteb's task of that name, which loads from the Hugging Face hub. Writes mteb's result files "
        "in OUTPUT/<layer>x<dim> and the grid of main scores x 100 as results.json/.md/.csv and heatmap.png; when "
        f"OUTPUT lies inside the model folder, its card gets them as a model-index. Install: {INSTALL_MTEB}",
    )
    reads_and_writes(p, ("--model", "--query-model", "--data-dir", "--task-dir"), files=EVAL_WRITES[:4])
    model_args(p)
    p.add_argument("--cells", nargs="+", help="LAYERxDIM cells, e.g. 6x384 3x128 0x384 (0: the static cell)")
    p.add_argument(
        "--tasks",
        nargs="+",
        help="task names: a local task of --task-dir or the shared data, else mteb's (default: every --task-dir "
        "task, else STSBenchmark)",
    )
    p.add_argument(
        "--task-dir",
        nargs="+",
        help="local tasks: a BEIR folder (retrieval), an STS .tsv file (sentence1, sentence2, score) or a folder of "
        "<name>_train.tsv / <name>_test.tsv (classification), each named after its folder or file",
    )
    p.add_argument(
        "--query-model",
        help="a pair: this query encoder (`distill --mode query` from --model) for the queries of retrieval tasks, "
        "--model's cells for the documents and every other task",
    )
    p.add_argument(
        "--query-cell",
        metavar="LAYERxDIM",
        help="a pair: this shallow cell of --model for queries, the cells (default: the last layer at DIM) for "
        "documents",
    )
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--max-length", type=token_length, help="truncate texts to this many tokens (default: the model's)")
    p.add_argument("--data-dir", help="shared data root (default: $MATRYOSHKA2D_DATA, else ../shared/data)")
    p.add_argument("--output", required=True, help="folder for a folder of mteb's files per cell and results.*")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --output")
    p.add_argument("--quiet", action="store_true", help="no progress bars")

    p = command(
        sub,
        "report",
        cmd_report,
        help="put results side by side: markdown table and difference heatmaps; `report compression`: what a "
        "width cut or an exit keeps (ESE's Figure 7)",
        description="`report RESULTS...` puts eval results side by side. `report compression --model M [--model M2 "
        "...] --dims K FULL [--exit N]` draws, per model, a t-SNE of the STS-B test sentences at (L, FULL) next to "
        "(L, K) (the width view) and to (N, FULL) (the depth view), with the average distance between each "
        "sentence's two points under each panel (ESE, Figure 7) and two distances that do not depend on the "
        "layout; a results folder named compression is given as ./compression.",
    )
    p.add_argument("results", nargs="+", help="result directories or results.json files (first = baseline)")
    p.add_argument(
        "--output", required=True, help="directory for report.md and diff_*.png (compression: .json/.md/.png)"
    )
    p.add_argument("--names", nargs="+", help="a short name per result, or per --model (default: model names)")
    g = p.add_argument_group("report compression")
    g.add_argument("--model", action="append", help="a model to draw (again for more): " + MODEL_HELP)
    g.add_argument("--pooling", choices=POOLING_CHOICES, help=POOLING_HELP)
    g.add_argument("--device", help=DEVICE_HELP)
    g.add_argument("--layer", type=positive_int, help="L, the layer of the whole vector (default: the model's last)")
    g.add_argument(
        "--dims",
        nargs="+",
        type=width_ranges,
        help="K FULL: the width view, (L, FULL) against its first K numbers (L, K)",
    )
    g.add_argument("--exit", type=positive_int, help="N: the depth view, (L, FULL) against the exit's (N, FULL)")
    g.add_argument("--sentences", type=positive_int, help="the first N distinct STS-B test sentences (default: all)")
    g.add_argument("--seed", type=count, help="t-SNE's random_state (default 0)")
    g.add_argument("--perplexity", type=positive_float, help="t-SNE's perplexity (default 30)")
    g.add_argument(
        "--layout",
        choices=["joint", "separate"],
        help="joint (default): one t-SNE of both sets, cuts zero-padded; separate: a t-SNE per set, the cut's "
        "turned onto the whole's",
    )
    g.add_argument("--data-dir", help="shared data root (default: $MATRYOSHKA2D_DATA, else ../shared/data)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--overwrite", action="store_true", help="replace a compression report already in --output")
    reads_and_writes(
        p,
        ("results", "--model", "--data-dir"),
        files=("report.md", "compression.json", "compression.md", "compression.png"),
    )
