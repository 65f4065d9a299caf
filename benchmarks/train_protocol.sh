#!/usr/bin/env bash
# The training benchmark protocol (issue 4): minilm-l6, the shared NLI triplets, one epoch, batch 32, seed 42,
# every method with the AnglE loss; 2dmse also with InfoNCE next to sentence-transformers' Matryoshka2dLoss
# (MultipleNegativesRankingLoss = InfoNCE), and the separately-trained baselines at the three reported cells.
# Usage: benchmarks/train_protocol.sh [DATA_DIR] [OUT_DIR]; then benchmarks/protocol_report.py scores them.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
OUT=${2:-runs/protocol}
BIN=${BIN:-.venv/bin}
TRIPLETS="$DATA/nli/train_triplets.tsv"
mkdir -p "$OUT"
run() {  # name, then train options
  local name=$1; shift
  if [ -f "$OUT/$name/matryoshka2d.json" ]; then echo "== $name: done already"; return; fi
  echo "== $name: $*"
  "$BIN/matryoshka2d" train --model minilm-l6 --data "$TRIPLETS" --batch-size 32 --seed 42 \
    --output "$OUT/$name" --resume "$@"
}
run ese --method ese --loss angle
run 2dmse --method 2dmse --loss angle
run plain --method plain --loss angle
run starbucks --method starbucks --loss angle
run mrl --method mrl --loss angle
run 2dmse-infonce --method 2dmse --loss infonce
if [ ! -f "$OUT/st-matryoshka2d/peer_run.json" ]; then
  "$BIN/python" benchmarks/peer_st_matryoshka2d.py --data "$TRIPLETS" --output "$OUT/st-matryoshka2d"
fi
run separate-2-128 --method separate --layer 2 --dim 128 --loss angle
run separate-1-64 --method separate --layer 1 --dim 64 --loss angle
run separate-3-128 --method separate --layer 3 --dim 128 --loss angle
