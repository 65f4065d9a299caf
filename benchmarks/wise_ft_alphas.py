"""WiSE-FT between a trained run and the model it started from, at several alphas: STS-B dev at issue 18's cells
(what chooses alpha) and, with --test, the STS 7-set averages there (what reports).

Each alpha's model is alpha x RUN + (1 - alpha) x START, every weight alike, exit heads included: the average that
`matryoshka2d merge --models RUN START --weights ALPHA 1-ALPHA` writes (training/merge.py), made here in memory.
Columns: (N, D), the shallow average (layers 1..N-1 at full width), (1,64), (2,128), (3,128), (N-1, D); dev's
"mean" is the mean of the four shallow columns, the number `benchmarks/sts_dev_cells.py` ranks runs by; the last
line names the alpha with the highest one (`benchmarks/heads_wiseft_recipe.sh` merges there).

    python benchmarks/wise_ft_alphas.py --run runs/protocol-r3/RUN --start runs/heads-minilm-stack-affine \
        --alphas 0 0.5 0.6 0.7 0.8 1 --test
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import DEFAULT_DATA, header
from matryoshka2d.evaluate.sts import STS_SETS, load_pairs, sts_file
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.paths import sts_dev_file
from matryoshka2d.training.merge import merge_encoders
from sts_dev_cells import cell_columns


def averaged(run: str, start: str, alpha: float) -> ElasticEncoder:
    encoders = [ElasticEncoder(run, device="cpu"), ElasticEncoder(start, device="cpu")]
    return merge_encoders(encoders, [alpha, 1.0 - alpha])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="the trained model folder")
    parser.add_argument("--start", required=True, help="the folder it was trained from (same heads layout)")
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.0, 0.5, 0.6, 0.7, 0.8, 1.0])
    parser.add_argument("--test", action="store_true", help="also the STS 7-set averages (slower: 7 more passes)")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="the shared data folder (STS sets)")
    args = parser.parse_args()
    print(header())
    dev = load_pairs(sts_dev_file())
    tests = [load_pairs(sts_file(Path(args.data), "raw", name), name) for name in STS_SETS] if args.test else []
    first, dev_means = True, {}
    for alpha in args.alphas:
        encoder = averaged(args.run, args.start, alpha)
        on_dev = cell_columns(encoder, dev)
        names = list(on_dev)
        if first:
            test_names = [f"test {n}" for n in names] if tests else []
            print("| alpha | " + " | ".join([f"dev {n}" for n in names] + ["dev mean"] + test_names) + " |")
            print("|---:|" + "---:|" * (len(names) + 1 + len(test_names)))
            first = False
        row = [*on_dev.values(), float(np.mean([on_dev[n] for n in names[1:5]]))]
        dev_means[alpha] = row[-1]
        if tests:
            per_set = [cell_columns(encoder, pairs) for pairs in tests]
            row += [float(np.mean([s[n] for s in per_set])) for n in names]
        print(f"| {alpha:g} | " + " | ".join(f"{v:.2f}" for v in row) + " |", flush=True)
    chosen = max(dev_means, key=dev_means.get)  # the first of equals: the order given
    print(f"dev's choice (highest dev mean of the four shallow columns, {dev_means[chosen]:.4f}): alpha {chosen:g}")


if __name__ == "__main__":
    main()
