"""Per-sample attention of packed rows (`tidal.trainer.model.attention`) and `recipe: bf16` on CPU (bfloat16 autocast,
`tidal.trainer.model.precision`): checked against transformers' masked SDPA in float64 on every architecture of the
matrix, and against a hand-written mixed-precision computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.archs import ARCHS, config_for
from tidal.trainer.model.attention import ATTN_IMPLEMENTATION, register, segments
from tidal.trainer.step.logprobs import final_hidden, forward_logprobs, split_head


def packed_positions(rng: np.random.Generator, rows: int, width: int, pad: bool) -> torch.Tensor:
    """(rows, width) position ids of random-length samples packed back to back (and a padding run)."""
    out = []
    for r in range(rows):
        row: list[int] = []
        room = width - (int(rng.integers(3, 9)) if pad and r == 0 else 0)
        while len(row) < room:
            row += list(range(min(int(rng.integers(1, 30)), room - len(row))))
        row += list(range(width - len(row)))  # the padding's own run (empty without pad)
        out.append(row)
    return torch.tensor(out)


def test_segments_match_a_scan():
    rng = np.random.default_rng()
    pos = packed_positions(rng, 3, 97, pad=True)
    for row, spans in zip(pos.tolist(), segments(pos), strict=True):
        expect, start = [], 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[i - 1] + 1:
                expect.append((start, i))
                start = i
        assert spans == expect
        assert all(row[s] == 0 for s, _ in spans)


def _pair(name: str, dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    register()
    torch.manual_seed(0)  # a config each: from_config records the attention implementation on the config
    # the MoE's experts as transformers' per-expert loop: its default grouped matmul has no float64 kernel
    experts = {"experts_implementation": "eager"} if name.endswith("-moe") else {}
    ref = AutoModelForCausalLM.from_config(config_for(name), attn_implementation="sdpa", dtype=dtype, **experts)
    ours = AutoModelForCausalLM.from_config(config_for(name), attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype,
                                            **experts)
    assert ref.config._attn_implementation == "sdpa" != ours.config._attn_implementation
    ours.load_state_dict(ref.state_dict())
    return ref.train(), ours.train()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_per_sample_attention_equals_masked_sdpa(name):
    """Logprobs and every parameter's gradient equal the masked computation (float64), for each architecture:
    gemma2 (soft-capped attention, 64-token window) takes the fallback, the others the per-sample path. The MoEs
    run their experts one by one (`_pair`), in float64 too: in float32 the A_log gradient of qwen3.5-moe's linear
    attention (a sum over every token) missed a relative 1e-4 on some random draws."""
    rng = np.random.default_rng()
    ref, ours = _pair(name)
    ids = torch.from_numpy(rng.integers(3, 120, (2, 96)))
    pos = packed_positions(rng, 2, 96, pad=True)
    w = torch.from_numpy(rng.normal(size=ids.shape))
    grads, lps = [], []
    for m in (ref, ours):
        m.zero_grad()
        lp = forward_logprobs(m, ids, pos)
        (lp * w).sum().backward()
        lps.append(lp.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    atol, rtol = 1e-10, 1e-9
    torch.testing.assert_close(lps[1], lps[0], rtol=0, atol=atol)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=rtol, atol=max(atol / 10, rtol * float(g.abs().max())),
                                   msg=f"{name}: gradient of {n}")


def test_per_sample_path_is_taken_and_skips_cross_sample_keys():
    """The samples of a row are independent: changing one sample's tokens leaves the others' logprobs as they
    were (bit for bit on the per-sample path), and the masked kernel is not called."""
    from unittest import mock

    _, ours = _pair("qwen3")
    pos = torch.tensor([list(range(40)) + list(range(30)) + list(range(26))])
    ids = torch.randint(3, 120, (1, 96))
    changed = ids.clone()
    changed[0, :40] = torch.randint(3, 120, (40,))
    import transformers.integrations.sdpa_attention as sdpa

    with torch.no_grad(), mock.patch.object(sdpa, "sdpa_attention_forward", side_effect=AssertionError("masked")):
        a, b = forward_logprobs(ours, ids, pos), forward_logprobs(ours, changed, pos)
    assert torch.equal(a[0, 41:], b[0, 41:])  # position 40 is the second sample's first token (no prediction)
    assert not torch.equal(a[0, 1:40], b[0, 1:40])


def test_batch_without_position_ids():
    """transformers' own (1, T) default position ids (no packing) hold for every row of a batch."""
    ref, ours = _pair("llama3")
    ids = torch.randint(3, 120, (3, 21))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-10)


def test_padding_mask_takes_the_masked_path():
    """A left-padded batch with an attention mask is not what the spans say: the call goes to transformers' SDPA
    with the padding mask (same logits as the plain SDPA model on the real tokens)."""
    ref, ours = _pair("qwen3")
    ids = torch.randint(3, 120, (2, 17))
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0, 5:], b[0, 5:], rtol=0, atol=1e-10)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-10)


def _bf16_policy(tmp_path):
    from tidal.config.train import TrainConfig
    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_policy

    models = {}
    for recipe in ("fp32", "bf16"):
        torch.manual_seed(0)
        cfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), recipe=recipe, lora_rank=8)
        models[recipe], _ = load_policy(cfg)
    for p in models["bf16"].parameters():  # a trained-looking adapter: B != 0
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    models["fp32"].load_state_dict(models["bf16"].state_dict())
    return models


def test_recipe_bf16_on_cpu_autocasts_the_body_not_the_head(tmp_path):
    """`recipe: bf16` on CPU: float32 weights; the forward's matmuls in bfloat16 (the logprobs move away from
    float32 by bf16 rounding, not more), the lm_head in float32 (the logprobs equal a hand-written computation
    with a float32 head on the autocast body), and the chunked backward's gradients equal autograd's through that
    hand-written computation (to bf16 rounding)."""
    from tidal.trainer.model.precision import AUTOCAST_ATTR

    models = _bf16_policy(tmp_path)
    m = models["bf16"]
    assert getattr(m, AUTOCAST_ATTR) == torch.bfloat16 and getattr(models["fp32"], AUTOCAST_ATTR, None) is None
    assert all(p.dtype == torch.float32 for p in m.parameters())
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (2, 64)))
    pos = packed_positions(rng, 2, 64, pad=False)
    with torch.no_grad():
        full = forward_logprobs(models["fp32"], ids, pos, 0.8)
    lp = forward_logprobs(m, ids, pos, 0.8, chunk_size=7)
    gap = (lp.detach() - full).abs()[:, 1:]
    assert 1e-4 < float(gap.mean()) < 5e-2, "bf16 matmuls (not float32, not worse than bf16 rounding)"
    w = torch.from_numpy(rng.normal(size=lp.shape)).float()
    (lp * w).sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    head = split_head(m)
    assert head is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = final_hidden(m, head, ids, pos)
    with torch.autocast("cpu", enabled=False):
        z = head.lm_head(hidden.float()) / 0.8  # (B, T, V) float32 head
    manual = torch.nn.functional.pad(torch.log_softmax(z[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1),
                                     (1, 0))
    torch.testing.assert_close(lp.detach(), manual.detach(), rtol=0, atol=1e-5)
    (manual * w).sum().backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            # both run bf16 matmuls in the body's backward: the head's float32 gradients differ in the last
            # bits, which flip bf16 roundings downstream (measured up to 1.1% in norm over repeated draws)
            assert float((got[n] - p.grad).norm()) <= 5e-2 * float(p.grad.norm()), f"gradient of {n}"
