"""Chunked logprobs with a frozen lm_head (`tidal.trainer.step.logprobs`, the usual LoRA case): the forward keeps each
logprob's gradient w.r.t. its hidden state and the backward runs no lm_head at all; logprobs, entropies and the
gradients of every trainable parameter equal a float64 full-logits reference on fresh random inputs, over
architectures with a plain head, tied embeddings, soft-capping and scaled logits."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_logprobs_chunked import (
    TRANSFORM_OVERRIDES,
    fresh_generator,
    packed_inputs,
    reference,
    tiny_model,
)
from tidal.trainer.step.logprobs import Head, chunked_logprobs, forward_logprobs_entropy

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "GraniteForCausalLM", "CohereForCausalLM")


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_frozen_head_gradients_equal_the_float64_reference_without_a_backward_lm_head(arch, temperature):
    gen = fresh_generator()
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    model = tiny_model(arch, **TRANSFORM_OVERRIDES.get(arch, {})).train()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)  # logits where the transforms matter
    head = model.get_output_embeddings()
    for p in head.parameters():
        p.requires_grad_(False)  # a tied embedding too: the frozen head of LoRA on the linear layers
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    ids, pos, mask = packed_inputs(2, [9, 6, 11], gen)
    weights = torch.randn(ids.shape, dtype=torch.float64, generator=gen)

    calls = _count_calls(head)
    lp, ent = forward_logprobs_entropy(model, ids, pos, temperature, chunk_size=5, loss_mask=mask)
    forward_calls = calls[0]
    got = torch.autograd.grad((lp * weights).sum(), [p for _, p in trainable])
    # the model's own forward once (no logits kept), then one call per chunk; none in the backward
    assert forward_calls == 1 + -(-int(mask[:, 1:].sum()) // 5) and calls[0] == forward_calls
    want_lp, want_ent = reference(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, temperature)
    keep = torch.nn.functional.pad(mask[:, 1:], (1, 0))
    want_lp = torch.where(keep, want_lp, torch.zeros_like(want_lp))
    want = torch.autograd.grad((want_lp * weights).sum(), [p for _, p in trainable])

    torch.testing.assert_close(lp, want_lp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ent[keep], want_ent[keep].detach(), rtol=1e-10, atol=1e-12)
    for (name, _), g, w in zip(trainable, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{arch} {n}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_chunked_function_with_a_frozen_head(temperature):
    """`chunked_logprobs` alone: a frozen head with a bias; the gradient w.r.t. the hidden states equals the
    float64 full computation, and a trainable head still gets its gradient (the recomputing path)."""
    gen = fresh_generator()
    n, h, v = 37, 16, 61
    hidden = torch.randn(n, h, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    lin = torch.nn.Linear(h, v, dtype=torch.float64)
    g = torch.randn(n, dtype=torch.float64, generator=gen)
    want_lp = torch.log_softmax(lin(hidden) / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    want_h, want_w = torch.autograd.grad((want_lp * g).sum(), [hidden, lin.weight])

    calls = _count_calls(lin)
    lp, _ = chunked_logprobs(hidden, targets, Head(torch.nn.Identity(), lin, None), temperature, 8)
    (got_h, got_w) = torch.autograd.grad((lp * g).sum(), [hidden, lin.weight])  # trainable: recomputed
    assert calls[0] == 2 * 5
    torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-12)
    lin.requires_grad_(False)
    calls[0] = 0
    lp2, _ = chunked_logprobs(hidden, targets, Head(torch.nn.Identity(), lin, None), temperature, 8)
    (got_h2,) = torch.autograd.grad((lp2 * g).sum(), [hidden])
    assert calls[0] == 5  # the forward's five chunks only
    torch.testing.assert_close(lp2, want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h2, want_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_h, want_h, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # scoring only: no graph, no gradient computed
        lp3, _ = chunked_logprobs(hidden, targets, Head(torch.nn.Identity(), lin, None), temperature, 8)
    assert not lp3.requires_grad
    torch.testing.assert_close(lp3, want_lp.detach(), rtol=1e-12, atol=1e-12)
