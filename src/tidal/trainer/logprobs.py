"""Per-token log-probabilities of the tokens in a (packed) row under the model, at a sampling temperature.

Convention: arrays are aligned with `input_ids`; `logprobs[:, i]` is log p(input_ids[:, i] | input_ids[:, :i]),
computed from the logits at position i-1; position 0 has no prediction and gets 0. Logits are divided by the
temperature the rollouts were sampled at, so the trainer scores the distribution vLLM actually sampled from
(vLLM runs with `--logprobs-mode processed_logprobs`).
"""

from __future__ import annotations

import torch


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


def forward_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Run the model on a packed (B, T) batch and return (B, T) logprobs of its own tokens."""
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return token_logprobs(out.logits, input_ids, temperature)


def forward_logprobs_entropy(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `forward_logprobs`, plus the (detached) entropy of each position's distribution."""
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    lp = token_logprobs(out.logits, input_ids, temperature)
    with torch.no_grad():
        ent = entropy(out.logits.detach(), temperature)
    return lp, ent
