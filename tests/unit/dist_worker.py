"""One training step of the bundled model on a fixed random batch, as one rank of `torchrun` (or alone), for
tests/unit/test_distributed_trainer.py: writes the trained LoRA parameters and the step's metrics.

usage: python dist_worker.py OUT_DIR ZERO_LEVEL ACCUMULATION[,ACCUMULATION...] [LOSS_TYPE] [full]
(`full`: full fine-tuning, `lora: false`, every parameter trained and written)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from tidal.config.train import TrainConfig
from tidal.models.sources import resolve_model
from tidal.trainer import distributed
from tidal.trainer.grpo import train_step
from tidal.trainer.policy import build_policy, sync_view
from tidal.transport.batch import TrainingBatch


def fixed_batch(seed: int = 0, n: int = 16) -> TrainingBatch:
    """Random samples with random advantages and inference logprobs near the fresh model's (the same on every
    rank and in every process: numpy only)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, 30, n)
    tokens = rng.integers(3, 120, int(lengths.sum()))
    mask = np.concatenate([np.r_[np.zeros(4), np.ones(ln - 4)] for ln in lengths])
    inf = -rng.uniform(3.5, 5.5, int(lengths.sum())) * mask
    adv = np.repeat(rng.normal(size=n), lengths) * mask
    return TrainingBatch(step=1, temperature=1.0, tokens=tokens, lengths=lengths, loss_mask=mask,
                         inference_logprobs=inf, advantages=adv, rewards=np.zeros(n), policy_steps=np.zeros(n),
                         truncated=np.zeros(n, dtype=bool), max_tokens=26)


def config(world: int, zero_level: int, accumulation: int, loss_type: str, lora: bool = True) -> TrainConfig:
    return TrainConfig(model=resolve_model("tidal:tiny-reverse"), device="cpu", gpus=world, zero_level=zero_level,
                       lora=lora,
                       gradient_accumulation_steps=accumulation, per_device_train_batch_size=1, sequence_len=40,
                       learning_rate=0.5, lora_dropout=0.0, loss={"loss_type": loss_type, "beta": 0.05}
                       if loss_type != "aipo" else {"loss_type": "aipo"})


def main() -> None:
    out, zero, accs = Path(sys.argv[1]), int(sys.argv[2]), [int(a) for a in sys.argv[3].split(",")]
    loss_type = sys.argv[4] if len(sys.argv) > 4 else "dapo"
    mode = sys.argv[5] if len(sys.argv) > 5 else "lora"  # lora | full | loraplus
    ranks, device = distributed.init_ranks(int(__import__("os").environ.get("LOCAL_WORLD_SIZE", "1")), "cpu", 300)
    for acc in accs:
        cfg = config(ranks.world, zero, acc, loss_type, mode != "full")
        if mode == "loraplus":  # train loraplus_lr_ratio on sharded ranks: AdamW kept, its two groups checked
            cfg = cfg.model_copy(update={"learning_rate": 1e-3, "loraplus_lr_ratio": 8.0})
        p = build_policy(cfg, 10, ranks)
        if mode == "loraplus":
            (out / f"lrs_rank{ranks.rank}.json").write_text(json.dumps([g["lr"] for g in p.opt.param_groups]))
        else:
            # plain SGD: AdamW's first step is lr * sign(g), which turns float-summation noise in near-zero
            # gradients into lr-sized differences; SGD shows the gradients themselves (AdamW is element-wise and
            # sharded the same way)
            p.opt = torch.optim.SGD([q for q in p.model.parameters() if q.requires_grad], lr=0.5)
        m = train_step(p.model, p.opt, fixed_batch(), cfg, torch.device(device), p.pad_id, ranks=ranks, sched=p.sched,
                       reference=p.reference)
        sync_view(p)
        if ranks.main:
            from safetensors.torch import save_file

            assert p.view is not None
            params = {n: q.detach().contiguous() for n, q in p.view.named_parameters() if q.requires_grad}
            save_file(params, str(out / f"params_acc{acc}.safetensors"))
            (out / f"metrics_acc{acc}.json").write_text(json.dumps(m))
    distributed.close(ranks)


if __name__ == "__main__":
    main()
