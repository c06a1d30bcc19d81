"""The trainer's step of bench/agent_overhead.py's `--trainer`: one real GRPO step per round on the round's rows.

Per training step, on one CPU machine with the on-policy default, `tidal grpo` runs the rollout phase, then the
trainer's step, one after the other. Where every endpoint side's rows equal the tool loop's token for token (and
mask for mask), the trainer's work is the same for every side; so one trainer step a round, on the tool loop's
rows, timed, is that round's trainer part of every side's step. Built as `tidal grpo` builds it: the policy, AdamW
and the schedule from a train.yaml (`build_policy`: LoRA per the file), the batch by the orchestrator's own
`build_batch` with its default group-relative advantages (`compute_advantages`, groups of `--generations`), the
step by `tidal.trainer.grpo.train_step` (so groups whose rewards are all equal skip their backward, as in a run).
Left out: publishing the policy (adapter files + STABLE), the identity probe and vLLM's reload, ~1-2 s a step in
bench/agent_learn_runs/: the same for both sides, so leaving them out makes the per-step ratio larger, not smaller.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np


class TrainerStep:
    """The policy and optimizer of `config` (a train.yaml) with `model` as the model, and `step` on rows."""

    def __init__(self, config: Path, model: str, generations: int) -> None:
        from tidal.config.load import load_config
        from tidal.config.orch import OrchConfig
        from tidal.config.train import TrainConfig
        from tidal.trainer.policy import build_policy

        self.cfg = load_config(TrainConfig, config, {"model": model})
        self.orch = OrchConfig(rollouts_per_example=generations, seq_len=self.cfg.sequence_len)
        self.policy = build_policy(self.cfg, None)
        self.steps = 0

    def step(self, prompts: list[list[int]], groups: list[list[Any]], rewards: list[float]) -> dict[str, Any]:
        """One trainer step on the rollouts `groups` (per example, of prompt ids `prompts`) with `rewards` (flat):
        seconds, the groups that carried signal, tokens and the trainer's mismatch_kl."""
        from tidal.orchestrator.advantage import compute_advantages
        from tidal.orchestrator.assemble import build_batch
        from tidal.trainer.grpo import train_step

        self.steps += 1
        r = np.asarray(rewards, dtype=np.float64)
        lens = np.array([len(c.token_ids) for g in groups for c in g])
        adv = compute_advantages(self.orch.advantage, self.orch.rollouts_per_example, r, lens, None, None)
        batch, _ = build_batch(self.steps, prompts, groups, r, adv, 0, self.orch)
        p = self.policy
        t0 = time.monotonic()
        out = train_step(p.model, p.opt, batch, self.cfg, p.device, p.pad_id, sched=p.sched, reference=p.reference,
                         entropy=p.entropy)
        seconds = time.monotonic() - t0
        n = self.orch.rollouts_per_example
        signal = sum(float(np.std(r[i:i + n])) > 0 for i in range(0, len(r), n))
        return {"train_s": seconds, "groups_with_signal": signal, "groups": len(groups),
                "train_tokens": int(batch.lengths.sum()), "mismatch_kl": float(out.get("mismatch_kl", float("nan"))),
                "loss": float(out.get("loss", float("nan")))}


def merged(base: str, adapter: Path, dst: Path) -> str:
    """`adapter` (a PEFT LoRA directory) merged into `base` (a model directory) as a full model at `dst` (made once;
    the tokenizer and chat template copied from `base`): a policy that vLLM serves without LoRA."""
    import shutil

    if (dst / "STABLE").exists():
        return str(dst)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in Path(base).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",
                                                                          "special_tokens_map.json")):
            shutil.copy2(f, tmp / f.name)
    (tmp / "STABLE").write_text("")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return str(dst)
