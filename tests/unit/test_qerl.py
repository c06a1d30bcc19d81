"""QeRL noise (seed 000): the sigma schedule, noisy RMSNorm weights in the published merged copy only (the
trainer keeps the clean ones), the same noise for the same policy (resume), and the settings it needs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.dist_worker import config, fixed_batch
from tidal.config import ConfigError, TrainConfig
from tidal.config.train import NoiseSchedulerConfig, TrainWeightBroadcast
from tidal.models.sources import resolve_model
from tidal.trainer.grpo import train_step
from tidal.trainer.model.noise import noisy_norms, norm_keys, qerl_noise, qerl_sigma
from tidal.trainer.policy import build_policy
from tidal.trainer.preflight import check_qerl
from tidal.trainer.publish.broadcast import checkpoint_keys, merged_state_dict, publish_adapter


def test_schedule_zero_first_then_geometric_from_start_to_end():
    cfg = NoiseSchedulerConfig(enabled=True, sigma_start=0.1, sigma_end=0.001, num_stages=5)
    sigmas = [qerl_sigma(n, 50, cfg) for n in range(1, 51)]
    assert sigmas[:10] == [0.0] * 10, "the first interval is noise-free"
    assert sigmas[10] == pytest.approx(0.1) and sigmas[-1] == pytest.approx(0.001)
    stages = sorted(set(sigmas[10:]), reverse=True)
    ratios = [b / a for a, b in zip(stages, stages[1:], strict=False)]
    assert len(stages) == 4 and ratios == pytest.approx([0.1 ** (2 / 3)] * 3)
    assert qerl_sigma(7, 50, NoiseSchedulerConfig(enabled=False)) == 0.0
    assert all(qerl_sigma(n, 10, NoiseSchedulerConfig(enabled=True, num_stages=1)) == 0 for n in range(1, 11))


def test_noise_lands_on_the_published_norms_only(tmp_path):
    cfg = config(1, 1, 16, "aipo").model_copy(update={"max_steps": 10, "noise_scheduler": NoiseSchedulerConfig(
        enabled=True, sigma_start=0.05, num_stages=2)})
    p = build_policy(cfg, 10)
    train_step(p.model, p.opt, fixed_batch(), cfg, p.device, p.pad_id, sched=p.sched)
    keys = checkpoint_keys(resolve_model(cfg.model))
    norms = norm_keys(p.model)
    assert "model.norm.weight" in norms and "model.layers.0.self_attn.q_norm.weight" in norms
    assert "model.layers.3.post_attention_layernorm.weight" in norms and set(norms) <= set(keys)
    noise = qerl_noise(cfg, 9)
    assert noise == (0.05, cfg.seed) and qerl_noise(cfg, 2) is None
    clean = merged_state_dict(p.model, keys)
    publish_adapter(p.model, tmp_path / "a", 9, merged_keys=keys, noise=noise)
    publish_adapter(p.model, tmp_path / "b", 9, merged_keys=keys, noise=noise)
    served = load_file(str(tmp_path / "a/broadcasts/step_9/merged/model.safetensors"))
    again = load_file(str(tmp_path / "b/broadcasts/step_9/merged/model.safetensors"))
    diffs = torch.cat([(served[k] - clean[k]).flatten() for k in norms])
    assert float(diffs.std()) == pytest.approx(0.05, rel=0.1) and abs(float(diffs.mean())) < 0.01
    assert all(torch.equal(served[k], clean[k]) for k in keys if k not in norms), "only the norms are noisy"
    assert all(torch.equal(served[k], again[k]) for k in keys), "policy 9's noise is the same every time"
    assert torch.equal(merged_state_dict(p.model, keys)["model.norm.weight"], clean["model.norm.weight"]), \
        "the trainer keeps the clean weights"
    pushed = noisy_norms(p.model, *noise, 9)  # the NCCL push sends these beside the merged LoRA weights
    assert sorted(pushed) == sorted(norms) and all(torch.equal(pushed[k], served[k]) for k in norms)
    assert all(torch.equal(t, clean[k]) for k, t in noisy_norms(p.model, 0.0, cfg.seed, 2).items()), \
        "a noise-free policy pushes the clean norms (undoing an earlier noisy push)"


def test_qerl_needs_merged_weights_or_the_push_and_a_run_length():
    on = {"noise_scheduler": NoiseSchedulerConfig(enabled=True), "max_steps": 10}
    cfg = TrainConfig(model="m").model_copy(update=on)
    merged = cfg.model_copy(update={"broadcast_merged": True})
    check_qerl(merged)
    check_qerl(cfg.model_copy(update={"lora": False}))  # a full policy is published as all its weights
    with pytest.raises(ConfigError, match="merged"):
        check_qerl(cfg)
    check_qerl(cfg.model_copy(update={"weight_broadcast": TrainWeightBroadcast(type="nccl")}))
    with pytest.raises(ConfigError, match="max_steps"):
        check_qerl(merged.model_copy(update={"max_steps": -1}))
    with pytest.raises(ValueError, match="only applies with noise_scheduler.enabled"):
        TrainConfig.model_validate({"model": "m", "noise_scheduler": {"sigma_start": "1e-1"}})
    assert TrainConfig.model_validate({"model": "m", "noise_scheduler": {"enabled": True, "sigma_start": "1e-1"}}
                                      ).noise_scheduler.sigma_start == 0.1
