#!/usr/bin/env bash
# Pack, on this CPU machine, SGLang 0.5.16 for the lent GPU machines (Python 3.12, torch 2.11.0+cu130, no registry,
# at most 64 MiB carried per call), modelled on ../shared/gpu-kit/make_bundle.sh (vLLM 0.24).
#   bash scripts/sglang_gpu_bundle.sh            # from the project root: writes .sglang-kit/ (git-ignored)
#   DRY_RUN=1 bash scripts/sglang_gpu_bundle.sh  # resolve only (metadata, no wheels): prints what would be packed
# sglang 0.5.16 is the newest release pinned to torch==2.11.0 (docs/sglang.md); its kernels come from
# sglang-kernel 0.4.5 (CUDA 13 builds, ~383 MB; flash_ops.abi3.so alone is ~1.1 GB unpacked). pip's resolver picks
# the rest from sglang's own Requires-Dist (linux x86_64, CPython 3.12); left out are torch and what pins it (the
# image's torch stays), CUDA toolkit wheels (nvidia-*: the image's torch brings its own), the kernel libraries
# only some models or backends use (flash-attn-4, cutlass-dsl, tilelang, helion, humming, tokenspeed-mla,
# deep-gemm, quack), and every wheel the image already has (../shared/gpu-kit/on-gpu-image.txt) except KEEP
# (below). tidal then starts SGLang with `--attention-backend triton --sampling-backend pytorch` through infer
# `extra_args` if flashinfer's JIT cannot build there (no nvcc on the image).
# On the GPU machine: `bash .sglang-kit/stash.sh pN` per part (carrying .sglang-kit/parts/dpN and stash.sh), then
# `source .sglang-kit/install.sh && ...` in the command that runs tidal (docs/sglang.md has the exact commands).
set -euo pipefail
OUT=${OUT_DIR:-.sglang-kit}
KIT=${GPU_KIT:-../shared/gpu-kit}
PY=${PYTHON:-python3}
SGLANG=${SGLANG_VERSION:-0.5.16}
KERNEL=${SGLANG_KERNEL_VERSION:-0.4.5}
PART=${PART_SIZE:-60M}
# Packed even though the image has them: sglang 0.5.16 registers a `qwen3_asr` config, which transformers >= 5.17
# (the image's) already defines ("'qwen3_asr' is already used by a Transformers config" at import: seen here with
# 5.19), so it needs its own pin (5.12.1) and that pin's tokenizers.
KEEP='^(transformers|tokenizers|huggingface-hub)$'
LEAVE_OUT='^(torch|torchaudio|torchvision|torchcodec|triton|nvidia-(?!ml-py).*|cuda-toolkit|flash-attn-4|nvidia-cutlass-dsl|tilelang|helion|humming-kernels|tokenspeed-mla|sgl-deep-gemm|quack-kernels|flashinfer-cubin|flashinfer-jit-cache)$'
EXCLUDE=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$EXCLUDE")" && { grep -qx "/$OUT/" "$EXCLUDE" 2>/dev/null || echo "/$OUT/" >> "$EXCLUDE"; }
rm -rf "$OUT" && mkdir -p "$OUT/work/wheels" "$OUT/parts"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for t in manylinux_2_{5,17,24,26,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do PLAT+=(--platform "$t"); done

# 1. Resolve sglang's dependency tree from metadata only (PyPI serves it without the wheels). The packages left
#    out are stood in for by empty local wheels at the versions sglang pins (stub.py), so that pip neither fetches
#    them nor fails on the CUDA pins behind them.
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT/work" "sglang==$SGLANG"
mkdir -p "$OUT/work/stubs" && $PY "$(dirname "$0")/sglang_bundle_stubs.py" "$OUT"/work/sglang-*.whl "$LEAVE_OUT" "$OUT/work/stubs"
$PY -m pip install -q --dry-run --ignore-installed --target "$OUT/work/none" "${PLAT[@]}" --report "$OUT/work/report.json" \
  --find-links "$OUT/work/stubs" "sglang==$SGLANG" "sglang-kernel==$KERNEL"
# 2. What to pack: the resolved pins minus LEAVE_OUT and minus what the GPU image has.
$PY - "$OUT/work/report.json" "$KIT/on-gpu-image.txt" "$LEAVE_OUT" "$KEEP" > "$OUT/work/pack.txt" <<'PYEOF'
import json, re, sys
have = {l.strip().lower().replace("-", "_") for l in open(sys.argv[2]) if l.strip()}
leave, keep = re.compile(sys.argv[3]), re.compile(sys.argv[4])
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    key, dashed = name.lower().replace("-", "_").replace(".", "_"), name.lower().replace("_", "-")
    if leave.match(dashed) or (key in have and not keep.match(dashed) and key not in ("sglang", "sglang_kernel")):
        print(f"# left out: {name}=={version}", file=sys.stderr)
        continue
    print(f"{name}=={version}")
PYEOF
echo "to pack ($(wc -l < "$OUT/work/pack.txt") wheels):"; cat "$OUT/work/pack.txt"
if [ "${DRY_RUN:-0}" = 1 ]; then echo "dry run: nothing downloaded (.sglang-kit/work/pack.txt)"; exit 0; fi

# 3. Download exactly those pins, without letting pip add anything.
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT/work/wheels" -r "$OUT/work/pack.txt"
# sglang-kernel ships sm90 and sm100 builds of its common ops; the H100 / H200 (sm90) need only the former.
KW=$(realpath "$OUT"/work/wheels/sglang_kernel-*.whl)
(mkdir -p "$OUT/work/k" && cd "$OUT/work/k" && unzip -q "$KW" && rm -rf sgl_kernel/sm100 && zip -q -r -9 ../kernel.zip . )
mv "$OUT/work/kernel.zip" "$KW" && rm -rf "$OUT/work/k"
tar -cf "$OUT/bundle.tar" -C "$OUT/work" wheels pack.txt
(cd "$OUT/parts" && split -b "$PART" -d -a 2 ../bundle.tar p && for f in p*; do mkdir "d$f" && mv "$f" "d$f/"; done)
rm -rf "$OUT/work" "$OUT/bundle.tar"
cat > "$OUT/stash.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine: keep one carried part in /tmp/sgl-stash (the machine stays warm between calls).
set -e; mkdir -p /tmp/sgl-stash && cp ".sglang-kit/parts/d$1/$1" /tmp/sgl-stash/ && ls -la /tmp/sgl-stash
EOF
cat > "$OUT/install.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine, after every part is stashed: install the wheels into /tmp/sgl-site (idempotent), put them on
# PYTHONPATH and install this checkout editable. Then, in the same command: tidal grpo --infer.backend sglang ...
set -e
if [ ! -d /tmp/sgl-site/sglang ]; then
  cat /tmp/sgl-stash/p* > /tmp/sgl-bundle.tar && mkdir -p /tmp/sgl-bundle && tar -xf /tmp/sgl-bundle.tar -C /tmp/sgl-bundle
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl-site /tmp/sgl-bundle/wheels/*.whl
fi
export PYTHONPATH=/tmp/sgl-site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
python3 -c "import sglang, sgl_kernel, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
set +e
EOF
ls "$OUT/parts"
echo "parts ready: on the GPU machine run .sglang-kit/stash.sh pNN for each part, then source .sglang-kit/install.sh"
