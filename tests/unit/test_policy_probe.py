"""The policy identity probe (`tidal.transport.probe`, `tidal.trainer.publish.probe`): the distance against a float64
reference on fresh random inputs, the rule (fires on a stale or foreign policy, never on a step that barely moved
the policy), the record written inside the policy directory before its STABLE, and the trainer's probe logprobs
against a float64 forward of two architectures (LoRA: the base is the model with its adapters off)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tidal.transport.probe import (
    PROBE_FILE,
    PROBE_LEN,
    PROBE_LEN_16BIT,
    ProbeRecord,
    Verdict,
    distance,
    judge,
    position,
    probe_ids,
    probe_length,
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
    assert not stale.ok and stale.diagnosis().startswith("it serves the previous policy: its logprobs sit at 0.00 ")
    v = judge(list(base), rec, tol)
    assert not v.ok and v.diagnosis().startswith("it serves the base model: its logprobs sit at 0.00 ")
    first = judge(list(base), record(new, base, base), tol)  # policy 1: its previous is the base
    assert first.diagnosis().startswith("it serves the base model")
    foreign = judge(list(base + 3.0), rec, tol)
    assert not foreign.ok and foreign.diagnosis().startswith("it serves none of the trainer's policies (closest: ")
    line = stale.line("the inference server", 7, "/run/broadcasts/step_7", "orch weight_broadcast.policy_check: false")
    assert "\n" not in line and "step 7" in line and "/run/broadcasts/step_7" in line
    assert f"{stale.gap_new:.4g}" in line and f"{stale.gap_previous:.4g}" in line


@pytest.mark.parametrize("moved", [0.0, 1e-4, 4e-3])
def test_a_step_the_noise_hides_never_alarms(moved):
    """Tiny lr: new and previous closer than the served noise; whichever of them vLLM serves, the check is quiet,
    even when the served one is "closer" to the previous policy: neither the distance (within the tolerance) nor
    the projection (resolution below 1) can tell them apart."""
    rng = np.random.default_rng()
    tol = tolerance("float32")
    for _ in range(200):
        prev = -rng.uniform(0.5, 5.0, PROBE_LEN)
        new = prev + rng.choice([-1, 1], PROBE_LEN) * moved
        noise = max(moved, 1e-5) * 1.5
        for served in (prev, new, (prev + new) / 2):
            v = judge(list(served + rng.normal(0, noise, PROBE_LEN)), record(new, prev, prev), tol)
            assert v.ok, (moved, v)


def test_position_against_a_float64_reference():
    rng = np.random.default_rng()
    stale, new = rng.normal(size=PROBE_LEN), rng.normal(size=PROBE_LEN)
    served = stale + 0.3 * (new - stale) + rng.normal(0, 0.1, PROBE_LEN)
    d, x = (new - stale)[1:], (served - stale)[1:]
    pos = float(x @ d / (d @ d))
    r = x - pos * d
    se = np.sqrt((r @ r) / (len(r) - 1) / (d @ d))
    res = float(min(np.abs(d).sum() / np.abs(r).sum(), 0.1 / se))
    got = position(list(served), list(stale), list(new))
    assert got == pytest.approx((pos, res), rel=1e-10)
    assert position(list(new), list(new), list(new)) == (0.0, 0.0)  # nothing to project on
    assert position(list(new), list(stale), list(new)) == (pytest.approx(1.0), math.inf)


@pytest.mark.parametrize("noise", [0.04, 0.05])
def test_a_16_bit_sampler_is_told_from_the_previous_policy_once_the_move_resolves(noise):
    """A bf16 sampler's noise (~0.04 a token on CPU) is larger than one step's move, so the distance cannot tell
    policy n from n - 1 (both within the 0.1 tolerance); the projection can, once the move is as large as the noise
    in the mean: policy n passes, policy n - 1 and the base are named, over fresh draws."""
    rng, N = np.random.default_rng(), PROBE_LEN_16BIT  # what a 16-bit trainer publishes
    tol = tolerance("bfloat16")
    for _ in range(100):
        base = -rng.uniform(0.5, 12.0, N)
        prev = base + rng.normal(0, 0.1, N)
        new = prev + rng.normal(0, noise * 1.5, N)  # mean |move| 1.5x the noise's mean |.|
        rec = record(new, prev, base, dtype="bfloat16")
        assert judge(list(new + rng.normal(0, noise, N)), rec, tol).ok
        stale = judge(list(prev + rng.normal(0, noise, N)), rec, tol)
        assert stale.gap_new <= tol  # the distance alone would have passed it
        assert not stale.ok and stale.diagnosis().startswith("it serves the previous policy")
        stuck = judge(list(base + rng.normal(0, noise, N)), rec, tol)
        assert not stuck.ok and stuck.diagnosis().startswith("it serves the base model")


def test_a_record_cut_to_a_shorter_context_keeps_its_first_tokens():
    rec = record(np.arange(10.0), np.arange(10.0) + 1, None)
    cut = rec.prefix(probe_length(5))
    assert cut.ids == rec.ids[:4] and cut.new == rec.new[:4] and cut.previous == rec.previous[:4]
    assert cut.base is None and rec.prefix(50) is rec
    assert probe_length(None) == PROBE_LEN == probe_length(10_000) and probe_length(20) == 19
    assert probe_length(None, "bfloat16") == PROBE_LEN_16BIT == probe_length(4096, "float16") > PROBE_LEN


def test_tolerance_by_dtype_and_override():
    assert tolerance("float32") == 0.01 and tolerance("bfloat16") == 0.1 == tolerance("float16")
    assert tolerance("float32", 0.5) == 0.5
    assert tolerance("float8_e4m3fn") == 0.1  # unknown: the 16-bit one


def test_probe_ids_are_fixed_and_inside_the_vocabulary():
    for vocab in (50, 128, 151_936):
        ids = probe_ids(vocab)
        assert ids == probe_ids(vocab) and len(ids) == PROBE_LEN
        assert all(3 <= i < vocab for i in ids) and len(set(ids)) > min(PROBE_LEN, vocab - 3) // 3


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


def test_a_cpu_bf16_trainer_scores_its_probe_without_the_autocast():
    """Train `recipe: bf16` on CPU keeps float32 weights and autocasts the matmuls: the record names bfloat16 (the
    sampler `tidal grpo` pairs with it serves bf16: tolerance 0.1, the 16-bit probe length), but its values are the
    policy those float32 weights define, scored without the autocast (whose own rounding noise would blur the
    projection), and the model's forwards autocast again afterwards."""
    from tidal.trainer.model.precision import apply_recipe, autocast_dtype
    from tidal.trainer.publish.probe import Prober, score
    from tidal.trainer.step.logprobs import forward_logprobs

    class Tok:
        def __len__(self) -> int:
            return 96

    torch.manual_seed(0)
    model = tiny("llama")
    assert Prober(model, Tok()).dtype == "float32" and len(Prober(model, Tok()).ids) == PROBE_LEN
    ids = probe_ids(96, PROBE_LEN_16BIT)
    fp32 = score(model, ids)
    x, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
    with torch.no_grad():
        plain = forward_logprobs(model.eval(), x, pos, 1.0)[0]
        model = apply_recipe(model, "bf16", torch.device("cpu"))
        cast = forward_logprobs(model, x, pos, 1.0)[0]
    prober = Prober(model, Tok())
    assert prober.dtype == "bfloat16" and tolerance(prober.dtype) == 0.1 and prober.ids == ids
    assert prober.base == fp32 and autocast_dtype(model) == torch.bfloat16
    with torch.no_grad():
        again = forward_logprobs(model, x, pos, 1.0)[0]
    assert torch.equal(again, cast) and not torch.equal(cast, plain)  # the loss's forwards still autocast


def test_real_bf16_vllm_logprobs_of_fifteen_policies():
    """Replays what a bf16 vLLM on CPU served for each policy of a real SmolLM2 run (tests/data, bench/PROBE-68.md)
    against the trainer's float32 records, as `IdentityCheck` runs it (the record's previous policy and base, the
    policies checked before): serving policy n never alarms, though the served noise (~0.04) exceeds one step's
    move; a sampler stuck on policy j is caught within 5 steps for every j <= 11 (the distance alone: 6-9 steps
    for j <= 8, never after), and one step's staleness (n - 1) mostly is not, as documented."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parents[1] / "data/probe_bf16_smollm2.json").read_text())
    n16 = probe_length(None, "bfloat16")
    t, served = ([v[:n16] for v in data[k]] for k in ("trainer", "served"))
    assert probe_ids(49152, n16) == data["ids"][:n16]
    tol = tolerance("bfloat16")

    def verdict(j: int, n: int) -> Verdict:
        rec = ProbeRecord(step=n, ids=data["ids"][:n16], new=t[n], dtype="bfloat16", previous=t[n - 1],
                          previous_step=n - 1,
                          base=t[0])
        return judge(served[j], rec, tol, {k: t[k] for k in range(max(n - 8, 1), n)})

    assert all(verdict(n, n).ok for n in range(1, len(t)))
    for j in range(12):
        lag = next(n - j for n in range(j + 1, len(t)) if not verdict(j, n).ok)
        by_distance = next((n - j for n in range(j + 1, len(t)) if distance(served[j], t[n]) > tol), None)
        assert lag <= 5 and (by_distance is None or by_distance > lag), (j, lag, by_distance)
    one_step = sum(not verdict(n - 1, n).ok for n in range(2, len(t)))
    assert one_step <= 4, one_step  # documented: one step mostly moves less than the noise (2 of 14 caught here)
