"""Shared prompts (train `prompt_sharing`; `tidal.trainer.step.packing`, `tidal.trainer.model.attention`): each
prompt's tokens
are packed once, every sample's tokens keep their data and positions, and logprobs and gradients equal packing
every sample whole (float64, every architecture of the matrix; tidal's per-sample attention and SDPA with the 4D
mask), with far fewer tokens processed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.archs import ARCHS, config_for
from tidal.trainer.model.attention import layout, layout_mask, prompt_sharing_blocker
from tidal.trainer.step.logprobs import forward_logprobs
from tidal.trainer.step.packing import MicroBatch, pack, shared_tokens
from tidal.transport.batch import TrainingBatch


def group_batch(rng: np.random.Generator, prompts: int, group: int, vocab: int = 120,
                completion: tuple[int, int] = (1, 24), prompt: tuple[int, int] = (3, 30)) -> TrainingBatch:
    """GRPO-shaped: `prompts` random prompts x `group` random completions each (shuffled), plus one sample whose
    prompt nobody shares and one with no loss token."""
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    for _ in range(prompts):
        p = rng.integers(3, vocab, int(rng.integers(*prompt)))
        for _ in range(group):
            c = rng.integers(3, vocab, int(rng.integers(*completion)))
            mask = np.r_[np.zeros(len(p)), np.ones(len(c))]
            if len(c) > 3 and rng.random() < 0.3:  # a multi-turn sample: an environment reply inside
                mask[len(p) + 1:len(p) + 3] = 0
            samples.append((np.r_[p, c], mask))
    solo = rng.integers(3, vocab, 12)
    samples += [(solo, np.r_[np.zeros(5), np.ones(7)]), (rng.integers(3, vocab, 9), np.zeros(9))]
    order = rng.permutation(len(samples))
    tokens = np.concatenate([samples[i][0] for i in order])
    mask = np.concatenate([samples[i][1] for i in order])
    n, total = len(samples), len(tokens)
    return TrainingBatch(step=1, temperature=1.0, tokens=tokens, lengths=np.array([len(samples[i][0]) for i in order]),
                         loss_mask=mask, inference_logprobs=-rng.random(total) * mask,
                         advantages=rng.normal(size=total) * mask, rewards=rng.random(n), policy_steps=np.zeros(n),
                         truncated=rng.random(n) < 0.2, teacher_logprobs=-rng.random(total))


def by_token(micro: list[MicroBatch], values: list[torch.Tensor] | None = None) -> dict[tuple[int, int], tuple]:
    """(sample, position in it) -> (token, loss mask, inference lp, advantage, teacher lp[, value]) of every token
    the micro-batches hold (a shared prompt token once, under its first sample)."""
    out: dict[tuple[int, int], tuple] = {}
    for k, mb in enumerate(micro):
        assert mb.teacher_logprobs is not None
        for key, *rest in zip(zip(mb.seq_ids.flatten().tolist(), mb.position_ids.flatten().tolist(), strict=True),
                              mb.input_ids.flatten().tolist(), mb.loss_mask.flatten().tolist(),
                              mb.inference_logprobs.flatten().tolist(), mb.advantages.flatten().tolist(),
                              mb.teacher_logprobs.flatten().tolist(),
                              *([values[k].flatten().tolist()] if values is not None else []), strict=True):
            if key[0] >= 0:
                assert key not in out, f"token {key} packed twice"
                out[key] = tuple(rest)
    return out


@pytest.mark.parametrize("drop", [False, True])
def test_every_token_keeps_its_data_and_position_and_prompts_are_packed_once(drop):
    rng = np.random.default_rng()
    batch = group_batch(rng, prompts=5, group=6)
    whole = pack(batch, 96, 3, drop_truncated=drop)
    shared = pack(batch, 96, 3, drop_truncated=drop, share_prompts=True)
    a, b = by_token(whole), by_token(shared)
    assert set(b) <= set(a)
    assert all(b[k] == a[k] for k in b)  # same token, mask, logprob, advantage, teacher logprob at that position
    missing = set(a) - set(b)
    assert all(a[k][1] == 0 for k in missing)  # only prompt tokens are left out ...
    assert {k for k in a if a[k][1]} <= set(b)  # ... every loss token is there
    # each left-out token is a prompt token shared with a packed sample of the same prompt, and the saving is
    # (group - 1) x (prompt - 1) per prompt when a group fits one row
    assert shared_tokens(batch, shared) == len(missing) > 0
    assert shared_tokens(batch, whole) == 0
    # the tokens packed are the whole packing's less exactly those left out (a fixed share would depend on the
    # random lengths drawn: 0.75 failed once in ~2,000 draws)
    assert sum(mb.num_tokens for mb in shared) == sum(mb.num_tokens for mb in whole) - len(missing)
    assert all(mb.input_ids.shape[1] <= 96 for mb in shared)
    assert all(mb.attention_mask is None for mb in whole)
    assert any(mb.attention_mask is not None for mb in shared)


def test_a_group_longer_than_a_row_is_cut_each_part_with_its_prompt():
    rng = np.random.default_rng()
    batch = group_batch(rng, prompts=1, group=16, completion=(10, 20), prompt=(20, 21))
    micro = pack(batch, 64, 1, share_prompts=True)
    assert len(micro) > 2 and all(mb.input_ids.shape[1] <= 64 for mb in micro)
    assert set(by_token(micro)) >= {k for k, v in by_token(pack(batch, 64, 1)).items() if v[1]}
    for mb in micro:  # every suffix finds its prompt in its own row
        for spans, pos in zip(layout(mb.position_ids), mb.position_ids.tolist(), strict=True):
            for s, _, ps, q in spans:
                assert q == pos[s] and (q == 0 or pos[ps:ps + q] == list(range(q)))


def test_layout_mask_is_the_rule():
    """A suffix at position q attends to its row's last root's first q tokens and causally to itself."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 0, 1, 1, 2, 0]])
    m = layout_mask(pos)[0, 0]
    expect = torch.zeros(12, 12, dtype=torch.bool)
    for s, e in ((0, 5), (7, 9), (11, 12)):  # roots: causal
        expect[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
    expect[5:7, 0:2] = True  # suffix at 2 of root 0
    expect[5:7, 5:7] = torch.ones(2, 2, dtype=torch.bool).tril()
    expect[9:11, 7:8] = True  # suffix at 1 of root 7
    expect[9:11, 9:11] = torch.ones(2, 2, dtype=torch.bool).tril()
    assert torch.equal(m, expect)


def _models(name: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    from tests.unit.test_packed_attention import _pair

    ref, ours = _pair(name, dtype)
    return {"sdpa": ref, "tidal": ours}


def _run(model: torch.nn.Module, micro: list[MicroBatch], weight: dict[tuple[int, int], float],
         ) -> tuple[dict[tuple[int, int], float], dict[str, torch.Tensor]]:
    """Loss-token logprobs by (sample, position) and the gradients of Σ weight x logprob."""
    model.zero_grad()
    lps = []
    for mb in micro:
        lp = forward_logprobs(model, mb.input_ids, mb.position_ids, loss_mask=mb.loss_mask,
                              attention_mask=mb.attention_mask)
        keys = zip(mb.seq_ids.flatten().tolist(), mb.position_ids.flatten().tolist(), strict=True)
        w = torch.tensor([weight.get(k, 0.0) for k in keys], dtype=lp.dtype).view_as(lp)
        (lp * w * mb.loss_mask).sum().backward()
        lps.append(lp.detach())
    got = {k: v[-1] for k, v in by_token(micro, lps).items() if v[1]}
    return got, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_shared_prompts_give_the_unshared_logprobs_and_gradients(name):
    """float64 (the MoE's experts one by one: transformers' grouped-expert matmul has no float64 kernel); tidal's
    per-sample attention and SDPA with the micro-batch's 4D mask (the GPU path). gemma2/3/4 (64-token sliding
    windows) are refused instead, and so is qwen3.5 (linear attention: one sample per row,
    tests/unit/test_linear_attention_packing.py). Gradients to
    1e-6 relative: a shared prompt token sums its completions' gradients in one backward instead of in one copy
    each, and transformers' RMSNorm rounds through float32 even in a float64 model, which can turn a last-bit
    difference into a float32 one (a missing or wrong attention link would be off by far more)."""
    from tidal.models.families import has_linear_attention

    cfg = config_for(name)
    if getattr(cfg, "vision_config", None) is not None:  # a VLM checkpoint's text path: not shared either
        assert prompt_sharing_blocker(cfg, 96) == "it is a vision-language model"
        return
    if has_linear_attention(cfg):
        assert "linear-attention" in (prompt_sharing_blocker(cfg, 96) or "")
        return
    if getattr(cfg, "sliding_window", None):
        assert "sliding-window" in (prompt_sharing_blocker(cfg, 96) or "")
        assert prompt_sharing_blocker(cfg, 64) is None  # a window covering the row is fine
        return
    assert prompt_sharing_blocker(cfg, 96) is None
    rng = np.random.default_rng()
    batch = group_batch(rng, prompts=3, group=4)
    whole, shared = pack(batch, 96, 2), pack(batch, 96, 2, share_prompts=True)
    weight = {k: float(rng.normal()) for k in by_token(whole)}
    atol, rtol = 1e-10, 1e-6
    for impl, model in _models(name, torch.float64).items():
        lp_a, g_a = _run(model, whole, weight)
        lp_b, g_b = _run(model, shared, weight)
        assert lp_a.keys() == lp_b.keys() and lp_a
        torch.testing.assert_close(torch.tensor([lp_b[k] for k in lp_a]), torch.tensor(list(lp_a.values())),
                                   rtol=0, atol=atol, msg=f"{name} {impl}: logprobs")
        assert g_a.keys() == g_b.keys() and g_a
        for n, g in g_a.items():
            torch.testing.assert_close(g_b[n], g, rtol=rtol, atol=max(atol, rtol * float(g.abs().max())),
                                       msg=f"{name} {impl}: gradient of {n}")


def test_shared_rows_take_the_per_sample_path(monkeypatch):
    """With the layout mask, tidal's attention never calls the masked SDPA; a mask that differs from the layout (the
    block mask transformers builds from the same position ids) does, and so gives other logprobs."""
    import transformers.integrations.sdpa_attention as sdpa

    model = _models("qwen3", torch.float64)["tidal"]
    rng = np.random.default_rng()
    micro = pack(group_batch(rng, prompts=2, group=4), 128, 4, share_prompts=True)
    mb = micro[0]
    assert mb.attention_mask is not None
    calls = []
    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        lp = forward_logprobs(model, mb.input_ids, mb.position_ids, loss_mask=mb.loss_mask,
                              attention_mask=mb.attention_mask)
        assert not calls
        blind = forward_logprobs(model, mb.input_ids, mb.position_ids, loss_mask=mb.loss_mask)
    assert calls  # transformers' block mask hides the prompt from the suffixes: the masked path, other numbers
    assert not torch.allclose(lp, blind)


def test_train_step_shares_prompts_with_the_same_result(tmp_path):
    """A GRPO step with `prompt_sharing: auto` and `false` on the same batch: the same loss and gradient norm, and
    the shared step reports the tokens it did not process."""
    from tests.archs import build
    from tidal.config.train import TrainConfig
    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer

    path = build("llama3", tmp_path / "m")
    rng = np.random.default_rng()
    batch = group_batch(rng, prompts=4, group=8)
    out = {}
    for mode in ("auto", False):
        cfg = TrainConfig(model=str(path), lora=True, lora_rank=4, sequence_len=128, per_device_train_batch_size=2,
                          device="cpu", prompt_sharing=mode, learning_rate=1e-3)
        torch.manual_seed(0)
        model, device = load_policy(cfg)
        out[mode] = train_step(model, make_optimizer(model, cfg), batch, cfg, device, pad_id=0)
    assert out["auto"]["prompt_sharing/saved_tokens"] > 0 == out[False]["prompt_sharing/saved_tokens"]
    assert out["auto"]["processed_tokens"] + out["auto"]["prompt_sharing/saved_tokens"] == \
        out[False]["processed_tokens"]
    for key in ("loss", "grad_norm", "tokens", "mismatch_kl"):
        assert out["auto"][key] == pytest.approx(out[False][key], rel=1e-5, abs=1e-7), key


def test_prompt_sharing_on_with_a_model_it_cannot_serve_is_a_config_error(tmp_path):
    from tests.archs import build
    from tidal.config.load import ConfigError
    from tidal.config.train import TrainConfig
    from tidal.trainer.preflight import check_prompt_sharing

    path = build("gemma2", tmp_path / "g")
    with pytest.raises(ConfigError, match="prompt_sharing: true.*sliding-window.*sequence_len"):
        check_prompt_sharing(TrainConfig(model=str(path), sequence_len=256, prompt_sharing=True))
    check_prompt_sharing(TrainConfig(model=str(path), sequence_len=256, prompt_sharing="auto"))
