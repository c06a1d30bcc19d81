"""On-policy distillation, the CPU-side parts (docs/algorithms.md, "On-policy distillation"): the reward-free
advantage (`advantage.type: none` + `loss.teacher_tau`) and the mixed one against float64 references on fresh
random inputs, the per-step metrics (`teacher/reverse_kl`, `teacher/latency_s`), and the refusals that keep a
reward-free run from training on nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.colocate.preflight import check_teacher
from tidal.config import ConfigError
from tidal.config.orch import AdvantageSection, OrchConfig
from tidal.config.train import LossConfig, TrainConfig
from tidal.orchestrator.advantage import compute_advantages
from tidal.orchestrator.distill import distill_metrics, reverse_kl_per_token
from tidal.orchestrator.preflight import check_orch, teacher_url
from tidal.trainer.step.loss import LossInputs, LossScale, policy_loss, token_view
from tidal.transport.batch import TrainingBatch


def packed(gen: torch.Generator, rows: int = 3, cols: int = 17) -> dict[str, torch.Tensor]:
    """A packed micro-batch: student logprobs near the sampler's (so no seed-000 mask fires), a teacher that
    disagrees, prompt tokens (mask 0) and padding (seq -1)."""
    lp = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    inf = lp + 0.01 * torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    teacher = lp - torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    mask = (torch.rand(rows, cols, generator=gen) > 0.3).to(torch.float64)
    seq = torch.arange(rows).repeat_interleave(cols).view(rows, cols).clone()
    seq[:, -3:] = -1
    return {"lp": lp, "inf": inf, "teacher": teacher, "mask": mask, "seq": seq}


@pytest.mark.parametrize("tau", [0.3, 1.0])
def test_reward_free_advantage_is_minus_tau_times_the_per_token_reverse_kl(tau):
    gen = torch.Generator().manual_seed(int(tau * 1000))
    c = packed(gen)
    lengths = c["mask"].sum(dim=1).to(torch.int64)
    adv = compute_advantages(AdvantageSection(type="none"), 3, np.array([0.2, 0.9, 0.4]), lengths.numpy(), None,
                             None)
    assert [a.shape for a in adv] == [(int(n),) for n in lengths] and all((a == 0).all() for a in adv)
    adv_bt = torch.zeros_like(c["lp"])  # what the packed batch carries: 0 on every token
    lp = c["lp"].clone().requires_grad_(True)
    x = LossInputs(logprobs=lp, old_logprobs=c["lp"], inference_logprobs=c["inf"], advantages=adv_bt,
                   loss_mask=c["mask"], seq_ids=c["seq"], teacher_logprobs=c["teacher"])
    cfg = LossConfig(teacher_tau=tau)
    on = (c["mask"] > 0) & (c["seq"] >= 0)
    # reference: per token, in float64 from the formula: A_t = -tau * (student_t - teacher_t)
    want = [-tau * (float(c["lp"][t]) - float(c["teacher"][t])) for t in zip(*torch.nonzero(on, as_tuple=True),
                                                                               strict=True)]
    got = token_view(x, cfg).adv
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(got, -tau * torch.from_numpy(reverse_kl_per_token(c["lp"][on].numpy(),
                                                                            c["teacher"][on].numpy())), atol=1e-12)
    # the aipo loss's gradient: d loss / d lp_t = -exp(lp_t - inf_t) * A_t / T_step on the loss tokens, 0 elsewhere
    tokens = float(on.sum())
    loss, _ = policy_loss(x, cfg, LossScale(step_tokens=tokens, step_sequences=3, micro_batches=1,
                                            max_completion_len=cols_of(c)))
    loss.backward()
    ref = torch.zeros_like(c["lp"])
    for (r, k), a in zip(torch.nonzero(on).tolist(), want, strict=True):
        ref[r, k] = -np.exp(float(c["lp"][r, k] - c["inf"][r, k])) * a / tokens
    assert lp.grad is not None and torch.allclose(lp.grad, ref, rtol=0, atol=1e-12)


def cols_of(c: dict[str, torch.Tensor]) -> int:
    return int(c["lp"].shape[1])


def test_mixed_advantage_adds_the_reward_advantage_and_the_distillation_term():
    gen = torch.Generator().manual_seed(7)
    c = packed(gen)
    reward_adv = torch.randn(c["lp"].shape, generator=gen, dtype=torch.float64)
    x = LossInputs(logprobs=c["lp"], old_logprobs=c["lp"], inference_logprobs=c["inf"], advantages=reward_adv,
                   loss_mask=c["mask"], seq_ids=c["seq"], teacher_logprobs=c["teacher"])
    on = (c["mask"] > 0) & (c["seq"] >= 0)
    got = token_view(x, LossConfig(adv_tau=0.5, teacher_tau=0.25)).adv
    want = [0.5 * float(reward_adv[t]) - 0.25 * (float(c["lp"][t]) - float(c["teacher"][t]))
            for t in zip(*torch.nonzero(on, as_tuple=True), strict=True)]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_reverse_kl_metric_is_the_mean_over_loss_tokens_only():
    rng = np.random.default_rng(3)
    n = 40
    mask = (rng.random(n) > 0.4).astype(np.int64)
    inf, teacher = -rng.random(n) * 4, -rng.random(n) * 4
    batch = TrainingBatch(step=1, temperature=1.0, tokens=np.arange(n), lengths=np.array([n]), loss_mask=mask,
                          inference_logprobs=inf.astype(np.float32), advantages=np.zeros(n),
                          rewards=np.zeros(1), policy_steps=np.zeros(1, dtype=np.int32), truncated=np.zeros(1, bool),
                          max_tokens=n, teacher_logprobs=teacher.astype(np.float32))
    m = distill_metrics(batch, 0.75)
    on = [i for i in range(n) if mask[i]]
    want = sum(float(np.float32(inf[i])) - float(np.float32(teacher[i])) for i in on) / len(on)
    assert m["teacher/reverse_kl"] == pytest.approx(want, abs=1e-9)
    assert m["teacher/latency_s"] == 0.75


def test_a_reward_free_run_needs_the_teacher_term():
    orch = OrchConfig.model_validate({"advantage": {"type": "none"}, "teacher": {"model": "m", "base_url": "u"}})
    with pytest.raises(ConfigError, match="teacher_tau is 0"):
        check_teacher(TrainConfig(model="m"), orch)
    check_teacher(TrainConfig(model="m", loss=LossConfig(teacher_tau=1.0)), orch)  # the recipe passes
    with pytest.raises(ConfigError, match="orch teacher is not set"):
        check_teacher(TrainConfig(model="m", loss=LossConfig(teacher_tau=1.0)), OrchConfig())


def test_grpo_orch_needs_the_teachers_address_and_says_how_to_start_one():
    orch = OrchConfig.model_validate({"teacher": {"model": "tidal:tiny-reverse"}})
    with pytest.raises(ConfigError, match="grpo-infer --model tidal:tiny-reverse"):
        teacher_url(orch)
    with pytest.raises(ConfigError, match="teacher.base_url is null"):
        check_orch(orch)
    given = OrchConfig.model_validate({"teacher": {"model": "m", "base_url": "http://h:1/v1"}})
    assert teacher_url(given) == "http://h:1/v1"


def test_an_environment_without_a_reward_trains_reward_free_but_not_otherwise():
    """An environment without a reward of its own (like `dataset`) and no reward function: refused, unless the run
    is reward-free (`advantage.type: none`)."""
    from tidal.orchestrator.scoring import Scorer

    class NoReward:
        has_reward, id, tooling = False, "dataset", None

    envs = {"d": NoReward()}
    with pytest.raises(ValueError, match="nothing scores the completions"):
        Scorer(envs, OrchConfig())  # type: ignore[arg-type]
    scorer = Scorer(envs, OrchConfig.model_validate({"advantage": {"type": "none"}}))  # type: ignore[arg-type]
    assert scorer.names == []
