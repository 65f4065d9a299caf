#!/usr/bin/env bash
# Issue 18's 2D recipe with exit heads, step by step, none of which sees an STS test sentence:
#   1. stacked exit heads fitted in closed form on the untouched minilm-l6, on the sentences of every NLI file of
#      the shared data but SICK's (`heads fit` leaves out the sentences of the STS test sets);
#   2. starbucks at the protocol of record (nli/train_triplets.tsv, batch 32, lr 5e-5, seed 42, STEPS=150, one
#      thread) from those heads, trained along at 5e-5, with the rows holding an STS test sentence left out;
#   3. WiSE-FT between the run and its start at each alpha of ALPHAS, scored on STS-B dev (and the test sets, to
#      report); the alpha with the best dev mean of the four shallow columns is merged (`matryoshka2d merge`);
#   4. `eval sts` of the merged folder.
#
#   benchmarks/heads_wiseft_recipe.sh [DATA_DIR] [OUT_DIR]      (docs/exit-heads.md; about 50 minutes, one thread)
#   ALPHAS="0 0.5 0.6 0.7 0.8 1"                                 the grid dev chooses from (this is the default)
# Every step is skipped when its output is there, and the training run resumes, so a killed run goes on.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-runs/heads-wiseft}
BIN=${BIN:-.venv/bin}
ALPHAS=${ALPHAS:-0 0.5 0.6 0.7 0.8 1}
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1} MATRYOSHKA2D_DATA="$DATA"
mkdir -p "$OUT"
# train_triplets first, then the other files by name: the order decides which tenth is held out in the fit
mapfile -t NLI < <(echo "$DATA/nli/train_triplets.tsv"; ls "$DATA"/nli/*.tsv | grep -v -e '/sick_' -e '/train_triplets.tsv$')
if [ ! -f "$OUT/start/matryoshka2d.json" ]; then
  echo "== 1. heads fit on ${#NLI[@]} NLI files"
  "$BIN/matryoshka2d" heads fit --model minilm-l6 --inputs stack --exclude-sts-test --data "${NLI[@]}" --output "$OUT/start"
fi
if [ ! -f "$OUT/run/matryoshka2d.json" ]; then
  echo "== 2. starbucks, ${STEPS:-150} steps"
  "$BIN/matryoshka2d" train --model "$OUT/start" --data "$DATA/nli/train_triplets.tsv" --batch-size 32 --lr 5e-5 \
    --seed 42 --steps "${STEPS:-150}" --output "$OUT/run" --resume --quiet --exclude-sts-test --method starbucks \
    --exit-heads keep --exit-heads-lr 5e-5 --sizes 1:64,2:128,3:128,4:256,5:384,6:384
fi
if [ ! -f "$OUT/alphas.md" ]; then
  echo "== 3. WiSE-FT at alphas $ALPHAS"
  # shellcheck disable=SC2086  # one argument per alpha
  "$BIN/python" benchmarks/wise_ft_alphas.py --run "$OUT/run" --start "$OUT/start" --alphas $ALPHAS --test \
    --data "$DATA" > "$OUT/alphas.md.part"
  mv "$OUT/alphas.md.part" "$OUT/alphas.md"
fi
cat "$OUT/alphas.md"
alpha=$(sed -n "s/^dev's choice .*: alpha \([0-9.]*\)$/\1/p" "$OUT/alphas.md")
merged="$OUT/wiseft-$alpha"
if [ ! -f "$merged/matryoshka2d.json" ]; then
  "$BIN/matryoshka2d" merge --models "$OUT/run" "$OUT/start" --weights "$alpha" "$("$BIN/python" -c "print(round(1 - $alpha, 6))")" \
    --output "$merged"
fi
[ -d "$merged/sts" ] || "$BIN/matryoshka2d" eval sts --model "$merged" --output "$merged/sts" --quiet
echo "== done: $merged (alpha $alpha); its STS scores are in $merged/sts/results.md"
