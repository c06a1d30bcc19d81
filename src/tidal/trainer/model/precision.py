"""Precision recipes (train `recipe`) applied to the policy after loading: which matmuls run in which format.

- `auto` (the default): `bf16` on GPU; on CPU `bf16` where the CPU multiplies bfloat16 natively (AVX512-BF16 or
  AMX), else `fp32` (`tidal.inference.precision.resolve_recipe`; the environment variable `TIDAL_CPU_RECIPE` decides
  instead where set).
- `fp32`: nothing to do here; the model is loaded in float32.
- `bf16` on GPU: nothing to do here; the model is loaded in bfloat16 (`model.resolve_dtype`).
- `bf16` on CPU: mixed precision. The weights (and so the optimizer, checkpoints and broadcasts) stay float32;
  the forward (and its backward) runs under `torch.autocast("cpu", bfloat16)`, so the linear layers multiply in
  bfloat16 with float32 accumulation — 2.2x the float32 matmul throughput on a CPU with AVX512-BF16 units
  (measured on the bench machine's Zen 4, one core; `has_bf16_matmul` says whether this CPU has them: without,
  the numerics are the same and slower than float32, and a notice says so). Two places stay float32: the
  attention scores (`tidal.trainer.model.attention`) and the lm_head, whose logits feed the log-probabilities
  (`tidal.trainer.step.logprobs`: bfloat16 logits would be rounded by up to 0.03 at magnitude 8). The model carries
  its autocast dtype as the attribute `AUTOCAST_ATTR`, read by every forward of `tidal.trainer.step.logprobs`.
- `fp8-hybrid` (alias `fp8_hybrid`): FP8 forward and backward matmuls with higher-precision master weights, via
  torchao's float8 training (`torchao.float8`, tensorwise dynamic scaling): before each matmul the input and the
  weight are cast to float8 e4m3 and, in the backward, the output gradient to e5m2, each with one scale per
  tensor (`scale = fp8_max / amax`); the matmul multiplies the fp8 codes (on SM89+ GPUs `torch._scaled_mm`, fp32
  accumulation) and the result is returned in the model's dtype. The weights themselves stay in the model dtype
  (float32 on CPU, bfloat16 on GPU): they are what the optimizer, the checkpoints and the broadcasts see.
  A frozen base weight (LoRA) is quantized once, not at every forward, recompute and backward: its e4m3 codes
  and scale are kept next to it (1 byte per parameter more) and made again only if the weight changes.
  Which matmuls: every `nn.Linear` of the base model whose two dimensions are multiples of 16 (what FP8 GEMMs
  need) — with LoRA, the frozen base projections (q/k/v/o, gate/up/down) — except `lm_head`, whose logits feed
  the log-probabilities and stay in the model dtype. LoRA's A/B matmuls (rank r) stay in high precision: they
  are tiny and carry all the trainable signal. For a frozen base weight no weight gradient is computed (the
  backward does only the e5m2 x e4m3 input-gradient matmul). Where the hardware has no FP8 matmuls (CPU, GPUs
  below SM89) torchao's emulation runs the same casts and scales and multiplies the dequantized values in the
  model dtype — the same numerics up to the accumulation order, no speed-up — and a one-line notice says so.
  vLLM serves the high-precision weights, so under this recipe trainer and inference logprobs differ by the fp8
  rounding (visible in `mismatch_kl`).
- `nvfp4` is refused when the config loads (`tidal.config.train`): it needs Blackwell (SM100+) FP4 matmuls.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from tidal.inference.precision import has_bf16_matmul, resolve_recipe

log = logging.getLogger("tidal.trainer")


class ImportNoise(logging.Filter):
    """Drops warnings that torchao and bitsandbytes log when imported (PEFT imports both whenever it builds LoRA
    layers) and that say nothing actionable here: torchao's CUDA-only kernels (`_C*.so`) failing to load on a
    machine without CUDA, torch's deprecation notice about how torchao registers its enums, and bitsandbytes'
    CPU backend failing to fetch an optional 4-bit kernel from the Hugging Face Hub (tidal never downloads)."""

    def __init__(self, *patterns: str) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p in record.getMessage() for p in self.patterns)


def quiet_import_noise() -> None:
    """Install the `ImportNoise` filters (idempotent); called when this module is imported, before PEFT is."""
    targets = {"torch.utils._pytree": ("register_constant() on Enum subclasses is deprecated",),
               "bitsandbytes.backends.cpu.ops": ("from kernels-community",)}
    if not torch.cuda.is_available():
        targets["torchao"] = ("Failed to load",)
    for name, patterns in targets.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, ImportNoise) for f in logger.filters):
            logger.addFilter(ImportNoise(*patterns))


quiet_import_noise()

FP8_RECIPES = ("fp8-hybrid", "fp8_hybrid")
FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with FP8 tensor cores (Ada / Hopper and newer)."""
SKIP_MODULES = ("lm_head",)
"""Linear layers that keep high-precision matmuls under `fp8-hybrid`."""


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether `device` multiplies float8 tensors natively (CUDA SM89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


AUTOCAST_ATTR = "tidal_autocast_dtype"
"""Attribute of a model whose forwards run under autocast to that dtype (`recipe: bf16` on CPU)."""


def autocast_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype `model`'s forwards autocast to (`AUTOCAST_ATTR`); None: no autocast."""
    return getattr(model, AUTOCAST_ATTR, None)


@contextlib.contextmanager
def without_autocast(model: torch.nn.Module) -> Iterator[None]:
    """Inside: `model`'s forwards run in its weights' dtype (no `AUTOCAST_ATTR` autocast), e.g. the policy identity
    probe, which scores the policy the float32 weights define rather than one bf16 rounding of it."""
    holders = [m for m in model.modules() if m.__dict__.get(AUTOCAST_ATTR) is not None]
    saved = [m.__dict__[AUTOCAST_ATTR] for m in holders]
    for m in holders:
        setattr(m, AUTOCAST_ATTR, None)
    try:
        yield
    finally:
        for m, dtype in zip(holders, saved, strict=True):
            setattr(m, AUTOCAST_ATTR, dtype)


def apply_recipe(model: torch.nn.Module, recipe: str, device: torch.device) -> torch.nn.Module:
    """`model` with the matmuls of `recipe` (train `recipe`; `auto` resolved by `resolve_recipe`: on CPU `bf16` where
    the CPU has bfloat16 units); `fp32`, and `bf16` on GPU, return it unchanged; `bf16` on CPU marks it for
    bfloat16 autocast (`AUTOCAST_ATTR`)."""
    recipe = resolve_recipe(recipe, device.type)
    if recipe == "fp32" or (recipe == "bf16" and device.type != "cpu"):
        return model
    if recipe == "bf16":
        setattr(model, AUTOCAST_ATTR, torch.bfloat16)
        if has_bf16_matmul():
            log.info("recipe bf16 on CPU: float32 weights, bfloat16 matmuls (autocast; AVX512-BF16 units)")
        else:
            log.info("recipe bf16 on CPU: float32 weights, bfloat16 matmuls (autocast); this CPU has no bfloat16 "
                     "matmul units, so they are emulated: bf16 numerics, slower than recipe fp32")
        return model
    if recipe in FP8_RECIPES:
        emulate = not has_fp8_matmul(device)
        n = convert_to_fp8(model, emulate=emulate)
        if emulate:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            log.info("recipe %s: %s has no FP8 matmuls; emulating them for %d linear layers (the same e4m3/e5m2 "
                     "casts and per-tensor scales, products in %s: FP8 numerics, not FP8 speed)", recipe,
                     device_name(device), n, dtype)
        else:
            log.info("recipe %s: FP8 matmuls on %s for %d linear layers", recipe, device_name(device), n)
        return model
    raise ValueError(f"train recipe '{recipe}' is not one tidal can apply (fp32, bf16, fp8-hybrid)")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (SM{major}{minor})"
    return device.type.upper()


def fp8_eligible(module: torch.nn.Module, fqn: str) -> bool:
    """A plain `nn.Linear` outside LoRA and `SKIP_MODULES`, both dimensions multiples of 16."""
    leaf = fqn.rsplit(".", 1)[-1]
    return (type(module) is torch.nn.Linear and leaf not in SKIP_MODULES and ".lora_" not in f".{fqn}"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(model: torch.nn.Module, emulate: bool) -> int:
    """Swap the eligible linear layers of `model` (`fp8_eligible`) for float8 ones in place; returns how many."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig(emulate=emulate)
    cls = fp8_linear_class()
    targets = [(fqn, m) for fqn, m in model.named_modules() if fp8_eligible(m, fqn)]
    for fqn, module in targets:
        parent_name, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, cls.from_float(module, config=config))
    return len(targets)


_FP8_LINEAR: Any = None


def fp8_linear_class() -> Any:
    """torchao's `Float8Linear`, extended to skip the weight-gradient matmul of a frozen weight (built on first
    use: torchao is imported only when a recipe needs it)."""
    global _FP8_LINEAR
    if _FP8_LINEAR is None:
        _FP8_LINEAR = _build_fp8_linear()
    return _FP8_LINEAR


def _build_fp8_linear() -> Any:
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    def cast(t: torch.Tensor, cast_config: Any, mm_config: Any, role: Any, scale_pow2: bool) -> Any:
        # tensorwise dynamic scaling (the config built in `convert_to_fp8`): one scale per tensor
        assert cast_config.scaling_type is ScalingType.DYNAMIC
        assert cast_config.scaling_granularity is ScalingGranularity.TENSORWISE
        return hp_tensor_to_float8_dynamic(t, cast_config.target_dtype, mm_config, gemm_input_role=role,
                                           round_scales_to_power_of_2=scale_pow2)

    class FrozenWeightFloat8Matmul(torch.autograd.Function):
        """`x @ w_t` through float8 casts (x: e4m3, grad: e5m2) with the frozen weight's e4m3 codes given
        (quantized once: `FrozenAwareFloat8Linear.frozen_fp8`), as torchao's float8 matmul but with no gradient for
        the weight: the backward is the input-gradient matmul only."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w8: Any, w8_grad: Any, mm_config: Any, config: Any) -> torch.Tensor:
            ctx.save_for_backward(w8_grad)
            ctx.mm_config, ctx.config = mm_config, config
            pow2 = config.round_scales_to_power_of_2
            x8 = cast(x.reshape(-1, x.shape[-1]), config.cast_config_input, mm_config, GemmInputRole.INPUT, pow2)
            return torch.mm(x8, w8).reshape(*x.shape[:-1], w8.shape[-1])  # (..., out)

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
            (w8,) = ctx.saved_tensors  # (in, out) e4m3 codes of w_t
            c, pow2 = ctx.config, ctx.config.round_scales_to_power_of_2
            g8 = cast(grad_out.reshape(-1, grad_out.shape[-1]), c.cast_config_grad_output, ctx.mm_config,
                      GemmInputRole.GRAD_OUTPUT, pow2)
            grad_in = torch.mm(g8, w8.t())  # (tokens, in)
            return grad_in.reshape(*grad_out.shape[:-1], w8.shape[0]), None, None, None, None

    class FrozenAwareFloat8Linear(Float8Linear):  # type: ignore[misc]
        """torchao `Float8Linear`; a weight that does not require grad is quantized once (not at every forward and
        backward: its e4m3 codes and scale are kept, 1 byte per parameter, until the weight changes) and skips the
        weight-gradient matmul."""

        weight_casts = 0
        """How many times a frozen weight was quantized (all layers; tests count it)."""

        def frozen_fp8(self) -> tuple[Any, Any]:
            """The frozen weight's float8 codes for the forward and the input-gradient matmul (one object when
            the two casts are configured alike, the default), computed again only when the weight changed
            (another tensor, or an in-place write: its version counter)."""
            key = (self.weight.data_ptr(), self.weight._version, self.weight.device)
            cached = self.__dict__.get("_tidal_fp8")
            if cached is None or cached[0] != key:
                c, pow2 = self.config, self.config.round_scales_to_power_of_2
                with torch.no_grad():
                    w_t = self.weight.t()  # (in, out), column-major: the layout FP8 GEMMs take
                    w8 = cast(w_t, c.cast_config_weight, self.linear_mm_config, GemmInputRole.WEIGHT, pow2)
                    w8_grad = (w8 if c.cast_config_weight_for_grad_input == c.cast_config_weight else
                               cast(w_t, c.cast_config_weight_for_grad_input, self.linear_mm_config,
                                    GemmInputRole.WEIGHT, pow2))
                type(self).weight_casts += 1
                cached = self.__dict__["_tidal_fp8"] = (key, w8, w8_grad)
            return cached[1], cached[2]

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if self.weight.requires_grad or torch.is_autocast_enabled():
                return super().forward(input)  # type: ignore[no-any-return]
            w8, w8_grad = self.frozen_fp8()
            out = FrozenWeightFloat8Matmul.apply(input, w8, w8_grad, self.linear_mm_config, self.config)
            return out if self.bias is None else out + self.bias.to(out.dtype)

    return FrozenAwareFloat8Linear
