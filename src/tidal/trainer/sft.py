"""`tidal sft`: supervised fine-tuning on an environment's reference completions (shares TrainConfig).

Each step draws `sft.examples_per_step` fresh examples, builds chat-template prompt + reference completion
token ids (the template gets `sft.chat_template_kwargs`, e.g. `enable_thinking: false`), packs them like GRPO
batches and minimizes the mean (label-smoothed) negative log-likelihood of the completion tokens. The loss is
computed like the GRPO trainer's log-probabilities: from the final hidden states of the completion positions,
`logprob_chunk_size` positions at a time (no (tokens, vocab) logits tensor; 0: the full logits). The result
(and every `save_every` snapshot) is written to a temporary directory and renamed into place, with a `STABLE`
marker last (`tidal.paths.atomic_dir`), so a crash never leaves a half-written model, to `sft.save_to` or else
`{output_dir}/sft` (`tidal.paths.sft_dir`). It runs `sft.max_steps` steps, else train `max_steps`, else 100 (the
bundled train.yaml's `max_steps: -1` means "until the orchestrator is done", nothing to SFT). Used to warm-start the
bundled tiny model (`scripts/build_tiny_model.py`).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from tidal.config.load import ConfigError
from tidal.config.train import DEFAULT_LOGPROB_CHUNK_SIZE, TrainConfig
from tidal.envs import make_env
from tidal.envs.images import has_images
from tidal.models.families import ONE_PER_ROW, packing_rule
from tidal.paths import STABLE, atomic_dir, sft_dir
from tidal.trainer.model.hf import check_model_dir
from tidal.trainer.model.load import load_policy, load_tokenizer
from tidal.trainer.model.vision import model_inputs
from tidal.trainer.step.logprobs import Head, _chunk_logits, forward_logprobs, split_head
from tidal.trainer.step.optim import make_optimizer, make_scheduler
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch

log = logging.getLogger("tidal.sft")

SAVED_MARKERS = (STABLE, "config.json", "adapter_config.json")
"""Files that mark a directory as an earlier `tidal sft` result (which a new run may replace)."""


def render_prompt(tok: Any, messages: list[dict[str, Any]] | str, chat_template_kwargs: dict[str, Any] | None = None,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt token ids: the chat template with the generation prompt, and `chat_template_kwargs` as extra
    template variables (what vLLM's `/tokenize` does with the orchestrator's `client.chat_template_kwargs`) and the
    environment's tool schemas (`tools`, as the orchestrator renders them); a standard (string) prompt as plain
    text after the tokenizer's BOS, if any (`InferenceClient.tokenize_prompt`,
    `tidal.models.chat_template.standard_prompt_ids`)."""
    if isinstance(messages, str):
        from tidal.models.chat_template import standard_prompt_ids

        return standard_prompt_ids(list(tok(messages)["input_ids"]),
                                   list(tok(messages, add_special_tokens=False)["input_ids"]))
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, tools=tools or None,
                                  **(chat_template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def make_sft_batch(tok: Any, examples: list[Any], completions: list[str], step: int,
                   chat_template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> TrainingBatch:
    """Prompt ids (chat template, generation prompt, `tools` schemas) + completion ids + EOS; loss on the
    completion."""
    tokens, lengths, masks = [], [], []
    for ex, completion in zip(examples, completions, strict=True):
        if has_images(ex.prompt):
            raise ValueError(f"tidal sft: an example of environment '{ex.task or '?'}' has images in its prompt; SFT "
                             "warm starts take text prompts only (GRPO trains vision-language models, docs/vlm.md)")
        prompt = render_prompt(tok, ex.prompt, chat_template_kwargs, tools)
        target = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        tokens += prompt + target
        lengths.append(len(prompt) + len(target))
        masks += [0] * len(prompt) + [1] * len(target)
    n = len(lengths)
    return TrainingBatch(step=step, temperature=1.0, tokens=np.array(tokens), lengths=np.array(lengths),
                         loss_mask=np.array(masks), inference_logprobs=np.zeros(len(tokens)),
                         advantages=np.zeros(len(tokens)), rewards=np.zeros(n), policy_steps=np.zeros(n))


def _smoothed_chunk(head: Head, hidden: torch.Tensor, targets: torch.Tensor, eps: float) -> torch.Tensor:
    """(c, H) hidden states, (c,) next tokens -> summed label-smoothed NLL of the chunk (a scalar)."""
    logp = torch.log_softmax(_chunk_logits(head, hidden, 1.0), dim=-1)  # (c, V), at least float32
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1)  # (c,)
    return ((1 - eps) * nll - eps * logp.mean(-1)).sum()


def sft_loss(model: torch.nn.Module, mb: Any, label_smoothing: float,
             chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE) -> torch.Tensor:
    """Summed (label-smoothed) negative log-likelihood of the loss-masked tokens of a packed micro-batch. With
    `chunk_size` > 0 (train `logprob_chunk_size`) the lm_head and softmax run on that many loss positions at a
    time and are recomputed in the backward; 0 (or an architecture `split_head` does not know): full logits."""
    if label_smoothing == 0:
        lp = forward_logprobs(model, mb.input_ids, mb.position_ids, chunk_size=chunk_size, loss_mask=mb.loss_mask)
        return -(lp * mb.loss_mask).sum()
    head = split_head(model) if chunk_size > 0 else None
    if head is not None:
        sel = mb.loss_mask[:, 1:].bool()  # (B, T-1): positions whose next token carries loss
        with model_inputs(model, mb.input_ids, mb.position_ids, None) as inputs:  # Qwen-VL: (4, B, T) positions
            hidden = head.body(**inputs, use_cache=False).last_hidden_state[:, :-1][sel]  # (N, H)
        targets = mb.input_ids[:, 1:][sel]  # (N,)
        parts = [checkpoint(_smoothed_chunk, head, hidden[s:s + chunk_size], targets[s:s + chunk_size],
                            label_smoothing, use_reentrant=False) for s in range(0, hidden.shape[0], chunk_size)]
        return torch.stack(parts).sum() if parts else hidden.sum() * 0
    with model_inputs(model, mb.input_ids, mb.position_ids, None) as inputs:
        logits = model(**inputs, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V) predicts ids[:, 1:]
    nll = -logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    smooth = -logp.mean(-1)  # (B, T-1) cross-entropy against the uniform distribution
    per_token = (1 - label_smoothing) * nll + label_smoothing * smooth
    return (per_token * mb.loss_mask[:, 1:]).sum()


def check_save_to(out: Path, model_dir: Path) -> None:
    """Refuse (before training) a save directory the result would destroy: the model being trained, or an
    existing non-empty directory that is no earlier `tidal sft` result (it is replaced as a whole)."""
    where = f"sft.save_to {out}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{where} is a file; give a directory (null: {{output_dir}}/sft)")
    if out.resolve() == model_dir.resolve():
        raise ConfigError(f"{where} is the model being trained; the result replaces its directory as a whole, so "
                          f"choose another directory")
    if out.is_dir() and any(out.iterdir()) and not any((out / m).exists() for m in SAVED_MARKERS):
        raise ConfigError(f"{where} holds other files ({', '.join(sorted(p.name for p in out.iterdir())[:5])}, ...) "
                          f"and the result replaces the directory as a whole; give a new or empty directory")


def run(cfg: TrainConfig) -> Path:
    """Train for `sft.steps(max_steps)` steps (`SftSection.max_steps`) and save; returns the save directory."""
    steps = cfg.sft.steps(cfg.max_steps)
    out = sft_dir(Path(cfg.output_dir), cfg.sft.save_to)
    check_save_to(out, check_model_dir(cfg.model))
    try:
        env = make_env(cfg.sft.env, cfg.sft.env_args)
    except ValueError as exc:
        raise ConfigError(f"train sft.env / sft.env_args: {exc}") from None
    from tidal.envs.base import has_chat_prompts
    from tidal.models.chat_template import check_chat_prompts

    check_chat_prompts(cfg.model, check_model_dir(cfg.model), cfg.chat_template,
                       [cfg.sft.env] if has_chat_prompts(env) else [], "train chat_template (--train.chat_template)")
    tok = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, chat_template=cfg.chat_template)
    rng = random.Random(cfg.seed)
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg.lr_scheduler_type, cfg.warmup_steps, steps, cfg.lr_cosine_cycles)
    start = time.monotonic()
    for step in range(1, steps + 1):
        examples = [env.sample(rng) for _ in range(cfg.sft.examples_per_step)]
        batch = make_sft_batch(tok, examples, [env.reference_completion(e) for e in examples], step,
                               cfg.sft.chat_template_kwargs, env.tooling.schemas if env.tooling is not None else None)
        total_tokens, nll = float(batch.loss_mask.sum()), 0.0
        for mb in pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size, tok.pad_token_id or 0,
                       one_per_row=packing_rule(model.config) == ONE_PER_ROW):
            mb = mb.to(device)
            loss = sft_loss(model, mb, cfg.sft.label_smoothing, cfg.logprob_chunk_size) / total_tokens
            loss.backward()
            nll += float(loss.detach())
        params = [p for p in model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if cfg.sft.save_every and step % cfg.sft.save_every == 0 and step < steps:
            save(model, tok, cfg.lora, out / f"step_{step}")
        if step % cfg.logging_steps == 0 or step == steps:
            log.info("sft step %d/%d | nll %.4f | lr %.2e | %.0f s", step, steps, nll,
                     sched.get_last_lr()[0], time.monotonic() - start)
    save(model, tok, cfg.lora, out)
    return out


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link `src` to `dst` (same filesystem: instant, no extra space), else copy it."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save(model: Any, tok: Any, lora: bool, out: Path) -> None:
    """The adapter (`lora`), or the full model + tokenizer, into `out`, atomically (`atomic_dir`: a temp
    directory renamed into place, `STABLE` last). The `step_*` snapshots already in `out` are carried over."""
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if not lora:
            tok.save_pretrained(str(tmp))
        for snap in sorted(out.glob("step_*")) if out.is_dir() else []:
            if snap.is_dir():
                shutil.copytree(snap, tmp / snap.name, copy_function=_link_or_copy)
    log.info("saved %s to %s", "adapter" if lora else "model", out)
