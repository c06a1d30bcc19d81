#!/bin/bash
# two 4-step `tidal grpo` runs of the bench-learn workload: main's code (9df2019) then this branch; same seed
cd /work/wt/trainspeed
EX=examples/real_model
for side in base branch; do
  if [ $side = base ]; then SRC=/tmp/trainspeed/base/src; else SRC=/work/wt/trainspeed/src; fi
  OUT=/tmp/trainspeed/e2e-$side; rm -rf $OUT
  echo "== $side $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=$SRC:/work/wt/trainspeed timeout 420 /work/main/.venv/bin/python -m tidal.cli grpo --train $EX/train.yaml \
    --infer $EX/infer.yaml --orch $EX/orch.yaml --output-dir $OUT --orch.max_steps 4 --orch.batch_size 64 \
    --orch.rollouts_per_example 8 --orch.sampling.max_tokens 64 --orch.seed 1 --orch.sampling.seed 1 --train.seed 1 \
    --train.learning_rate 5e-4 --train.lora_rank 16 --train.lora_alpha 32 --train.export.gguf null --infer.port 8751 \
    --train.loss.loss_type dapo --train.loss.beta 0 --train.loss.token_mask_low 0 --train.loss.token_mask_high 1e30 \
    --train.loss.geo_mask_low 0 --train.loss.geo_mask_high 1e30 --train.loss.sequence_mask_low 0 \
    --train.loss.sequence_mask_high 1e30 --orch.advantage.scale_rewards group --train.loss.is_correction sequence_masked \
    --train.loss.is_cap 3 > /tmp/trainspeed/e2e-$side.log 2>&1
  echo "rc $? $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
done
