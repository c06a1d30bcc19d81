"""The policy identity probe (`tidal.transport.probe`, `tidal.trainer.publish.probe`): the distance against a float64
reference on fresh random inputs, the rule (fires on a stale or foreign policy, never on a step that barely moved
the policy), the record written inside the policy directory before its STABLE, and the trainer's probe logprobs
against a float64 forward of two architectures (LoRA: the base is the model with its adapters off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.transport.probe import (
    PROBE_FILE,
    PROBE_LEN,
    ProbeRecord,
    distance,
    judge,
    probe_ids,
    tolerance,
)


def test_distance_is_the_mean_absolute_gap_after_the_first_token():
    rng = np.random.default_rng()
    a, b = (rng.normal(size=PROBE_LEN) for _ in range(2))
    want = np.abs(a[1:].astype(np.float64) - b[1:]).mean()
    assert distance(list(a), list(b)) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="different lengths"):
        distance([0.0, 1.0], [0.0])


def record(new, previous=None, base=None, dtype="float32"):
    return ProbeRecord(step=7, ids=list(range(len(new))), new=list(new), dtype=dtype,
                       previous=None if previous is None else list(previous), previous_step=6,
                       base=None if base is None else list(base))


def test_the_rule_fires_on_a_stale_or_foreign_policy_and_names_the_closest():
    rng = np.random.default_rng()
    base = -rng.uniform(0.5, 5.0, PROBE_LEN)
    prev = base + rng.normal(0, 0.3, PROBE_LEN)
    new = prev + rng.normal(0, 0.3, PROBE_LEN)
    rec, tol = record(new, prev, base), tolerance("float32")
    assert judge(list(new + rng.normal(0, 1e-4, PROBE_LEN)), rec, tol).ok  # numerical noise: quiet
    stale = judge(list(prev), rec, tol)
    assert not stale.ok and stale.diagnosis() == "it serves the previous policy"
    v = judge(list(base), rec, tol)
    assert not v.ok and v.diagnosis() == "it serves the base model"
    first = judge(list(base), record(new, base, base), tol)  # policy 1: its previous is the base
    assert first.diagnosis() == "it serves the base model"
    foreign = judge(list(base + 3.0), rec, tol)
    assert not foreign.ok and foreign.diagnosis().startswith("it serves none of the trainer's policies (closest: ")
    line = stale.line("the inference server", 7, "/run/broadcasts/step_7", "orch weight_broadcast.policy_check: false")
    assert "\n" not in line and "step 7" in line and "/run/broadcasts/step_7" in line
    assert f"{stale.gap_new:.4g}" in line and f"{stale.gap_previous:.4g}" in line


@pytest.mark.parametrize("moved", [0.0, 1e-4, 4e-3])
def test_a_step_that_barely_moved_the_policy_never_alarms(moved):
    """Tiny lr: new and previous closer than the tolerance; whichever of them (or a point between) vLLM serves,
    plus float32 noise, the check is quiet, even when the served one is "closer" to the previous policy."""
    rng = np.random.default_rng()
    tol = tolerance("float32")
    for _ in range(200):
        prev = -rng.uniform(0.5, 5.0, PROBE_LEN)
        new = prev + rng.choice([-1, 1], PROBE_LEN) * moved
        for served in (prev, new, (prev + new) / 2):
            v = judge(list(served + rng.normal(0, 1e-5, PROBE_LEN)), record(new, prev, prev), tol)
            assert v.ok, (moved, v)


def test_tolerance_by_dtype_and_override():
    assert tolerance("float32") == 0.01 and tolerance("bfloat16") == 0.1 == tolerance("float16")
    assert tolerance("float32", 0.5) == 0.5
    assert tolerance("float8_e4m3fn") == 0.1  # unknown: the 16-bit one


def test_probe_ids_are_fixed_and_inside_the_vocabulary():
    for vocab in (50, 128, 151_936):
        ids = probe_ids(vocab)
        assert ids == probe_ids(vocab) and len(ids) == PROBE_LEN
        assert all(3 <= i < vocab for i in ids) and len(set(ids)) > PROBE_LEN // 2


def tiny(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    return LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(
        **common, head_dim=8))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_trainer_probe_against_a_float64_forward_and_published_before_stable(tmp_path, kind):
    from peft import LoraConfig, get_peft_model

    from tidal.paths import STABLE
    from tidal.trainer.publish.broadcast import publish_adapter
    from tidal.trainer.publish.probe import Prober, score

    torch.manual_seed(0)
    base = tiny(kind)
    ids = probe_ids(96)

    def reference(m: torch.nn.Module) -> np.ndarray:
        x, training = torch.tensor([ids]), m.training
        with torch.no_grad():
            logits = m.double().eval()(input_ids=x).logits[0, :-1]
        m.float().train(training)
        return np.concatenate([[0.0], torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].numpy()])

    want_base = reference(base)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.5))  # dropout: the probe runs in eval mode
    model.train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)

    class Tok:
        def __len__(self) -> int:
            return 96

    prober = Prober(model, Tok())
    assert prober.ids == ids and prober.dtype == "float32" and model.training
    assert np.allclose(prober.base, want_base, atol=1e-5) and prober.previous_step == 0
    rec = prober.record(model, 1)
    assert np.allclose(rec.new, reference(model), atol=1e-5) and rec.previous == prober.base
    assert distance(rec.new, rec.base) > 0.01 and score(model, ids) == rec.new
    assert prober.record(model, 2).previous == rec.new  # the next policy's previous is this one

    seen = {}

    def spy(tmp):  # what the directory holds when it is filled: the probe is in before STABLE
        seen["files"] = sorted(p.name for p in tmp.iterdir())

    from tidal.transport import weights

    orig = weights.publish

    def publish(run_dir, step, fill, keep=None):
        return orig(run_dir, step, lambda tmp: (fill(tmp), spy(tmp)), keep)

    weights.publish = publish
    try:
        out = publish_adapter(model, tmp_path, 1, probe=rec)
    finally:
        weights.publish = orig
    assert PROBE_FILE in seen["files"] and STABLE not in seen["files"] and (out / STABLE).exists()
    assert ProbeRecord.read(out) == rec and ProbeRecord.read(tmp_path) is None


def test_a_cpu_bf16_trainer_publishes_its_probe_as_bfloat16():
    """Train `recipe: bf16` on CPU keeps float32 weights and autocasts the matmuls: the probe's logprobs carry bf16
    rounding, so its record names bfloat16 (tolerance 0.1), not the weights' float32 (0.01)."""
    from tidal.trainer.model.precision import apply_recipe
    from tidal.trainer.publish.probe import Prober, score

    class Tok:
        def __len__(self) -> int:
            return 96

    torch.manual_seed(0)
    model = tiny("llama")
    assert Prober(model, Tok()).dtype == "float32"
    fp32 = score(model, probe_ids(96))
    model = apply_recipe(model, "bf16", torch.device("cpu"))
    prober = Prober(model, Tok())
    assert prober.dtype == "bfloat16" and tolerance(prober.dtype) == 0.1
    assert 0 < distance(prober.base, fp32) < 0.1  # the autocast forward's rounding: what the record's dtype says
