#!/usr/bin/env bash
# The training benchmark protocol (issue 4): minilm-l6, the shared NLI triplets, batch 32, seed 42, every
# method with the AnglE loss, sentence-transformers' Matryoshka2dLoss as a peer, and a separately trained
# (2,128) model. Then: python benchmarks/protocol_report.py --runs OUT scores them all on the STS grid.
#
#   benchmarks/train_protocol.sh [DATA_DIR] [OUT_DIR]
#   STEPS=200 ...         shorter runs (default: one epoch, 449 steps for the 14,344 triplets)
#   LANE=a|b THREADS=1    run half of the list in each of two processes of one thread each: on a 2-core
#                         machine two 1-thread lanes train more steps per second than one 2-thread process
#   EXTRA=1               also our 2dmse with InfoNCE (the peer's loss) and separate models at (1,64), (3,128)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-runs/protocol}
BIN=${BIN:-.venv/bin}
TRIPLETS="$DATA/nli/train_triplets.tsv"
STEPS_ARG=()
[ -n "${STEPS:-}" ] && STEPS_ARG=(--steps "$STEPS")
[ -n "${THREADS:-}" ] && export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
mkdir -p "$OUT"
run() {  # name, then train options; a finished run is skipped, an interrupted one resumes
  local name=$1; shift
  if [ -f "$OUT/$name/matryoshka2d.json" ]; then echo "== $name: done already"; return; fi
  echo "== $name: $* (${STEPS:-one epoch})"
  "$BIN/matryoshka2d" train --model minilm-l6 --data "$TRIPLETS" --batch-size 32 --seed 42 \
    --output "$OUT/$name" --resume "${STEPS_ARG[@]}" "$@"
}
peer() {
  if [ -f "$OUT/st-matryoshka2d/peer_run.json" ]; then echo "== st-matryoshka2d: done already"; return; fi
  echo "== st-matryoshka2d (${STEPS:-one epoch})"
  "$BIN/python" benchmarks/peer_st_matryoshka2d.py --data "$TRIPLETS" --output "$OUT/st-matryoshka2d" "${STEPS_ARG[@]}"
}
lane=${LANE:-all}
if [ "$lane" = a ] || [ "$lane" = all ]; then
  run 2dmse --method 2dmse --loss angle
  run mrl --method mrl --loss angle
  run ese --method ese --loss angle
fi
if [ "$lane" = b ] || [ "$lane" = all ]; then
  run plain --method plain --loss angle
  run starbucks --method starbucks --loss angle
  peer
  run separate-2-128 --method separate --layer 2 --dim 128 --loss angle
fi
if [ "${EXTRA:-0}" = 1 ]; then
  run 2dmse-infonce --method 2dmse --loss infonce
  run separate-1-64 --method separate --layer 1 --dim 64 --loss angle
  run separate-3-128 --method separate --layer 3 --dim 128 --loss angle
fi
