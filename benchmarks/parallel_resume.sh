#!/usr/bin/env bash
# A 2-process run of 50 steps on minilm-l6, killed with SIGKILL after its step-30 checkpoint, resumed;
# then the same run uninterrupted; the two final models are compared (issue 11). Usage: benchmarks/parallel_resume.sh
cd "$(dirname "$0")/.."
OUT=runs/ddp-resume
rm -rf $OUT; mkdir -p $OUT
ARGS=(train --model minilm-l6 --data ../shared/data/nli/train_triplets.tsv --method 2dmse --batch-size 16 --steps 50
      --save-steps 10 --processes 2)
date -u +"%F %T start"
setsid .venv/bin/matryoshka2d "${ARGS[@]}" --output $OUT/killed > $OUT/killed.log 2>&1 &
PID=$!
until [ -d $OUT/killed/checkpoints/step-0000030 ]; do sleep 1; done
sleep 3
echo "processes of the run before the kill:"; ps -o pid,args --no-headers -g $PID | cut -c1-100
kill -9 -- -$PID
date -u +"%F %T killed with SIGKILL (process group $PID)"
sleep 2
ls $OUT/killed/checkpoints
.venv/bin/matryoshka2d "${ARGS[@]}" --output $OUT/killed --resume > $OUT/resumed.log 2>&1; echo "resume exit $?"
grep -h "resumed from" $OUT/resumed.log
date -u +"%F %T resumed run done"
.venv/bin/matryoshka2d "${ARGS[@]}" --output $OUT/whole > $OUT/whole.log 2>&1; echo "uninterrupted exit $?"
date -u +"%F %T uninterrupted run done"
.venv/bin/python - <<'PY'
from safetensors.torch import load_file
a = load_file("runs/ddp-resume/killed/model.safetensors"); b = load_file("runs/ddp-resume/whole/model.safetensors")
print("tensors", len(a), "max |difference| killed+resumed vs uninterrupted:", max((a[k] - b[k]).abs().max().item() for k in a))
import json
for name in ("killed", "whole"):
    m = json.load(open(f"runs/ddp-resume/{name}/matryoshka2d.json"))
    print(name, "processes", m["processes"], "steps", m["steps"], "STS-B dev", m["final_eval"])
PY
