"""Chunked log-probabilities (tidal.trainer.step.logprobs): values, entropies and gradients equal a float64
full-logits reference on fresh random inputs (temperature, tied and untied embeddings, a loss mask, a
LoRA-wrapped lm_head with dropout), and every architecture in LOGIT_TRANSFORMS reproduces the model's own
logits (soft-capping, scaling). Random-init models from transformers configs; no downloads, no timings."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from tidal.trainer.step.logprobs import (
    LOGIT_TRANSFORMS,
    Head,
    _warn_full_logits,
    chunked_logprobs,
    forward_logprobs,
    forward_logprobs_entropy,
    split_head,
)

V = 61  # a vocabulary that no chunk size below divides evenly


def fresh_generator() -> torch.Generator:
    """A generator on a fresh random seed (printed: pytest shows it when the test fails)."""
    seed = int(torch.randint(0, 2**31, (), generator=torch.Generator().manual_seed(torch.seed())))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def reference(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, V) logits -> (B, T) float64 logprobs of ids and entropies, aligned with ids (column 0 is 0)."""
    ls = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)  # (B, T-1, V)
    lp = ls.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    return torch.nn.functional.pad(lp, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


def tiny_model(arch: str, dtype: torch.dtype = torch.float64, **overrides: Any) -> torch.nn.Module:
    """A 2-layer random model of `arch` (a `*ForCausalLM` class name in LOGIT_TRANSFORMS)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common: dict[str, Any] = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_experts=4, num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    cfg = AutoConfig.for_model(MODEL_TYPES[arch], **(common | overrides))
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    assert type(model).__name__ == arch
    return model


MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "GemmaForCausalLM": "gemma", "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2", "SmolLM3ForCausalLM": "smollm3", "Glm4ForCausalLM": "glm4",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe", "CohereForCausalLM": "cohere", "Cohere2ForCausalLM": "cohere2",
    "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
}
# Transforms strong enough to matter on random logits (the defaults are near the identity there).
TRANSFORM_OVERRIDES: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {"final_logit_softcapping": 0.5}, "Gemma3ForCausalLM": {"final_logit_softcapping": 0.5},
    "GraniteForCausalLM": {"logits_scaling": 0.25}, "GraniteMoeForCausalLM": {"logits_scaling": 0.25},
    "CohereForCausalLM": {"logit_scale": 4.0}, "Cohere2ForCausalLM": {"logit_scale": 4.0},
}


def packed_inputs(rows: int, lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random ids, packed position_ids (restarting per sample) and a loss mask (the second half of each sample)."""
    width = sum(lengths)
    ids = torch.randint(0, V, (rows, width), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths]).repeat(rows, 1)
    mask = torch.cat([torch.arange(n) >= n // 2 for n in lengths]).repeat(rows, 1)
    return ids, pos, mask


def test_all_listed_architectures_have_a_test_model():
    assert set(LOGIT_TRANSFORMS) == set(MODEL_TYPES)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_equals_float64_reference(temperature, tied, chunk):
    """Logprobs at every position, entropies, and the gradients of every parameter (the lm_head/embedding
    weight included, tied or not) equal a float64 full-logits reference."""
    gen = fresh_generator()
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    model = tiny_model("Qwen3ForCausalLM" if tied else "LlamaForCausalLM", tie_word_embeddings=tied).train()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids, pos, _ = packed_inputs(2, [7, 11, 5], gen)
    weights = torch.randn(ids.shape, dtype=torch.float64, generator=gen)

    lp, ent = forward_logprobs_entropy(model, ids, pos, temperature, chunk_size=chunk)
    got = torch.autograd.grad((lp * weights).sum(), list(model.parameters()))
    want_lp, want_ent = reference(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, temperature)
    want = torch.autograd.grad((want_lp * weights).sum(), list(model.parameters()))

    assert lp.dtype == torch.float64 and lp.shape == ids.shape and torch.all(lp[:, 0] == 0)
    torch.testing.assert_close(lp, want_lp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ent, want_ent.detach(), rtol=1e-10, atol=1e-12)
    assert not ent.requires_grad
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_chunked_function_gradients_wrt_hidden_and_head(temperature):
    """`chunked_logprobs` alone on random (N, H) hidden states and an lm_head with a bias: values, entropies
    and the gradients w.r.t. hidden states, weight and bias equal the float64 full-logits computation."""
    gen = fresh_generator()
    n, h = 37, 16
    hidden = torch.randn(n, h, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (n,), generator=gen)
    head = torch.nn.Linear(h, V, dtype=torch.float64)
    g = torch.randn(n, dtype=torch.float64, generator=gen)

    lp, ent = chunked_logprobs(hidden, targets, Head(torch.nn.Identity(), head, None), temperature, 8, True)
    got = torch.autograd.grad((lp * g).sum(), [hidden, head.weight, head.bias])
    ls = torch.log_softmax(head(hidden) / temperature, dim=-1)
    want_lp = ls.gather(-1, targets[:, None]).squeeze(-1)
    want = torch.autograd.grad((want_lp * g).sum(), [hidden, head.weight, head.bias])
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    assert ent is not None
    torch.testing.assert_close(ent, -(ls.exp() * ls).sum(-1).detach(), rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_loss_mask_computes_only_loss_positions():
    """With a loss mask only the marked tokens get a logprob (equal to the unmasked one), the rest 0; the
    gradient of a loss over marked tokens is unchanged."""
    gen = fresh_generator()
    model = tiny_model("Qwen3ForCausalLM").train()
    ids, pos, mask = packed_inputs(3, [9, 6], gen)
    full, full_ent = forward_logprobs_entropy(model, ids, pos, 0.8, chunk_size=4)
    part, part_ent = forward_logprobs_entropy(model, ids, pos, 0.8, chunk_size=4, loss_mask=mask)
    torch.testing.assert_close(part[mask], full[mask], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part_ent[mask], full_ent[mask], rtol=1e-12, atol=1e-12)
    assert torch.all(part[~mask] == 0) and torch.all(part_ent[~mask] == 0)
    params = [p for p in model.parameters()]
    g_full = torch.autograd.grad(full[mask].sum(), params)
    g_part = torch.autograd.grad(part[mask].sum(), params)
    for a, b in zip(g_part, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the full-logits path (chunk size 0) follows the same convention
    zero = forward_logprobs(model, ids, pos, 0.8, chunk_size=0, loss_mask=mask)
    assert torch.all(zero[~mask] == 0)
    torch.testing.assert_close(zero[mask], full[mask].float(), rtol=1e-5, atol=1e-6)


def test_no_grad_and_all_masked():
    model = tiny_model("LlamaForCausalLM")
    ids, pos, mask = packed_inputs(1, [8], torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = forward_logprobs(model, ids, pos, chunk_size=3, loss_mask=mask)
    assert not lp.requires_grad and torch.count_nonzero(lp) == int(mask[:, 1:].sum())
    empty = forward_logprobs(model, ids, pos, chunk_size=3, loss_mask=torch.zeros_like(mask))
    assert torch.all(empty == 0)


@pytest.mark.parametrize("chunk", [4, 1000])
def test_lora_lm_head_with_dropout(chunk):
    """A LoRA-wrapped lm_head (PEFT, dropout on): the head module is called per chunk and the backward replays
    the forward's dropout masks, so the LoRA gradients equal autograd through the same chunked computation."""
    from peft import LoraConfig, get_peft_model

    gen = fresh_generator()
    model = get_peft_model(tiny_model("LlamaForCausalLM"), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["lm_head"], init_lora_weights=False)).train()
    head = split_head(model)
    assert head is not None and type(head.lm_head).__module__.startswith("peft")
    hidden = torch.randn(13, 32, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (13,), generator=gen)
    params = [p for p in head.lm_head.parameters() if p.requires_grad]
    assert params, "the LoRA factors of the head are trainable"

    torch.manual_seed(7)
    lp, _ = chunked_logprobs(hidden, targets, head, 0.9, chunk)
    torch.manual_seed(123)  # the backward must not depend on the RNG state at backward time
    got = torch.autograd.grad(lp.sum(), [hidden, *params])
    torch.manual_seed(7)
    want_lp = torch.cat([torch.log_softmax(head.lm_head(hidden[s:s + chunk]) / 0.9, dim=-1)
                         .gather(-1, targets[s:s + chunk, None]).squeeze(-1) for s in range(0, 13, chunk)])
    want = torch.autograd.grad(want_lp.sum(), [hidden, *params])
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", sorted(MODEL_TYPES))
def test_architecture_matches_its_own_logits(arch):
    """Each listed architecture: chunked logprobs and entropies equal those of the model's own logits (its
    forward applies soft-capping / scaling), and the transform matters where the architecture has one."""
    gen = fresh_generator()
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    model = tiny_model(arch, torch.float32, **TRANSFORM_OVERRIDES.get(arch, {})).eval()
    ids, pos, mask = packed_inputs(2, [10, 7], gen)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # logits of order 1-10, where the transforms matter
        want_lp, want_ent = reference(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, 0.7)
        lp, ent = forward_logprobs_entropy(model, ids, pos, 0.7, chunk_size=6, loss_mask=mask)
        torch.testing.assert_close(lp[mask], want_lp[mask].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[mask], want_ent[mask].float(), rtol=1e-5, atol=1e-5)
        head = split_head(model)
        assert head is not None and (head.transform is not None) == (arch in TRANSFORM_OVERRIDES)
        if head.transform is not None:
            plain = Head(head.body, head.lm_head, None)
            hidden = head.body(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[:, :-1][mask[:, 1:]]
            without, _ = chunked_logprobs(hidden, ids[:, 1:][mask[:, 1:]], plain, 0.7, 6)
            assert (without - lp[mask]).abs().max() > 1e-2, "the transform must make a difference here"


def test_unlisted_architecture_takes_the_full_logits_path(caplog):
    """An architecture not in LOGIT_TRANSFORMS (GPT-2) is scored from its own logits, with a warning."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    ids, pos, _ = packed_inputs(1, [12], torch.Generator().manual_seed(1))
    _warn_full_logits.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tidal.trainer.step.logprobs"), torch.no_grad():
        lp = forward_logprobs(model, ids, pos, 0.9, chunk_size=4)
        want, _ = reference(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, 0.9)
    assert "GPT2LMHeadModel" in caplog.text and "full logits" in caplog.text
    torch.testing.assert_close(lp, want.float(), rtol=1e-5, atol=1e-6)


def test_bfloat16_model_scores_in_float32():
    """A bfloat16 model: float32 logprobs close to the float32 softmax of its own bfloat16 logits."""
    model = tiny_model("Qwen3ForCausalLM", torch.bfloat16).eval()
    ids, pos, _ = packed_inputs(2, [16], torch.Generator().manual_seed(2))
    with torch.no_grad():
        lp = forward_logprobs(model, ids, pos, 1.0, chunk_size=5)
        want, _ = reference(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, 1.0)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, want.float(), rtol=0, atol=1e-5)


def test_entropy_with_its_gradient():
    """`entropy_grad` (train loss.entropy_coef): the same entropies as the float64 reference, at the loss positions,
    with the gradient of the reference's entropies wrt every parameter (to float32: the full-logits path scores in
    float32, as for any model)."""
    gen = fresh_generator()
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    model = tiny_model("LlamaForCausalLM").train()
    ids, pos, mask = packed_inputs(2, [7, 5], gen)
    weights = torch.randn(ids.shape, dtype=torch.float64, generator=gen)
    lp, ent = forward_logprobs_entropy(model, ids, pos, 0.8, chunk_size=4, loss_mask=mask, entropy_grad=True)
    assert ent.requires_grad
    got = torch.autograd.grad((ent * weights).sum() + lp.sum(), list(model.parameters()))
    keep = torch.nn.functional.pad(mask[:, 1:], (1, 0))
    ref_lp, ref_ent = reference(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, 0.8)
    ref_ent, ref_lp = torch.where(keep, ref_ent, 0.0), torch.where(keep, ref_lp, 0.0)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-6)
    want = torch.autograd.grad((ref_ent * weights).sum() + ref_lp.sum(), list(model.parameters()))
    assert any(float(w.abs().max()) > 1e-3 for w in want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-6)
