#!/usr/bin/env bash
# The serving comparison of issue 19 (benchmarks/serve_load.py against infinity), with the machine's training
# runs paused during each timed span. serve_load.py continues them after every span itself; this trap is the
# second guard: whatever happens to the benchmark (an error, a kill), they are continued when this script ends.
#
#   benchmarks/serve_vs_peers.sh [serve_load.py arguments...]
set -u
cd "$(dirname "$0")/.."
PATTERN="matryoshka2d"" train"  # split so that this script's own command line never matches it
trap 'pkill -CONT -f "$PATTERN"' EXIT INT TERM HUP
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} "${PYTHON:-python}" benchmarks/serve_load.py --pause-training "$@"
