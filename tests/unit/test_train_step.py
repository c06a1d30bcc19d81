"""`train_step` on the bundled model: the wiring around the pure loss (old logprobs, iterations, reference
pass, truncation masking) checked on hand-checkable cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.models.sources import resolve_model
from tidal.trainer.grpo import train_step
from tidal.trainer.model.load import load_policy
from tidal.trainer.step.logprobs import forward_logprobs
from tidal.trainer.step.optim import make_optimizer
from tidal.transport.batch import TrainingBatch


def own_batch(model: torch.nn.Module, rng: np.random.Generator, truncated: list[bool]) -> TrainingBatch:
    """Random samples whose inference logprobs are the model's own (a perfectly matched sampler)."""
    n = len(truncated)
    lengths = rng.integers(8, 20, n)
    tokens = rng.integers(3, 120, int(lengths.sum()))
    mask = np.concatenate([np.r_[np.zeros(4), np.ones(ln - 4)] for ln in lengths])
    lps = []
    for start, ln in zip(np.cumsum(lengths) - lengths, lengths, strict=True):
        ids = torch.from_numpy(tokens[start:start + ln]).long()[None]
        with torch.no_grad():
            lps.append(forward_logprobs(model, ids, torch.arange(ln)[None], 1.0)[0].numpy())
    adv = np.repeat(rng.normal(size=n), lengths)
    return TrainingBatch(step=1, temperature=1.0, tokens=tokens, lengths=lengths, loss_mask=mask,
                         inference_logprobs=np.concatenate(lps) * mask, advantages=adv * mask, rewards=np.zeros(n),
                         policy_steps=np.zeros(n), truncated=np.array(truncated), max_tokens=16)


@pytest.mark.parametrize("iterations", [1, 2])
def test_train_step_wiring(iterations):
    cfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), learning_rate=1e-2, per_device_train_batch_size=1,
                      sequence_len=40, loss={"loss_type": "dapo", "beta": 0.1, "num_iterations": iterations,
                                             "mask_truncated_completions": True})
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    batch = own_batch(model, np.random.default_rng(0), [True, False, False, True, False])
    m = train_step(model, opt, batch, cfg, device, pad_id=0)

    comp = [int(batch.loss_mask[s].sum()) for s in batch.samples()]
    assert m["masked/truncated"] == pytest.approx((comp[0] + comp[3]) / sum(comp))
    assert m["tokens"] == sum(comp) - comp[0] - comp[3]
    assert m["micro_batches"] > 1, "the case must span several micro-batches"
    assert m["mismatch_kl"] < 1e-9 and m["token_mult_prob_error"] == pytest.approx(1, abs=1e-5)
    assert m["sampling_importance_ratio"] == pytest.approx(1, abs=1e-5)
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {iterations}, "one optimizer step per iteration"
    if iterations == 1:  # the fresh adapter is the base model: policy == reference, no clipping
        assert m["kl"] == 0.0 and m["clip_ratio/region_mean"] == 0.0
    else:  # the second iteration moved away from both the reference and the old policy
        assert m["kl"] > 0 and m["clip_ratio/region_mean"] > 0


def test_merged_broadcast_equals_peft_merge(tmp_path):
    """The merged full weights a broadcast carries are PEFT's own merge of the trained adapter, under the base
    checkpoint's tensor names, and the training model is left as it was."""
    from safetensors.torch import load_file

    from tidal.trainer.publish.broadcast import checkpoint_keys, publish_adapter

    path = resolve_model("tidal:tiny-reverse")
    cfg = TrainConfig(model=path, learning_rate=1e-2, per_device_train_batch_size=2, sequence_len=40)
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    train_step(model, opt, own_batch(model, np.random.default_rng(1), [False] * 4), cfg, device, pad_id=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keys = checkpoint_keys(path)
    out = publish_adapter(model, tmp_path, 1, merged_keys=keys)
    merged = load_file(str(out / "merged" / "model.safetensors"))
    assert sorted(merged) == keys
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "training model untouched"
    reference = model.merge_and_unload().state_dict()
    original = load_file(f"{path}/model.safetensors")
    for k in keys:
        assert torch.allclose(merged[k], reference[k], atol=1e-6, rtol=1e-6), k
    changed = [k for k in keys if not torch.equal(merged[k], original[k])]
    assert changed and all("proj" in k for k in changed), "exactly the LoRA-targeted weights change"


def test_grad_norm_is_reported_after_clipping_as_the_seed_defines_it():
    cfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), learning_rate=1e-2, per_device_train_batch_size=2,
                      sequence_len=40, max_grad_norm=1e-4)
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    m = train_step(model, opt, own_batch(model, np.random.default_rng(3), [False] * 4), cfg, device, pad_id=0)
    assert m["grad_norm/pre_clip"] > 1e-4, "the raw gradient is larger than the threshold"
    assert m["grad_norm"] == pytest.approx(1e-4), "grad_norm is the norm after clipping"


def test_adaptive_entropy_bonus_in_the_train_step():
    """TRL's `use_adaptive_entropy` through the real train step: the bonus's entropies carry their gradient (the
    full-logits path) and each optimizer step's window moves the coefficient the run keeps (`Policy.entropy`)."""
    from tidal.trainer.step.entropy_control import EntropyControl

    cfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), learning_rate=1e-2, per_device_train_batch_size=1,
                      sequence_len=40, steps_per_generation=2,
                      loss={"loss_type": "dapo", "entropy_coef": 0.1, "use_adaptive_entropy": True,
                            "entropy_target": 100.0, "entropy_coef_delta": 0.05, "entropy_coef_max": 0.2})
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    ec = EntropyControl(cfg.loss.entropy_coef)
    batch = own_batch(model, np.random.default_rng(1), [False] * 4)
    m = train_step(model, opt, batch, cfg, device, pad_id=0, entropy=ec)
    assert m["optim/steps"] == 2 and 0 < ec.last_entropy < 100  # every step's entropy is below the target
    assert ec.coef == pytest.approx(0.2) and m["entropy_coef"] == pytest.approx(0.2)  # 0.1 + 0.05 twice (max 0.2)
    assert ec.applied(cfg.loss) == pytest.approx(0.2) and ec.window == [0.0, 0.0]
