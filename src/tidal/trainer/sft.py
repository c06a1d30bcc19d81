"""`tidal sft`: supervised fine-tuning on an environment's reference completions (shares TrainConfig).

Each step draws `sft.examples_per_step` fresh examples, builds chat-template prompt + reference completion
token ids, packs them like GRPO batches and minimizes the mean negative log-likelihood of the completion
tokens. Used to warm-start the bundled tiny model (`scripts/build_tiny_model.py`).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.config.train import TrainConfig
from tidal.envs import make_env
from tidal.trainer.logprobs import forward_logprobs
from tidal.trainer.model import load_policy, load_tokenizer
from tidal.trainer.optim import make_optimizer, make_scheduler
from tidal.trainer.packing import pack
from tidal.transport.batch import TrainingBatch

log = logging.getLogger("tidal.sft")


def make_sft_batch(tok: Any, examples: list[Any], completions: list[str], step: int) -> TrainingBatch:
    """Prompt ids (chat template, generation prompt) + completion ids + EOS; loss on the completion."""
    tokens, lengths, masks = [], [], []
    for ex, completion in zip(examples, completions, strict=True):
        prompt = tok.apply_chat_template(ex.prompt, tokenize=True, add_generation_prompt=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        target = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        tokens += list(prompt) + target
        lengths.append(len(prompt) + len(target))
        masks += [0] * len(prompt) + [1] * len(target)
    n = len(lengths)
    return TrainingBatch(step=step, temperature=1.0, tokens=np.array(tokens), lengths=np.array(lengths),
                         loss_mask=np.array(masks), inference_logprobs=np.zeros(len(tokens)),
                         advantages=np.zeros(len(tokens)), rewards=np.zeros(n), policy_steps=np.zeros(n))


def sft_loss(model: torch.nn.Module, mb: Any, label_smoothing: float) -> torch.Tensor:
    """Summed (label-smoothed) negative log-likelihood of the loss-masked tokens of a packed micro-batch."""
    if label_smoothing == 0:
        return -(forward_logprobs(model, mb.input_ids, mb.position_ids) * mb.loss_mask).sum()
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V) predicts ids[:, 1:]
    nll = -logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    smooth = -logp.mean(-1)  # (B, T-1) cross-entropy against the uniform distribution
    per_token = (1 - label_smoothing) * nll + label_smoothing * smooth
    return (per_token * mb.loss_mask[:, 1:]).sum()


def run(cfg: TrainConfig) -> Path:
    """Train for `max_steps` steps and save; returns the save directory."""
    if cfg.max_steps <= 0:
        raise ValueError("tidal sft needs max_steps > 0")
    tok = load_tokenizer(cfg.model)
    env = make_env(cfg.sft.env, cfg.sft.env_args)
    rng = random.Random(cfg.seed)
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg.lr_scheduler_type, cfg.warmup_steps, cfg.max_steps)
    start = time.monotonic()
    out = Path(cfg.sft.save_to or Path(cfg.output_dir) / "sft")
    for step in range(1, cfg.max_steps + 1):
        examples = [env.sample(rng) for _ in range(cfg.sft.examples_per_step)]
        batch = make_sft_batch(tok, examples, [env.reference_completion(e) for e in examples], step)
        total_tokens, nll = float(batch.loss_mask.sum()), 0.0
        for mb in pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size, tok.pad_token_id or 0):
            mb = mb.to(device)
            loss = sft_loss(model, mb, cfg.sft.label_smoothing) / total_tokens
            loss.backward()
            nll += float(loss.detach())
        params = [p for p in model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if cfg.sft.save_every and step % cfg.sft.save_every == 0 and step < cfg.max_steps:
            save(model, tok, cfg.lora, out / f"step_{step}")
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            log.info("sft step %d/%d | nll %.4f | lr %.2e | %.0f s", step, cfg.max_steps, nll,
                     sched.get_last_lr()[0], time.monotonic() - start)
    save(model, tok, cfg.lora, out)
    return out


def save(model: Any, tok: Any, lora: bool, out: Path) -> None:
    """The adapter (`lora`), or the full model + tokenizer, into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if not lora:
        tok.save_pretrained(str(out))
    log.info("saved %s to %s", "adapter" if lora else "model", out)
