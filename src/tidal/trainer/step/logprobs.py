"""Per-token log-probabilities of the tokens in a (packed) row under the model, at a sampling temperature.

Convention: arrays are aligned with `input_ids`; `logprobs[:, i]` is log p(input_ids[:, i] | input_ids[:, :i]),
computed from the logits at position i-1; position 0 has no prediction and gets 0. Logits are divided by the
temperature the rollouts were sampled at, so the trainer scores the distribution vLLM actually sampled from
(vLLM runs with `--logprobs-mode processed_logprobs`).

Memory (train `logprob_chunk_size`): the logits of a packed micro-batch are (rows, T, vocab): 4k tokens of a
152k vocabulary are 2.5 GB in float32, more than the rest of a small model's step. So by default they never
exist whole. `forward_logprobs_entropy` runs the base transformer for the final hidden states (B, T, H), keeps
only the positions whose next token carries loss (`loss_mask`; prompt tokens and padding are skipped; without a
mask every position), and `chunked_logprobs` applies the lm_head to `chunk_size` of them at a time: lm_head,
the architecture's own logit transform (`LOGIT_TRANSFORMS`: soft-capping, scaling), upcast to float32, divide by
the temperature, log-softmax, gather the token; the entropy metric comes from the same chunk. The forward keeps
nothing per chunk; the backward (`_ChunkedLogprobs`, a custom autograd Function) rebuilds each chunk's graph
from the saved (N, H) hidden states (and the saved RNG state, for a head with dropout) and lets autograd
differentiate it, one chunk at a time. So a step holds a few (chunk, vocab) float32 buffers at any length, and
the kernels are the full-logits path's: in float32 the logprobs and gradients are bit for bit the same
(tests/unit/test_golden_trajectory.py passes unchanged). Gradients reach the hidden states and every trainable
parameter of the lm_head (tied embeddings, a LoRA-wrapped head): the head module is called per chunk, its
weight never read directly. Positions outside `loss_mask` get 0 (in both paths): the loss, the old/reference
logprobs and the drift metrics read loss tokens only.

A frozen head (LoRA on the linear layers, which leaves the lm_head and a tied embedding frozen: the usual case)
needs no recomputation: each logprob depends on its own position's hidden state only, so the forward, with
autograd on, differentiates each chunk right away and keeps the (N, H) gradient of every logprob w.r.t. its hidden
state (as many values as the hidden states the recomputing path keeps), and the backward only scales it by the
incoming gradient. One lm_head matmul and one (chunk, vocab) log-softmax fewer per loss token (the lm_head's
share of a SmolLM2 step: bench/TRAINER-STEP.md); the same math, rounded in another order (the incoming gradient
multiplies after the matmul instead of before), equal to the recomputing path to float64 rounding
(tests/unit/test_logprobs_chunked.py). A forward without autograd (no-grad scoring, skipped micro-batches) does
none of it.

The full-logits path (the model's own `forward`, then `token_logprobs`) is kept for `chunk_size` 0 and for
architectures not in `LOGIT_TRANSFORMS`, whose logits the chunked path might not reproduce (one warning per
architecture). tests/unit/test_logprobs_chunked.py checks every listed architecture against the model's logits.

Mixed precision (train `recipe: bf16` on CPU, `tidal.trainer.model.precision`): a model carrying an autocast dtype runs
every forward here under `torch.autocast` to it, except the lm_head on the chunked path, which multiplies in the
weights' dtype (float32): the logits are what the logprobs are, and bfloat16 would round them (the full-logits
path is the model's own forward, lm_head included, under autocast). The chunked backward restores the
forward's autocast state before it rebuilds a chunk's graph.

Vision-language models: with `images` (a micro-batch's `tidal.trainer.model.vision.ImageInputs`) the model runs on
input embeddings that carry the image features (`tidal.trainer.model.vision.embed`); the targets are the token ids.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tidal.config.train import DEFAULT_LOGPROB_CHUNK_SIZE
from tidal.trainer.model.precision import autocast_dtype
from tidal.trainer.model.vision import model_inputs
from tidal.trainer.profile import LM_HEAD

log = logging.getLogger(__name__)

LogitTransform = Callable[[torch.Tensor], torch.Tensor]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, T, V) logits and (B, T) ids -> (B, T) float32 logprobs, aligned with ids (column 0 is 0)."""
    scaled = logits[:, :-1].float() / temperature  # (B, T-1, V) predicts ids[:, 1:]
    lp = torch.log_softmax(scaled, dim=-1).gather(-1, input_ids[:, 1:, None].long()).squeeze(-1)  # (B, T-1)
    return torch.nn.functional.pad(lp, (1, 0))  # (B, T)


def entropy(logits: torch.Tensor, temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """(B, T, V) -> (B, T) entropy of the next-token distribution, aligned like `token_logprobs`. Computed
    `chunk` positions at a time so a large vocabulary does not need a second full (B, T, V) float32 copy."""
    parts = []
    for start in range(0, logits.shape[1] - 1, chunk):
        lp = torch.log_softmax(logits[:, start:min(start + chunk, logits.shape[1] - 1)].float() / temperature, dim=-1)
        parts.append(-(lp.exp() * lp).sum(-1))
    ent = torch.cat(parts, dim=1) if parts else logits.new_zeros(logits.shape[0], 0, dtype=torch.float32)
    return torch.nn.functional.pad(ent, (1, 0))


# --- what each architecture's `*ForCausalLM.forward` does to `lm_head(hidden)` (transformers 5.x) ---------------

def _plain(lm: Any) -> LogitTransform | None:
    return None


def _softcap(lm: Any) -> LogitTransform | None:
    """Gemma 2/3: `tanh(logits / cap) * cap` with `config.final_logit_softcapping` (None: off)."""
    cap = lm.config.final_logit_softcapping
    return None if cap is None else (lambda z: torch.tanh(z / cap) * cap)


def _divide_by_logits_scaling(lm: Any) -> LogitTransform | None:
    """Granite: `logits / config.logits_scaling`."""
    scale = float(lm.config.logits_scaling)
    return lambda z: z / scale


def _times_logit_scale(lm: Any) -> LogitTransform | None:
    """Cohere: `logits * self.logit_scale` (the module attribute, from `config.logit_scale`)."""
    scale = float(lm.logit_scale)
    return lambda z: z * scale


PLAIN_HEADS = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
               "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM",
               "Phi3ForCausalLM", "Olmo2ForCausalLM", "SmolLM3ForCausalLM", "Glm4ForCausalLM", "Qwen3_5ForCausalLM",
               "Qwen3_5MoeForCausalLM")
LOGIT_TRANSFORMS: dict[str, Callable[[Any], LogitTransform | None]] = {
    **dict.fromkeys(PLAIN_HEADS, _plain),
    "Gemma2ForCausalLM": _softcap, "Gemma3ForCausalLM": _softcap,
    "GraniteForCausalLM": _divide_by_logits_scaling, "GraniteMoeForCausalLM": _divide_by_logits_scaling,
    "CohereForCausalLM": _times_logit_scale, "Cohere2ForCausalLM": _times_logit_scale,
}
"""`*ForCausalLM` class name -> its logit transform. Each listed class computes `self.model(...)
.last_hidden_state`, then `self.lm_head(hidden)` and only this transform (read from transformers' source)."""
def _text_softcap(lm: Any) -> LogitTransform | None:
    """Gemma 4's VLM: the soft-capping of its text config (`config.get_text_config().final_logit_softcapping`)."""
    cap = lm.config.get_text_config().final_logit_softcapping
    return None if cap is None else (lambda z: torch.tanh(z / cap) * cap)


VLM_LOGIT_TRANSFORMS: dict[str, Callable[[Any], LogitTransform | None]] = {
    "Idefics3ForConditionalGeneration": _plain, "Qwen2_5_VLForConditionalGeneration": _plain,
    "Qwen3VLForConditionalGeneration": _plain, "Qwen3_5ForConditionalGeneration": _plain,
    "Qwen3_5MoeForConditionalGeneration": _plain, "Gemma3ForConditionalGeneration": _plain,
    "Gemma4ForConditionalGeneration": _text_softcap,
}
"""The same for vision-language models (`*ForConditionalGeneration`; checked by tests/unit/test_vlm.py and, for the
text paths of `tidal.models.families.TEXT_PATH_VLMS`, tests/unit/test_vlm_text_path.py). Gemma 3's VLM applies no
soft-capping in transformers 5 (its text model's `final_logit_softcapping` is None in Gemma 3's checkpoints)."""


@dataclass(frozen=True)
class Head:
    """A causal LM split at its final hidden states."""

    body: torch.nn.Module
    """The base transformer: ids -> (B, T, H) final hidden states (after the final norm)."""
    lm_head: torch.nn.Module
    """(..., H) -> (..., V) logits in the model's dtype (possibly LoRA-wrapped)."""
    transform: LogitTransform | None
    """The architecture's transform of the (float32) logits; None: none."""


def split_head(model: torch.nn.Module) -> Head | None:
    """The `Head` of `model` (a PEFT-wrapped or plain `*ForCausalLM`); None for an architecture not in
    `LOGIT_TRANSFORMS` (the caller takes the full-logits path)."""
    get_base = getattr(model, "get_base_model", None)
    lm: Any = get_base() if callable(get_base) else model  # PEFT: the *ForCausalLM, LoRA layers injected in place
    make = LOGIT_TRANSFORMS.get(type(lm).__name__) or VLM_LOGIT_TRANSFORMS.get(type(lm).__name__)
    if make is None:
        _warn_full_logits(type(lm).__name__)
        return None
    return Head(body=lm.model, lm_head=lm.lm_head, transform=make(lm))


@functools.cache
def _warn_full_logits(name: str) -> None:
    log.warning("logprobs: %s is not among the architectures whose logits tidal computes in chunks "
                "(tidal.trainer.step.logprobs.LOGIT_TRANSFORMS); using its full logits (more memory)", name)


# --- the chunked computation ---------------------------------------------------------------------------------------

def _chunk_logits(head: Head, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """(c, H) hidden states -> (c, V) logits, at least float32, transformed and divided by the temperature.
    Under autocast the lm_head multiplies in its weights' dtype (see the module doc)."""
    if torch.is_autocast_enabled(hidden.device.type):
        weight = getattr(head.lm_head, "weight", None)
        dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else hidden.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            z = head.lm_head(hidden.to(torch.promote_types(dtype, hidden.dtype)))  # (c, V)
    else:
        z = head.lm_head(hidden)  # (c, V) model dtype
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if head.transform is not None:
        z = head.transform(z)
    return z / temperature if temperature != 1.0 else z


class _RngState:
    """The CPU (and current CUDA device's) RNG state at a point, to replay dropout in the recomputation."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _ChunkedLogprobs(torch.autograd.Function):
    """(N, H) hidden states, (N,) targets -> (N,) logprobs (+ (N,) detached entropies); see the module doc."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, head: Head, temperature: float,
                chunk: int, with_entropy: bool, eager: bool,
                *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = torch.promote_types(hidden.dtype, torch.float32)
        lp = hidden.new_empty(hidden.shape[0], dtype=dt)  # (N,)
        ent = hidden.new_empty(hidden.shape[0] if with_entropy else 0, dtype=dt)  # (N,) or (0,)
        dlp = torch.empty_like(hidden) if eager else None  # (N, H): d logprob_i / d hidden_i (a frozen head)
        ctx.rng = _RngState(hidden.device)
        with torch.profiler.record_function(LM_HEAD):
            for s in range(0, hidden.shape[0], chunk):
                with torch.enable_grad() if eager else contextlib.nullcontext():
                    h = hidden[s:s + chunk].detach().requires_grad_(True) if eager else hidden[s:s + chunk]
                    ls = torch.log_softmax(_chunk_logits(head, h, temperature), dim=-1)  # (c, V)
                    part = ls.gather(-1, targets[s:s + chunk, None]).squeeze(-1)  # (c,)
                if dlp is not None:  # rows are independent: the gradient of the sum is each row's own
                    dlp[s:s + chunk] = torch.autograd.grad(part, h, torch.ones_like(part))[0]
                    ls, part = ls.detach(), part.detach()
                lp[s:s + chunk] = part
                if with_entropy:
                    ent[s:s + chunk] = -(ls.exp().mul_(ls)).sum(-1)
        ctx.eager = dlp is not None
        if dlp is not None:
            ctx.save_for_backward(dlp)
        else:
            ctx.save_for_backward(hidden, targets, *params)
        ctx.head, ctx.temperature, ctx.chunk = head, temperature, chunk
        dev = hidden.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor, _grad_ent: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.eager:  # a frozen head: the forward kept each logprob's gradient w.r.t. its hidden state
            (dlp,) = ctx.saved_tensors
            return (dlp * grad_lp[:, None].to(dlp.dtype), None, None, None, None, None, None)
        hidden, targets, *params = ctx.saved_tensors
        want_h = bool(ctx.needs_input_grad[0])
        want_p = [i for i, need in enumerate(ctx.needs_input_grad[7:]) if need]
        grad_h = torch.empty_like(hidden) if want_h else None  # (N, H)
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        dev, cast, cast_dtype = ctx.autocast
        with (torch.random.fork_rng(devices=[hidden.device] if hidden.device.type == "cuda" else []),
              torch.autocast(dev, dtype=cast_dtype, enabled=cast), torch.profiler.record_function(LM_HEAD)):
            ctx.rng.restore()  # the same dropout masks as the forward (a LoRA lm_head with dropout)
            for s in range(0, hidden.shape[0], ctx.chunk):
                with torch.enable_grad():  # the chunk's graph again: autograd keeps one (c, V) log-softmax
                    h = hidden[s:s + ctx.chunk].detach().requires_grad_(want_h)  # (c, H)
                    ls = torch.log_softmax(_chunk_logits(ctx.head, h, ctx.temperature), dim=-1)  # (c, V)
                    lp = ls.gather(-1, targets[s:s + ctx.chunk, None]).squeeze(-1)  # (c,)
                del ls
                inputs = ([h] if want_h else []) + [params[i] for i in want_p]
                grads = torch.autograd.grad(lp, inputs, grad_lp[s:s + ctx.chunk], allow_unused=True)
                del lp
                if want_h and grad_h is not None:
                    grad_h[s:s + ctx.chunk] = grads[0]
                for i, g in zip(want_p, grads[int(want_h):], strict=True):
                    acc = grad_p[i]
                    if g is not None:
                        grad_p[i] = g if acc is None else acc.add_(g)  # summed over chunks
        return (grad_h, None, None, None, None, None, None, *grad_p)


def chunked_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: Head, temperature: float = 1.0,
                     chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, H) final hidden states and (N,) next tokens -> (N,) logprobs (at least float32, differentiable w.r.t.
    `hidden` and the lm_head's trainable parameters) and, with `with_entropy`, the (N,) detached entropies;
    `chunk_size` positions at a time; recomputed in the backward, or, for a head without trainable parameters,
    differentiated in the forward (module doc)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    params = [p for p in head.lm_head.parameters() if p.requires_grad]
    eager = torch.is_grad_enabled() and hidden.requires_grad and not params
    lp, ent = _ChunkedLogprobs.apply(hidden, targets.long(), head, float(temperature), int(chunk_size),
                                     with_entropy, eager, *params)
    return lp, (ent if with_entropy else None)


def _loss_positions(input_ids: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T-1) bool: the predictions needed, those of tokens 1.. whose `loss_mask` is set (all without a mask)."""
    if loss_mask is None:
        return torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    return loss_mask[:, 1:].bool()


def _place(values: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """(N,) values of the (B, T-1) selected positions -> (B, T) aligned with ids (column 0 and the rest 0)."""
    out = values.new_zeros(sel.shape).masked_scatter(sel, values)  # (B, T-1), differentiable w.r.t. values
    return torch.nn.functional.pad(out, (1, 0))


def _full_logits_path(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      temperature: float, sel: torch.Tensor, with_entropy: bool, images: Any = None,
                      attention_mask: torch.Tensor | None = None,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole (B, T, V) logits from the model's own forward (chunk size 0, an unlisted architecture, or
    entropies with their gradient: `entropy_grad`)."""
    with model_inputs(model, input_ids, position_ids, images) as inputs:
        out = model(**inputs, use_cache=False, **_mask(attention_mask))
    keep = torch.nn.functional.pad(sel, (1, 0))  # (B, T)
    lp = token_logprobs(out.logits, input_ids, temperature)
    lp = torch.where(keep, lp, torch.zeros_like(lp)) if not bool(keep.all()) else lp
    if not with_entropy:
        return lp, None
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        ent = entropy(out.logits if entropy_grad else out.logits.detach(), temperature)
    return lp, torch.where(keep, ent, torch.zeros_like(ent))


def _mask(attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's `attention_mask` argument: a micro-batch's 4D mask (shared prompts), else none (transformers
    builds the packed rows' block-causal mask from the position ids)."""
    return {} if attention_mask is None else {"attention_mask": attention_mask}


def final_hidden(model: torch.nn.Module, head: Head, input_ids: torch.Tensor,
                 position_ids: torch.Tensor, images: Any = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, H) final hidden states (after the final norm) from the model's own `forward`, asked for the logits
    of no position (`logits_to_keep` = an empty index), with the body's output caught by a forward hook. Going
    through the outer `forward` rather than calling the body directly keeps wrappers around it working: under
    FSDP2 (`fully_shard`) the root module's hooks gather the embeddings, final norm and lm_head, and they stay
    gathered (the root does not reshard after forward) for the chunked lm_head and its backward."""
    caught: list[torch.Tensor] = []

    def catch(_module: torch.nn.Module, _args: Any, out: Any) -> None:
        caught.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    handle = head.body.register_forward_hook(catch)
    try:
        with model_inputs(model, input_ids, position_ids, images) as inputs:
            model(**inputs, use_cache=False, logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
                  **_mask(attention_mask))
    finally:
        handle.remove()
    if len(caught) != 1:
        raise RuntimeError(f"expected one call of {type(head.body).__name__} in the model's forward, got "
                           f"{len(caught)}")
    return caught[0]


def forward_logprobs_entropy(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                             temperature: float = 1.0, *, chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE,
                             loss_mask: torch.Tensor | None = None, with_entropy: bool = True,
                             images: Any = None, attention_mask: torch.Tensor | None = None,
                             entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model on a packed (B, T) batch: (B, T) float32 logprobs of its own tokens (float64 for a float64
    model on the chunked path) and (B, T) detached entropies of each position's distribution (zeros without
    `with_entropy`; with `entropy_grad`, entropies with their gradient, from the full-logits path). With a
    (B, T) `loss_mask`, only the positions whose token it marks are computed (the others are 0). `chunk_size` 0:
    the full-logits path. `images`: the micro-batch's image inputs (VLMs).
    `attention_mask`: the micro-batch's (B, 1, T, T) mask when its rows share prompts (`tidal.trainer.step.packing`)."""
    cast = autocast_dtype(model)
    with contextlib.nullcontext() if cast is None else torch.autocast(input_ids.device.type, dtype=cast):
        if entropy_grad:  # the chunked lm_head's backward has no entropy term
            sel = _loss_positions(input_ids, loss_mask)
            lp, ent = _full_logits_path(model, input_ids, position_ids, temperature, sel, True, images,
                                        attention_mask, entropy_grad=True)
            assert ent is not None
            return lp, ent
        return _forward(model, input_ids, position_ids, temperature, chunk_size, loss_mask, with_entropy, images,
                        attention_mask)


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, temperature: float,
             chunk_size: int, loss_mask: torch.Tensor | None, with_entropy: bool,
             images: Any, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    sel = _loss_positions(input_ids, loss_mask)
    head = split_head(model) if chunk_size > 0 else None
    if head is None:
        lp, ent = _full_logits_path(model, input_ids, position_ids, temperature, sel, with_entropy, images,
                                    attention_mask)
        return lp, ent if ent is not None else torch.zeros_like(lp.detach())
    hidden = final_hidden(model, head, input_ids, position_ids, images, attention_mask)  # (B, T, H)
    lp_n, ent_n = chunked_logprobs(hidden[:, :-1][sel], input_ids[:, 1:][sel], head, temperature, chunk_size,
                                   with_entropy)  # (N,) each
    lp = _place(lp_n, sel)
    return lp, _place(ent_n, sel) if ent_n is not None else torch.zeros_like(lp.detach())


def forward_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     temperature: float = 1.0, *, chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE,
                     loss_mask: torch.Tensor | None = None, images: Any = None,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the model on a packed (B, T) batch and return (B, T) logprobs of its own tokens (see
    `forward_logprobs_entropy` for `chunk_size`, `loss_mask`, `images` and `attention_mask`)."""
    return forward_logprobs_entropy(model, input_ids, position_ids, temperature, chunk_size=chunk_size,
                                    loss_mask=loss_mask, with_entropy=False, images=images,
                                    attention_mask=attention_mask)[0]
