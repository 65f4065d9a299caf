"""`matryoshka2d eval mteb`: MTEB's tasks on chosen cells (a pair's query side included), mteb's own files a folder
per cell and our grid of main scores as results.*; added to the `eval` group by cli/evaluate.py."""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.cli.args import check_new_output, command, load_encoder, positive_int, reads_and_writes, token_length
from matryoshka2d.cli.results import RESULT_FILES, log, write_results
from matryoshka2d.evaluate.mteb_run import INSTALL as INSTALL_MTEB  # mteb itself: by `eval mteb` only


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
    """The options read into one request for evaluate.mteb_run.run_eval_mteb, which runs the command."""
    from matryoshka2d.evaluate.mteb_run import MtebRequest, require_mteb, run_eval_mteb

    require_mteb()  # before anything else: without mteb nothing here runs
    if args.query_model and args.query_cell:
        raise ValueError("--query-model and --query-cell are each a pair's query side: give one of them")
    request = MtebRequest(
        output=Path(args.output),
        cells=_cells(args.cells, "--cells"),
        tasks=args.tasks,
        task_dirs=args.task_dir or [],
        data_dir=args.data_dir,
        query_model=args.query_model,
        query_cell=_cells([args.query_cell], "--query-cell")[0] if args.query_cell else None,
        batch_size=args.batch_size,
        show_progress=not args.quiet,
    )
    check_new_output(request.output, args.overwrite)  # results already there are replaced only with --overwrite

    def load_model(model: str | None = None, **options):
        return load_encoder(args, model=model, max_length=args.max_length, log=log, **options)

    return run_eval_mteb(request, load_model, lambda result: write_results(result, args.output), log)


def add_mteb_command(esub, model_args) -> None:
    """`eval mteb`, a subcommand of the `eval` group `esub`."""
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
    reads_and_writes(p, ("--model", "--query-model", "--data-dir", "--task-dir"), files=RESULT_FILES)
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
