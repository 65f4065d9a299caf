"""`matryoshka2d eval sts|classification|retrieval|mteb`: the `eval` group, with `sts` and `classification` here;
`retrieval` (cli/eval_retrieval.py) and `mteb` (cli/mteb.py) are added from their own modules.

Each grid evaluation builds the default cell embedder (one encoder pass per dataset, widths by slicing), runs the
evaluator and writes results.json, results.md, results.csv and heatmap.png into --output (cli/grid.py).
"""

from __future__ import annotations

from pathlib import Path

from matryoshka2d.cli.args import command, command_group, count, positive_int
from matryoshka2d.cli.eval_retrieval import add_retrieval_command
from matryoshka2d.cli.grid import cell_embedder, check_layers, evaluate_into_output, grid_options
from matryoshka2d.cli.mteb import add_mteb_command
from matryoshka2d.cli.results import log

REDUCER_SAMPLES = 2000  # corpus sentences a reducer is fitted on, unless --reducer-samples says


def cmd_sts(args) -> int:
    from matryoshka2d.evaluate.sts import evaluate_sts
    from matryoshka2d.paths import data_dir

    check_layers(args)
    if not args.reducer and (args.reducer_corpus or args.reducer_samples is not None):
        raise ValueError("--reducer-corpus and --reducer-samples set how --reducer is fitted; they need --reducer")
    if args.reducer and args.backend != "torch":  # before the model loads or a graph is built
        raise ValueError(
            f"--reducer {args.reducer} reduces the vectors torch computes; it does not run on --backend "
            f"{args.backend} (the served graphs give truncated cells): drop one of them"
        )
    if args.reducer and args.compare_heads:
        raise ValueError("--compare-heads and --reducer exclude each other: a reducer makes its own cells")
    root = data_dir(args.data_dir)
    embedder = cell_embedder(args)
    if args.reducer:  # post-hoc PCA / Isomap / LLE cells instead of truncated ones (matryoshka2d.compress.reducers)
        from matryoshka2d.compress.reducers import reducer_cells

        samples = args.reducer_samples or REDUCER_SAMPLES
        embedder = reducer_cells(embedder, args.reducer, args.dims, args.reducer_corpus, root, samples, log)
    return evaluate_into_output(
        args, lambda cells: evaluate_sts(cells, root, variant=args.variant, datasets=args.datasets, log=log), embedder
    )


def cmd_classification(args) -> int:
    from matryoshka2d.evaluate.classification import default_cells, evaluate_classification
    from matryoshka2d.paths import data_dir

    check_layers(args)
    directory = Path(args.classification_dir) if args.classification_dir else data_dir(args.data_dir) / "classification"
    options = {"label_column": args.label_column, "folds": args.folds, "log": log, "patience": args.c_patience}
    return evaluate_into_output(
        args,
        lambda cells: evaluate_classification(cells, directory, datasets=args.datasets, **options),
        cell_embedder(args, default_cells),
    )


def register(sub, model_args) -> None:
    esub = command_group(
        sub, "eval", help="evaluate every (layer, dim) cell: sts, classification, retrieval; mteb", dest="task"
    )
    _add_sts_command(esub, model_args)
    _add_classification_command(esub, model_args)
    add_retrieval_command(esub, model_args)
    add_mteb_command(esub, model_args)


def _add_sts_command(esub, model_args) -> None:
    p = command(
        esub,
        "sts",
        cmd_sts,
        help="Spearman x 100 of cosine vs gold on STS12-16, STS-B, SICK-R",
        description="Default cells: every layer x dims 8, 16, 32, ... doubling, and the hidden size.",
    )
    grid_options(p, model_args)
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


def _add_classification_command(esub, model_args) -> None:
    p = command(
        esub,
        "classification",
        cmd_classification,
        help="SentEval-style logistic regression accuracy per cell",
        description="Default cells: layers at each quarter of the depth (minilm-l6: 2, 3, 4, 6) x dims 32, 128 and "
        "the hidden size. Every <name>_{train,dev,test}.tsv or <name>_all.tsv set in the directory is evaluated.",
    )
    grid_options(p, model_args)
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
        help="stop the search over C after this many larger values in a row score below the best; 0 tries "
        "every C, exactly as SentEval",
    )
