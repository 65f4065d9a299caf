#!/usr/bin/env bash
# Issue 34's measurements, step by step (docs/distill.md gives what each one measured and how long it took):
#   shared   `distill --mode shared` of the untouched minilm-l6 on the shared NLI triplets' sentences, then `eval sts`
#   query    `distill --mode query --layer 3`, same teacher and sentences, then `eval sts` (the student is a cell)
#   scifact  query encoders of 3 and 2 layers trained on the SciFact corpus (passages of at most 48 tokens, about
#            a sentence or two: the size of a claim) and the NLI sentences, no query; the loss on the full width only
#            (the index is the teacher's full vectors), lr 2e-4, 3 epochs (layer 3) and 2 (layer 2); `eval retrieval`
#            on half B of the 809 train queries (benchmarks/scifact_halves.py),
#            the teacher's flat search in the same run; one-query time against the teacher (query_latency.py)
#   heads    the heads recipe's model (benchmarks/heads_wiseft_recipe.sh) as teacher, `--mode shared`, `eval sts`
#   mpnet    `--mode shared` of mpnet-base on 10,000 NLI sentences, the bare command (its recipe chooses 5 epochs
#            at lr 3e-4: a 12-layer model's layer-3 exit needs more steps and a larger rate than minilm's), next to
#            closed-form heads on the same sentences
#
#   benchmarks/distill_recipe.sh [STEP ...]      (default: every step; OUT=runs/distill, THREADS=1)
# Knobs (env): HEADS_EPOCHS (3.5); MPNET_EPOCHS and MPNET_LR (unset: distill's recipe chooses).
# No step sees an STS test sentence (distill and heads fit leave them out) or a SciFact query that is scored. Every
# step is skipped when its output is there, and every run resumes from its last checkpoint, so a killed run goes on.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
OUT=${OUT:-runs/distill}
BIN=${BIN:-.venv/bin}
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1} MATRYOSHKA2D_DATA="$DATA"
NLI="$DATA/nli/train_triplets.tsv"
STEPS_WANTED=("${@:-shared query scifact heads mpnet}")
mkdir -p "$OUT"

wanted() { [[ " ${STEPS_WANTED[*]} " == *" $1 "* ]]; }
distill() {  # distill NAME OPTIONS...: a run into $OUT/NAME, resumed if it was killed
  local name=$1
  shift
  [ -f "$OUT/$name/matryoshka2d.json" ] || "$BIN/matryoshka2d" distill "$@" --output "$OUT/$name" --resume --quiet
}
sts() { [ -f "$1/sts/results.json" ] || "$BIN/matryoshka2d" eval sts --model "$1" --output "$1/sts" --quiet; }

if wanted shared; then
  echo "== shared: every exit of minilm-l6 towards its last layer"
  distill shared --teacher minilm-l6 --data "$NLI" --epochs 3.5 --eval-cell 1:64,2:128,3:128,6:384
  sts "$OUT/shared"
fi
if wanted query; then
  echo "== query: a 3-layer query encoder of minilm-l6"
  distill query3 --teacher minilm-l6 --mode query --layer 3 --data "$NLI" --epochs 4 --eval-cell 3:384,3:128
  sts "$OUT/query3"
fi
if wanted scifact; then
  echo "== scifact: 3- and 2-layer query encoders on the corpus and the NLI sentences"
  [ -f "$OUT/scifact-halves/split.json" ] || "$BIN/python" benchmarks/scifact_halves.py --data "$DATA" --output "$OUT/scifact-halves"
  for n in 3 2; do
    epochs=$n  # 3 epochs for the 3-layer encoder, 2 for the 2-layer one (what one session's CPU time allowed)
    # the same texts and teacher: the 2-layer run reads the 3-layer run's targets (a resumed run checks their
    # texts, teacher and checksum before it uses them) instead of computing them again
    if [ "$n" = 2 ] && [ ! -e "$OUT/scifact-query2" ] && [ -f "$OUT/scifact-query3/teacher-targets/targets.json" ]; then
      mkdir -p "$OUT/scifact-query2" && cp -r "$OUT/scifact-query3/teacher-targets" "$OUT/scifact-query2/"
    fi
    distill "scifact-query$n" --teacher minilm-l6 --mode query --layer "$n" --data "$DATA/retrieval/scifact" "$NLI" \
      --max-length 48 --widths 384 --lr 2e-4 --epochs "$epochs"
  done
  [ -f "$OUT/scifact-eval/cascade.json" ] || "$BIN/matryoshka2d" eval retrieval --model minilm-l6 \
    --dataset-dir "$OUT/scifact-halves" --split half_b --query-layer 3 2 \
    --query-model "$OUT/scifact-query3" "$OUT/scifact-query2" --output "$OUT/scifact-eval" --quiet
  [ -f "$OUT/scifact-latency.md" ] || "$BIN/python" benchmarks/query_latency.py --model minilm-l6 \
    --query-models "$OUT/scifact-query3" "$OUT/scifact-query2" > "$OUT/scifact-latency.md"
  cat "$OUT/scifact-eval/cascade.md" "$OUT/scifact-latency.md"
fi
if wanted heads; then
  echo "== heads: the heads recipe's model as teacher"
  OUT_HEADS=${OUT_HEADS:-runs/heads-wiseft}
  benchmarks/heads_wiseft_recipe.sh "$DATA" "$OUT_HEADS"
  teacher=$(ls -d "$OUT_HEADS"/wiseft-* | head -1)
  distill heads-shared --teacher "$teacher" --data "$NLI" --epochs "${HEADS_EPOCHS:-3.5}" --eval-cell 3:128,6:384
  sts "$OUT/heads-shared"
fi
if wanted mpnet; then
  echo "== mpnet: mpnet-base on 10,000 NLI sentences, closed-form heads beside"
  make mpnet > /dev/null
  [ -f "$OUT/mpnet-heads/matryoshka2d.json" ] || "$BIN/matryoshka2d" heads fit --model mpnet-base --data "$NLI" \
    --max-sentences 10000 --output "$OUT/mpnet-heads" --quiet
  distill mpnet-shared --teacher mpnet-base --data "$NLI" --max-texts 10000 \
    ${MPNET_EPOCHS:+--epochs "$MPNET_EPOCHS"} ${MPNET_LR:+--lr "$MPNET_LR"}
  for m in mpnet-heads mpnet-shared; do
    [ -f "$OUT/$m/sts/results.json" ] || "$BIN/matryoshka2d" eval sts --model "$OUT/$m" --layers 3 6 9 12 \
      --dims 128 768 --output "$OUT/$m/sts" --quiet
  done
fi
