#!/usr/bin/env bash
# The training benchmark protocol (issues 4 and 8): minilm-l6, the shared NLI triplets, batch 32, lr 5e-5,
# seed 42, every method with its default loss, sentence-transformers' Matryoshka2dLoss as a peer, and models
# trained separately at (1,64), (2,128), (3,128). Then: python benchmarks/protocol_report.py --runs OUT scores them all on the STS grid.
#
#   benchmarks/train_protocol.sh [DATA_DIR] [OUT_DIR]
#   STEPS=200 ...         shorter runs (default: one epoch, 449 steps for the 14,344 triplets)
#   LANE=a|b THREADS=1    run half of the list in each of two processes of one thread each: on a 2-core
#                         machine two 1-thread lanes train more steps per second than one 2-thread process
#   EXTRA=1               also the ablations and the presets of the references' recipes (see the end)
#   ONLY="a b"            only the runs of these names (from the whole list, ablations included), e.g. to
#                         spread them over lanes by hand: ONLY="separate-1-64 ese-angle-emb"
#   HEADS=1               also the methods with exit heads trained along (issue 18; ONLY="ese-heads" picks one)
#   DEVICE=cuda           train on a GPU (the peer too)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-runs/protocol}
BIN=${BIN:-.venv/bin}
TRIPLETS="$DATA/nli/train_triplets.tsv"
STEPS_ARG=()
DEVICE_ARG=()
[ -n "${DEVICE:-}" ] && DEVICE_ARG=(--device "$DEVICE")
[ -n "${STEPS:-}" ] && STEPS_ARG=(--steps "$STEPS")
[ -n "${THREADS:-}" ] && export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
mkdir -p "$OUT"
wanted() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
run() {  # name, then train options; a finished run is skipped, an interrupted one resumes
  local name=$1; shift
  wanted "$name" || return 0
  if [ -f "$OUT/$name/matryoshka2d.json" ]; then echo "== $name: done already"; return; fi
  echo "== $name: $* (${STEPS:-one epoch})"
  "$BIN/matryoshka2d" train --model minilm-l6 --data "$TRIPLETS" --batch-size 32 --lr 5e-5 --seed 42 \
    --output "$OUT/$name" --resume "${STEPS_ARG[@]}" "${DEVICE_ARG[@]}" "$@"
}
peer() {
  wanted st-matryoshka2d || return 0
  if [ -f "$OUT/st-matryoshka2d/peer_run.json" ]; then echo "== st-matryoshka2d: done already"; return; fi
  echo "== st-matryoshka2d (${STEPS:-one epoch})"
  "$BIN/python" benchmarks/peer_st_matryoshka2d.py --data "$TRIPLETS" --output "$OUT/st-matryoshka2d" "${STEPS_ARG[@]}" "${DEVICE_ARG[@]}"
}
lane=${LANE:-all}
[ -n "${ONLY:-}" ] && lane=all EXTRA=1 HEADS=1  # the names choose
# Every method with its default loss (issue 8: the loss follows the kind of data; triplets -> angle-emb's AnglE).
# Two lanes of about the same length (a separate model runs only its own layers).
if [ "$lane" = a ] || [ "$lane" = all ]; then
  run plain --method plain
  run 2dmse --method 2dmse
  run ese --method ese
  peer
fi
if [ "$lane" = b ] || [ "$lane" = all ]; then
  run starbucks --method starbucks
  run separate-2-128 --method separate --layer 2 --dim 128
  run ese-compress-scaled --method ese --method-option beta=1 --method-option compress_target=scaled
  run separate-1-64 --method separate --layer 1 --dim 64
  run separate-3-128 --method separate --layer 3 --dim 128
fi
# Exit heads trained with the backbone (issue 18): each shallow view goes through its exit head; the heads start
# from the closed-form fit on the training sentences and learn at their own rate.
if [ "${HEADS:-0}" = 1 ]; then
  for method in ese 2dmse starbucks; do
    run "$method-heads" --method "$method" --exit-heads fit --exit-heads-lr 5e-4
  done
  run separate-3-128-heads --method separate --layer 3 --dim 128 --exit-heads fit --exit-heads-lr 5e-4
fi
# The ablations and the references' recipes (presets), when there is time for them.
if [ "${EXTRA:-0}" = 1 ]; then
  run ese-compress-paper --method ese --method-option beta=1 --method-option compress_target=dependency
  run ese-angle-emb --preset ese-angle-emb
  run st-recipe --preset st-matryoshka2d
  run 2dmse-paper --preset 2dmse-paper
  run 2dmse-angle-0.3 --preset 2dmse-angle-0.3
  run 2dmse-authors --preset 2dmse-authors
  run ese-paper --preset ese-paper
  run 2dmse-dedup --method 2dmse --filter-duplicates                           # issue 21 item 7
  run 2dmse-wd-exempt --method 2dmse --weight-decay-exempt norm-and-bias       # issue 21 item 12
  run starbucks-paper --preset starbucks-paper
  run 2dmse-infonce --method 2dmse --loss infonce
  run mrl --method mrl
  run plain-old-angle --method plain --loss angle --loss-option cosine_weight=1 --loss-option angle_weight=1 \
    --loss-option angle_scale=1 --loss-option cln_weight=0
fi
