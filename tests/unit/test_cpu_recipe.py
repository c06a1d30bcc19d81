"""Train `recipe: auto` on CPU (`tidal.inference.precision.resolve_recipe`): bf16 where the CPU multiplies bfloat16
natively, fp32 elsewhere, `TIDAL_CPU_RECIPE` deciding where set (the suite's conftest pins fp32); what `tidal grpo`
derives from it (the trainer's recipe, vLLM's dtype, the identity check's tolerance, a notice) and what the trainer
applies. The CPU's flags are faked: no test here depends on the CPU it runs on."""

from __future__ import annotations

import pytest
import torch

from tidal.colocate.derive import CPU_BF16_NOTICE, Machine, derive_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.inference import precision
from tidal.inference.precision import CPU_RECIPE_VAR, resolve_recipe

CPU2 = Machine(cores=(0, 1))


@pytest.fixture
def cpu(monkeypatch):
    """Set the faked CPU: `cpu(units, var)`: whether it has bfloat16 units, and TIDAL_CPU_RECIPE (None: unset)."""
    def set_(units: bool, var: str | None) -> None:
        monkeypatch.setattr(precision, "has_bf16_matmul", lambda: units)
        if var is None:
            monkeypatch.delenv(CPU_RECIPE_VAR, raising=False)
        else:
            monkeypatch.setenv(CPU_RECIPE_VAR, var)
    return set_


@pytest.mark.parametrize(("units", "var", "want"), [(True, None, "bf16"), (False, None, "fp32"),
                                                    (True, "fp32", "fp32"), (False, "bf16", "bf16")])
def test_auto_on_cpu_follows_the_cpus_bf16_units_unless_the_variable_says(cpu, units, var, want):
    cpu(units, var)
    assert resolve_recipe("auto", "cpu") == want
    assert resolve_recipe("auto", "cuda") == "bf16"  # a GPU: bf16 whatever the CPU
    for explicit in ("fp32", "bf16", "fp8-hybrid"):
        assert resolve_recipe(explicit, "cpu") == explicit


def test_a_wrong_variable_is_refused_naming_it(cpu):
    cpu(True, "float16")
    with pytest.raises(ConfigError, match=f"{CPU_RECIPE_VAR}='float16'.*fp32 or bf16"):
        resolve_recipe("auto", "cpu")


def test_tidal_grpo_on_a_bf16_cpu_runs_bf16_on_both_sides(cpu):
    cpu(True, None)
    train, infer = TrainConfig(model="m"), InferConfig(model="m")
    co = derive_colocate(train, infer, OrchConfig(), CPU2)
    assert co.train.recipe == "bf16" and co.infer.dtype == "bfloat16" and train.recipe == "auto"
    assert CPU_BF16_NOTICE in co.placement.notices
    # the trainer's probe record says bfloat16 (its autocast): the check's own 16-bit tolerance, nothing overridden
    assert co.orch.weight_broadcast.policy_check_tolerance is None
    assert not any("vLLM serves in" in n for n in co.placement.notices)  # no precision mismatch notice
    explicit = derive_colocate(TrainConfig(model="m", recipe="fp32"), infer, OrchConfig(), CPU2)
    assert explicit.train.recipe == "fp32" and explicit.infer.dtype == "float32"
    assert CPU_BF16_NOTICE not in explicit.placement.notices


def test_tidal_grpo_on_a_cpu_without_bf16_units_stays_float32(cpu):
    cpu(False, None)
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(), CPU2)
    assert co.train.recipe == "fp32" and co.infer.dtype == "float32"
    assert CPU_BF16_NOTICE not in co.placement.notices


def test_an_explicit_bf16_recipe_on_cpu_serves_bfloat16(cpu):
    """Before, infer `dtype: auto` followed the trainer's float32 weights: a bf16 trainer beside a float32 vLLM."""
    cpu(False, "fp32")
    co = derive_colocate(TrainConfig(model="m", recipe="bf16"), InferConfig(model="m"), OrchConfig(), CPU2)
    assert co.infer.dtype == "bfloat16" and co.orch.weight_broadcast.policy_check_tolerance is None


@pytest.mark.parametrize(("units", "var"), [(True, None), (False, None), (True, "fp32")])
def test_the_trainer_applies_what_auto_resolves_to(cpu, units, var):
    """`tidal grpo-train` alone gets `recipe: auto` and resolves it itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidal.trainer.model.precision import apply_recipe, autocast_dtype

    cpu(units, var)
    model = apply_recipe(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      num_key_value_heads=1)), "auto", torch.device("cpu"))
    want = torch.bfloat16 if resolve_recipe("auto", "cpu") == "bf16" else None
    assert autocast_dtype(model) == want and next(model.parameters()).dtype == torch.float32
