#!/usr/bin/env bash
# The tinker SDK for `tidal serve-tinker` on the GPU machines (the `tinker` check of scripts/gpu_check.py), as a
# directory of wheels that travels beside the checkout: .gpu-kit/tinker/ (~12 MiB; carry it with the command that
# sources .gpu-kit/install.sh). `make gpu-kit` runs this after the vLLM kit; alone: `bash scripts/gpu_kit_tinker.sh`.
#
# The GPU image (../shared/gpu-kit/on-gpu-image.txt) has protobuf, numpy, httpx, anyio, click, rich, transformers
# and typing_extensions; the vLLM kit brings pydantic, distro and sniffio (openai's and fastapi's dependencies; the
# two small ones are packed here too). What is left of tinker 0.38.0's closure: tinker, pyqwest (its HTTP client,
# with opentelemetry-api), zstandard (imported by tinker.resources.training), orjson, h2 (+ hpack, hyperframe:
# httpx[http2]), distro, sniffio. Versions: the ones tidal's tests run the SDK with.
set -euo pipefail
OUT=${OUT_DIR:-.gpu-kit}
DIR="$OUT/tinker"
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for t in manylinux_2_{5,17,24,26,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do PLAT+=(--platform "$t"); done
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx "/$OUT/" "$EXCLUDE" 2>/dev/null || echo "/$OUT/" >> "$EXCLUDE"
rm -rf "$DIR" && mkdir -p "$DIR"
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$DIR" "tinker==0.38.0" "pyqwest==0.12.0" \
  "opentelemetry-api==1.45.2" "zstandard==0.25.0" "orjson==3.13.0" "h2==4.4.1" "hpack==4.2.0" "hyperframe==6.1.0" \
  "distro==1.9.0" "sniffio==1.3.1"
# install.sh (copied from the shared kit by make_bundle.sh) installs them into /tmp/site once per machine
if [ -f "$OUT/install.sh" ] && ! grep -q "gpu_kit_tinker" "$OUT/install.sh"; then
  cat >> "$OUT/install.sh" <<'SH'
# the tinker SDK for `tidal serve-tinker` (scripts/gpu_kit_tinker.sh), when .gpu-kit/tinker was carried along
if [ -d .gpu-kit/tinker ] && [ ! -d /tmp/site/tinker ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-kit/tinker/*.whl \
    && python3 -c "import tinker; print('tinker', tinker.__version__)"
fi
SH
fi
du -sh "$DIR" && ls "$DIR"
