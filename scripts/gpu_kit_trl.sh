#!/usr/bin/env bash
# TRL for bench/gpu_e2e.py (`make bench-gpu-e2e`, tidal vs TRL's GRPOTrainer on one GPU) on the GPU machines, as a
# directory of wheels that travels beside the checkout: .gpu-kit/trl/ (~3 MiB; carry it with the command that sources
# .gpu-kit/install.sh and runs the bench, which installs them into /tmp/site-trl with pip --no-index, once per
# machine). `make gpu-kit` runs this after the vLLM kit; alone: `bash scripts/gpu_kit_trl.sh`.
#
# The GPU image (../shared/gpu-kit/on-gpu-image.txt) has torch, transformers, peft, accelerate, pyarrow, pandas,
# numpy, psutil, pyyaml, jinja2, packaging, huggingface_hub, fsspec, xxhash, tqdm, filelock, requests, httpx,
# triton; the vLLM kit brings vLLM 0.24 (inside TRL 1.16's supported 0.22-0.31). What is left of trl 1.16.0's
# closure: trl, datasets (>= 4.7), dill and multiprocess (datasets'), and liger-kernel for `--trl-liger` (pure
# Python + Triton). datasets 4.8.5 rather than make bench's 5.2.0: it asks less of the image (pyarrow >= 21,
# huggingface-hub >= 0.25, where 5.2 wants pyarrow >= 24 and huggingface-hub >= 1.31; the image's versions are not
# listed), and TRL 1.16 takes either.
set -euo pipefail
OUT=${OUT_DIR:-.gpu-kit}
DIR="$OUT/trl"
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for t in manylinux_2_{5,17,24,26,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do PLAT+=(--platform "$t"); done
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx "/$OUT/" "$EXCLUDE" 2>/dev/null || echo "/$OUT/" >> "$EXCLUDE"
rm -rf "$DIR" && mkdir -p "$DIR"
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$DIR" "trl==1.16.0" "datasets==4.8.5" "dill==0.4.1" \
  "multiprocess==0.70.19" "liger-kernel==0.8.5"
du -sh "$DIR" && ls "$DIR"
