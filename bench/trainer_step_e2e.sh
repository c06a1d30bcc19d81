#!/bin/bash
# bench/TRAINER-STEP.md's end-to-end check: two 4-step `tidal grpo` runs of the bench-learn workload (bench/learn.py's
# tidal command, seed 1), first with the code of BASE_REV (default 9df2019, main before the trainer-step cuts), then
# with this checkout; compare train_time_s and mismatch_kl in OUT/e2e-{base,branch}/metrics.jsonl.
# Run under the machine's heavy lock: flock /tmp/tidal-heavy.lock bench/trainer_step_e2e.sh
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/trainspeed}
PY=${PYTHON:-python}
mkdir -p "$OUT/base" && git -C "$ROOT" archive "${BASE_REV:-9df2019}" src | tar -x -C "$OUT/base"
cd "$ROOT"
EX=examples/real_model
for side in base branch; do
  if [ $side = base ]; then SRC=$OUT/base/src; else SRC=$ROOT/src; fi
  RUN=$OUT/e2e-$side; rm -rf "$RUN"
  echo "== $side $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=$SRC:$ROOT timeout 420 "$PY" -m tidal.cli grpo --train $EX/train.yaml \
    --infer $EX/infer.yaml --orch $EX/orch.yaml --output-dir "$RUN" --orch.max_steps 4 --orch.batch_size 64 \
    --orch.rollouts_per_example 8 --orch.sampling.max_tokens 64 --orch.seed 1 --orch.sampling.seed 1 --train.seed 1 \
    --train.learning_rate 5e-4 --train.lora_rank 16 --train.lora_alpha 32 --train.export.gguf null --infer.port 8751 \
    --train.loss.loss_type dapo --train.loss.beta 0 --train.loss.token_mask_low 0 --train.loss.token_mask_high 1e30 \
    --train.loss.geo_mask_low 0 --train.loss.geo_mask_high 1e30 --train.loss.sequence_mask_low 0 \
    --train.loss.sequence_mask_high 1e30 --orch.advantage.scale_rewards group --train.loss.is_correction sequence_masked \
    --train.loss.is_cap 3 > "$OUT/e2e-$side.log" 2>&1
  echo "rc $? $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
done
