"""`matryoshka2d eval retrieval`: nDCG@10, MRR@10 and Recall@100 of every cell on BEIR folders (or on three files
of one data set); with --cascade, --query-layer, --query-model or --storage, the cascade evaluation instead
(cascade.json/.md). Added to the `eval` group by cli/evaluate.py."""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.cli.args import Numbers, cascade_cells, command, layer_list, positive_int
from matryoshka2d.cli.grid import cell_embedder, check_layers, evaluate_into_output, grid_options
from matryoshka2d.cli.results import log

CASCADE_OPTIONS = ("cascade", "query_layer", "query_model", "storage")  # each turns the cascade evaluation on


def cmd_retrieval(args) -> int:
    check_layers(args)
    cascade = any(getattr(args, name) for name in CASCADE_OPTIONS)
    if args.doc_cache and not cascade:
        raise ValueError(
            "--doc-cache keeps the documents' pooled states for --cascade, --query-layer, --query-model or "
            "--storage; a grid evaluation does not use it"
        )
    if cascade and args.backend != "torch":
        raise ValueError(
            "--backend onnx scores grids; --cascade, --query-layer, --query-model and --storage run on torch"
        )
    if any((args.corpus, args.queries, args.qrels)):
        return _from_files(args, cascade)
    dirs = [Path(d) for d in args.dataset_dir] if args.dataset_dir else [_data_root(args) / "retrieval/scifact"]
    return _evaluate(args, dirs, _split(dirs, args.split), cascade)


def _data_root(args) -> Path:
    from matryoshka2d.paths import data_dir

    return data_dir(args.data_dir)


def _split(dirs: list[Path], split: str | None) -> str:
    """--split, else the split every folder has (test, or its only qrels file)."""
    from matryoshka2d.beir import qrels_split

    splits = {qrels_split(d, split) for d in dirs}
    if len(splits) > 1:
        raise ValueError(f"the dataset folders would use different splits ({', '.join(sorted(splits))}); pass --split")
    log(f"retrieval split: {(split := splits.pop())}")
    return split


def _from_files(args, cascade: bool) -> int:
    """--corpus, --queries and --qrels: the three files of one data set wherever they are, read as a BEIR folder
    (beir.linked_beir_folder: links, named after the corpus's folder; the split is the qrels file's name)."""
    from matryoshka2d.beir import linked_beir_folder

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
    with linked_beir_folder(args.corpus, args.queries, args.qrels, args.split) as (folder, split):
        log(f"retrieval split: {split}")
        return _evaluate(args, [folder], split, cascade)


def _evaluate(args, dirs: list[Path], split: str, cascade: bool) -> int:
    if cascade:
        return _cascade(args, dirs, split)
    from matryoshka2d.evaluate.retrieval import evaluate_retrieval

    return evaluate_into_output(
        args, lambda cells: evaluate_retrieval(cells, dirs, split=split, log=log), cell_embedder(args)
    )


def _cascade(args, dirs: list[Path], split: str) -> int:
    """Flat full-cell search next to the cascade, shallow queries, query encoders and storage tiers."""
    from matryoshka2d.cli.args import load_encoder
    from matryoshka2d.retrieval.cascade import cascade_markdown
    from matryoshka2d.retrieval.cascade_results import write_cascade_evaluation

    encoder = load_encoder(args, max_length=args.max_length, log=log)
    students = [  # a pair folder (export --query-model) stands for its query route
        student.query_encoder or student
        for model in args.query_model or ()
        for student in [load_encoder(args, model=model, pooling=None, max_length=args.max_length, log=log)]
    ]
    result, paths = write_cascade_evaluation(
        args.output,
        encoder,
        dirs,
        split,
        cascade=args.cascade,
        shortlist=args.shortlist,
        query_layers=args.query_layer,
        batch_size=args.batch_size,
        log=log,
        show_progress=not args.quiet,
        doc_cache=args.doc_cache,
        query_encoders=students,
        storages=args.storage or (),
    )
    print(cascade_markdown(result).split("\n\n", 1)[1])
    print(f"-> {', '.join(map(str, paths))}")
    return 0


def add_retrieval_command(esub, model_args) -> None:
    """`eval retrieval`, a subcommand of the `eval` group `esub`."""
    p = command(
        esub,
        "retrieval",
        cmd_retrieval,
        help="nDCG@10, MRR@10, Recall@100 on BEIR-layout folders",
        description="Default cells: every layer x dims 8, 16, 32, ... doubling, and the hidden size.",
    )
    grid_options(p, model_args, caches=("--doc-cache",))  # the documents' pooled states
    p.add_argument("--dataset-dir", nargs="+", help="BEIR folders (default: DATA/retrieval/scifact)")
    p.add_argument("--split", help="qrels/<split>.tsv (default: test, or the folder's only split)")
    p.add_argument("--corpus", help="a BEIR corpus file (JSON lines: _id, text, title), with --queries and --qrels")
    p.add_argument("--queries", help="a BEIR queries file (JSON lines: _id, text)")
    p.add_argument("--qrels", help="a qrels TSV (query-id, corpus-id, score); the split is its name")
    _cascade_options(p)


def _cascade_options(p) -> None:
    p.add_argument(
        "--cascade",
        type=cascade_cells,
        help="small:full cells, e.g. 2:128,6:384: compare a cascade (shortlist from the small cell, rerank with the "
        "full one) with flat full-cell search; writes cascade.json/.md instead of the grid",
    )
    p.add_argument("--shortlist", type=positive_int, default=100, help="cascade candidates from the small cell")
    p.add_argument(
        "--query-layer",
        nargs="+",
        type=layer_list,
        action=Numbers,
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
