"""Golden trajectory (torchtune style): catch silent numeric changes in the trainer in seconds, without vLLM.

`tests/data/golden/` holds three real `TrainingBatch` files (`step_{1,2,3}.safetensors`, written by the
orchestrator of a short co-locate `tidal grpo` run on the bundled model) and `expected.json`, the metrics
`train_step` returned on them. Each trajectory below loads the bundled model with a fixed seed as the trainer
does (float32 on CPU, LoRA initialized), casts it to float64 (exact), then runs `train_step` on batches 1, 2, 3
in order on CPU, so steps 2 and 3 also depend on the earlier updates (LoRA init, forward, loss, backward,
clipping, AdamW). Loss and grad norm (and a few more metrics) must agree with the committed numbers to a
relative RTOL = 1e-9 (ATOL = 1e-14 for values near 0).

Two trajectories cover both loss families: `aipo` is the bundled example's train.yaml as it is (seed 000's
loss), `grpo` the clipped objective with a reference-model KL (`beta`), two iterations per batch, several
micro-batches and truncated completions masked out.

Why float64 (issue 34): float32 training is reproducible only on the same kernels. The GRPO advantages are
zero-mean per group, so the gradient is a sum that mostly cancels, and AdamW divides each gradient component by
its own magnitude, so rounding noise grows by orders of magnitude over three steps. Measured on the committed
data (`scripts/make_golden.py --spread`, Intel Xeon with AVX-512/AMX, torch 2.13.0+cpu), float32 metrics move by
up to 6e-5 relative between torch's AVX-512 and AVX2 kernels or 1, 2 and 4 threads, and by 8e-4 under MKL's
COMPATIBLE code path; pinning the kernels (`ATEN_CPU_CAPABILITY=avx2`, `MKL_CBWR=AVX2`) did not make
float32 agree across CPUs either (1.3e-5 between this Xeon and the CPU the float32 numbers were recorded on).
In float64 the same variations (AVX2 vs AVX-512 kernels; MKL_CBWR AVX2, AVX512, AUTO, COMPATIBLE, SSE4_2; 1, 2
and 4 threads; nothing pinned) move every metric by at most 2.2e-13 relative (and the ~3e-12 mismatch_kl of step
1 by at most 7e-18 absolute). RTOL 1e-9 leaves a margin of over 4000x on that spread (ATOL 1e-14: over 1000x),
is far below float32 rounding (6e-8) and 10^4 below the smallest change a 1% larger learning rate makes to loss
or grad norm (1.2e-5 to 6e-4 at steps 2 and 3: test_golden_check_can_fail), so a real change of the trainer's
numbers still fails the test.

The trainer's own code keeps float64 on the path these trajectories take (chunked logprobs, loss, drift metrics,
AdamW: nothing casts down to float32; only the full-logits fallback, `logprob_chunk_size: 0` or an architecture
outside `LOGIT_TRANSFORMS`, would, in `token_logprobs`/`entropy`). transformers' Qwen3 does: its RMSNorm and RoPE
compute in float32 whatever the model dtype. With them left in float32 the float64 spread above was 1.4e-14,
but every float32 rounding is a discontinuity that turns a small perturbation into float32 noise: the
DEFAULT-kernel LoRA init below (values off by up to 3.7e-9) moved the metrics 5.8e-6 with them, 6.9e-8 without.
So the child makes both compute in float64 (`keep_model_dtype`: the same operations, identical for a float32
model).

Why a child process: the trajectories run in a fresh interpreter with torch's kernels pinned to AVX2 and MKL's
code path to AVX2 (read at start-up), one thread and deterministic algorithms. The tolerance does not rely on
these (see above) but they keep the run cheap and load-independent and, above all, fix the LoRA init: torch's
`uniform_` rounds differently with its DEFAULT kernels (a CPU without AVX2) than with AVX2 or AVX-512, which
agree (half the values of the 768-wide down_proj adapters differ, by up to 3.7e-9): another starting point, 6.9e-8
relative by step 3, so the test skips on such CPUs (and off x86-64). The numbers still change with the torch,
transformers or peft version (recorded in expected.json).

When this test fails, a change altered the trainer's numbers. If that is a bug, fix it. Only when the change
is intended (and explained in the commit), re-record with `.venv/bin/python scripts/make_golden.py --record`;
`scripts/make_golden.py --batches` regenerates the batches themselves (then `--record` again), and
`scripts/make_golden.py --spread` re-measures the spread between kernel paths the tolerance is based on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "data" / "golden"
EXPECTED = GOLDEN / "expected.json"
STEPS = (1, 2, 3)
SEED = 42
THREADS = 1
DTYPE = torch.float64  # of the trajectories (module doc)
RTOL = 1e-9  # over 4000x the largest relative spread measured between kernel paths in float64 (module doc)
ATOL = 1e-14  # for values near 0: mismatch_kl at step 1 is ~3e-12 (vLLM's float32 rounding), spread <= 7e-18
# Kernel pins of the child process (read by torch and MKL at start-up, so they cannot be set in this process).
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": str(THREADS),
              "MKL_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}

# The bundled example's train.yaml (src/tidal/examples/reverse_text/train.yaml), on CPU (run in DTYPE).
EXAMPLE: dict[str, Any] = {
    "model": "tidal:tiny-reverse", "device": "cpu", "recipe": "fp32", "seed": SEED,
    "per_device_train_batch_size": 4, "sequence_len": 512, "learning_rate": 2e-3, "lr_scheduler_type": "constant",
    "max_grad_norm": 1.0, "weight_decay": 0.0, "lora": True, "lora_rank": 16, "lora_alpha": 32,
    "loss": {"ratio_type": "token", "kl_tau": 0.0, "adv_tau": 1.0, "token_mask_low": 0.125, "token_mask_high": 8.0,
             "geo_mask_low": 0.1, "geo_mask_high": 10.0},
}
TRAJECTORIES: dict[str, dict[str, Any]] = {
    "aipo": EXAMPLE,
    # 2-3 micro-batches per step: 128-token rows cut each group's shared-prompt unit (train prompt_sharing)
    "grpo": EXAMPLE | {"per_device_train_batch_size": 2, "sequence_len": 128,
                       "loss": {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2,
                                "mask_truncated_completions": True}},  # batches 1 and 3 hold truncated ones
}
# For the sensitivity test: the aipo trajectory with a 1% larger learning rate.
PERTURBED = {"aipo_lr_x1.01": EXAMPLE | {"learning_rate": EXAMPLE["learning_rate"] * 1.01}}
# Metrics compared at every step (those a trajectory does not report are skipped); ints compare exactly.
METRICS = ("loss", "grad_norm", "mismatch_kl", "entropy", "kl", "clip_ratio/region_mean", "tokens", "micro_batches")


@contextlib.contextmanager
def deterministic_torch(num_threads: int = THREADS) -> Iterator[None]:
    """`num_threads` torch threads and deterministic algorithms; the thread count, the deterministic flag and
    torch's CPU RNG state are restored afterwards."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)


def batch_paths() -> list[Path]:
    return [GOLDEN / f"step_{n}.safetensors" for n in STEPS]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm.forward in at least float32 instead of always float32: the same operations (the same numbers
    for a float32 model), without rounding a float64 model's activations to float32."""
    dt = torch.promote_types(hidden_states.dtype, torch.float32)
    h = hidden_states.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


@torch.no_grad()
def _rotary_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3RotaryEmbedding.forward (default RoPE) in at least float32 instead of always float32."""
    dt = torch.promote_types(x.dtype, torch.float32)
    freqs = position_ids[..., None].to(dt) * self.inv_freq.to(device=x.device, dtype=dt)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def keep_model_dtype(model: torch.nn.Module) -> None:
    """Make the bundled model's (Qwen3) RMSNorms and RoPE compute in float64 once the model is float64:
    transformers computes both in float32 whatever the model dtype (the trainer's own code keeps float64). The
    RoPE inverse frequencies are recomputed in float64 (transformers computes them in float32 at load)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

    norms = rotary = 0
    for module in model.modules():
        if isinstance(module, Qwen3RMSNorm):
            module.forward = _rms_norm_forward.__get__(module)  # type: ignore[method-assign]
            norms += 1
        elif isinstance(module, Qwen3RotaryEmbedding):
            assert module.rope_type == "default", f"only default RoPE is recomputed here, not {module.rope_type}"
            rope: Any = module.config.rope_parameters
            base, dim = float(rope["rope_theta"]), int(module.config.head_dim)
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            module.register_buffer("inv_freq", inv_freq.to(module.inv_freq.device), persistent=False)
            module.forward = _rotary_forward.__get__(module)  # type: ignore[method-assign]
            rotary += 1
        elif type(module).__name__.endswith(("RMSNorm", "RotaryEmbedding")):
            raise AssertionError(f"{type(module).__name__}: not a module keep_model_dtype knows")
    assert norms and rotary == 1, f"not the bundled Qwen3 model: {norms} RMSNorms, {rotary} rotary embeddings"


def run_trajectory(config: dict[str, Any], paths: list[Path],
                   dtype: torch.dtype = torch.float32) -> list[dict[str, float | int]]:
    """`train_step` on each batch in order from a freshly seeded policy, cast to `dtype` after loading (the
    trainer loads float32 on CPU, LoRA initialized: the cast to float64 is exact; `keep_model_dtype`); the
    METRICS of every step."""
    from tidal.config.train import TrainConfig
    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.load import load_policy, load_tokenizer
    from tidal.trainer.step.optim import make_optimizer
    from tidal.transport.batch import TrainingBatch

    cfg = TrainConfig(**config)
    tok = load_tokenizer(cfg.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    torch.manual_seed(cfg.seed)
    model, device = load_policy(cfg)
    assert device.type == cfg.device and next(model.parameters()).dtype == torch.float32
    if dtype != torch.float32:
        model = model.to(dtype)
        keep_model_dtype(model)
    opt = make_optimizer(model, cfg)
    out = []
    for path in paths:
        m = train_step(model, opt, TrainingBatch.load(path), cfg, device, pad_id)
        out.append({k: m[k] if isinstance(m[k], int) else float(m[k]) for k in METRICS if k in m})
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    assert state and all(t.dtype == dtype for t in [*state, *model.parameters()]), "the trajectory left its dtype"
    return out


def compute_pinned(names: list[str], env: dict[str, str | None] | None = None,
                   dtype: torch.dtype = DTYPE) -> dict[str, Any]:
    """Run the named trajectories (TRAJECTORIES or PERTURBED) in `dtype` in a child process with PINNED_ENV, then
    `env` (a None value unsets the variable: `scripts/make_golden.py --spread`). The result's `capability` is
    the kernel set torch used there ("AVX2" under PINNED_ENV unless the CPU lacks AVX2; x86-64 only), `threads`
    its torch thread count."""
    full = {k: v for k, v in (os.environ | PINNED_ENV | (env or {})).items() if v is not None}
    with tempfile.TemporaryDirectory(prefix="tidal-golden-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "tests.unit.test_golden_trajectory", str(out), "--dtype",
               str(dtype).removeprefix("torch."), *names]
        proc = subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"golden trajectory child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    if "OMP_NUM_THREADS" in full:
        assert result["threads"] == int(full["OMP_NUM_THREADS"]), f"threads not pinned: {result}"
    return result


def differences(got: list[dict[str, Any]], want: list[dict[str, Any]],
                first_step: int = 1) -> list[tuple[int, str, str]]:
    """(step, metric, explanation) for each metric outside the tolerance or missing; empty when all match."""
    bad = []
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=first_step):
        for key in sorted(set(g) | set(w)):
            if key not in g or key not in w:
                bad.append((step, key, f"got {g.get(key, 'nothing')}, expected {w.get(key, 'nothing')}"))
            elif isinstance(w[key], int):
                if g[key] != w[key]:
                    bad.append((step, key, f"got {g[key]}, expected {w[key]}"))
            elif not math.isclose(g[key], w[key], rel_tol=RTOL, abs_tol=ATOL):
                rel = abs(g[key] - w[key]) / max(abs(w[key]), 1e-300)
                bad.append((step, key, f"got {g[key]!r}, expected {w[key]!r} (relative difference {rel:.2e})"))
    return bad


def expected() -> dict[str, Any]:
    return json.loads(EXPECTED.read_text())


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    """Both golden trajectories and the perturbed one, computed once per module in the pinned child."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the golden numbers were computed with x86-64 AVX2 kernels, not on {platform.machine()}")
    result = compute_pinned([*TRAJECTORIES, *PERTURBED])
    if result["capability"] != "AVX2":  # torch's DEFAULT kernels draw another LoRA init (module doc)
        pytest.skip(f"the golden numbers need torch's AVX2 kernels; this CPU gives {result['capability']}")
    assert result["threads"] == THREADS and result["dtype"] == str(DTYPE).removeprefix("torch."), result
    return result


def test_committed_batches_are_what_they_claim():
    from tidal.transport.batch import TrainingBatch

    rec = expected()
    assert sorted(p.name for p in GOLDEN.glob("*.safetensors")) == [p.name for p in batch_paths()]
    for n, path in zip(STEPS, batch_paths(), strict=True):
        batch = TrainingBatch.load(path)
        assert batch.step == n and batch.temperature == 1.0 and batch.num_samples > 0
        assert int(batch.loss_mask.sum()) > 0, f"{path.name}: empty loss mask"
        assert abs(batch.advantages).sum() > 0, f"{path.name}: all advantages are zero"
        assert int(batch.loss_mask.sum()) == rec["trajectories"]["aipo"]["steps"][n - 1]["tokens"]
        assert sha256(path) == rec["batches"][path.name], (
            f"{path.name} is not the batch expected.json was recorded from; after regenerating batches run "
            f"`scripts/make_golden.py --record`")
    assert any(TrainingBatch.load(path).truncated.any() for path in batch_paths()), (
        "no truncated completion: the grpo trajectory's mask_truncated_completions would test nothing")
    assert rec["recorded_with"]["dtype"] == str(DTYPE).removeprefix("torch."), (
        f"{EXPECTED.name} was recorded in {rec['recorded_with']['dtype']}, the trajectories run in {DTYPE}: run "
        f"`scripts/make_golden.py --record`")
    for name, config in TRAJECTORIES.items():
        assert rec["trajectories"][name]["config"] == config, (
            f"trajectory {name}: its config in this file differs from the one recorded in {EXPECTED.name}; "
            f"run `scripts/make_golden.py --record` if the change is intended")


@pytest.mark.parametrize("name", sorted(TRAJECTORIES))
def test_golden_trajectory(name, pinned):
    rec = expected()
    bad = differences(pinned["results"][name], rec["trajectories"][name]["steps"])
    now, then = pinned["versions"], {k: rec["recorded_with"][k] for k in pinned["versions"]}
    note = "" if now == then else f"\n(recorded with {then}, running {now}: a version change alone can do this)"
    assert not bad, (
        f"golden trajectory '{name}' changed (rtol {RTOL:g}): the trainer's numbers moved.\n  "
        + "\n  ".join(f"step {step} {key}: {text}" for step, key, text in bad) + note
        + "\nIf this is a bug, fix it. ONLY if the numeric change is intended, re-record the expected numbers "
        "with `.venv/bin/python scripts/make_golden.py --record` and say why in the commit.")


def test_golden_check_can_fail(pinned):
    """The check is sensitive: a 1% larger learning rate leaves step 1 (before any update) unchanged but moves
    loss or grad norm of step 2 or 3 outside the tolerance."""
    want = expected()["trajectories"]["aipo"]["steps"]
    got = pinned["results"]["aipo_lr_x1.01"]
    assert not differences(got[:1], want[:1]), "step 1 runs before any update: the learning rate cannot matter"
    moved = [(step, key) for step, key, _ in differences(got[1:], want[1:], first_step=2)
             if key in ("loss", "grad_norm")]
    assert moved, "a 1% learning-rate change went unnoticed: the golden check is too weak"


GPU_RTOL = 1e-2
"""The committed numbers are float64; the CUDA trajectory runs in float32 like the trainer, and float32 moves
loss and grad norm by up to ~6e-4 from float64 (measured on the CPU: the cancelling GRPO gradient), in other
summation orders again on the GPU. So the GPU check allows 1e-2: it catches device bugs (a wrong dtype, a lost
mask, a tensor left on the CPU), not rounding."""


@pytest.mark.gpu
def test_golden_trajectory_on_cuda_matches_the_cpu_numbers():
    """The same aipo trajectory on a CUDA device in float32 (TF32 off) lands on the committed (float64) CPU
    numbers."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run with -m gpu on a GPU machine)")
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        got = run_trajectory(EXAMPLE | {"device": "cuda"}, batch_paths())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
    want = expected()["trajectories"]["aipo"]["steps"]
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert g["tokens"] == w["tokens"] and g["micro_batches"] == w["micro_batches"], (step, g, w)
        for key in ("loss", "grad_norm"):
            assert math.isclose(g[key], w[key], rel_tol=GPU_RTOL, abs_tol=1e-6), (step, key, g[key], w[key])


def _child(argv: list[str]) -> None:
    """Entry point of the child process (`compute_pinned`): `OUT [--dtype float32|float64] NAME...`; write the
    named trajectories' metrics to OUT. Its torch thread count is OMP_NUM_THREADS (PINNED_ENV: THREADS)."""
    out, names, dtype = argv[0], argv[1:], DTYPE
    if names[:1] == ["--dtype"]:
        dtype, names = getattr(torch, names[1]), names[2:]
    configs = TRAJECTORIES | PERTURBED
    threads = int(os.environ.get("OMP_NUM_THREADS", THREADS))
    results, used = {}, set()
    for name in names:
        with deterministic_torch(threads):
            results[name] = run_trajectory(configs[name], batch_paths(), dtype)
            used.add(torch.get_num_threads())
    import peft
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    Path(out).write_text(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": max(used),
                                     "dtype": str(dtype).removeprefix("torch."), "versions": versions,
                                     "results": results}))


if __name__ == "__main__":
    _child(sys.argv[1:])
