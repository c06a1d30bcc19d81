"""The trainer's step on the bench-learn workload, offline (issue 68, item 3): where its time goes, and variants of it
timed in one invocation.

No vLLM, no orchestrator: the trainer's own `train_step` (`tidal.trainer.grpo`) on a `TrainingBatch` like the ones
bench-learn's runs hand it, with the policy built as `tidal grpo` builds it (`load_policy` on
examples/real_model/train.yaml plus bench/learn.py's `trl` loss keys): SmolLM2-135M-Instruct (the real weights,
`tidal:smollm2-135m-instruct`), LoRA r16 / alpha 32 on all linear layers, float32, 8 rows of 256 tokens per
micro-batch. The batch: 8 addition prompts (the `addition` environment's, through the model's own chat template: 45
tokens each, as vLLM renders them), 8 completions each whose lengths are drawn from `REAL_LENGTHS` (the completion
lengths of two real SmolLM2 steps of that workload, 3..64 tokens, 37% at the 64-token cap), random token ids (their
values do not change the work) whose inference logprobs are the float32 policy's own (as from a float32 vLLM:
importance ratios 1), group-normalized rewards with every group carrying signal unless `--zero-groups`
(a late-run batch: early in a run most groups carry none and skip their backward, `skip_zero_gradient`).

Modes:
- `--profile VARIANT`: one warm-up step, then `--profile-steps` steps under `torch.profiler`, split by
  `tidal.trainer.profile` (base / LoRA matmuls, attention, elementwise, LM head, optimizer, host gaps); plus the
  batch's token accounting (sample, processed, padded tokens).
- `--variants A B ...` (default: `VARIANTS`' first two): each variant's policy built once from the same seed, then
  `--rounds` rounds of one step per variant, interleaved (A B A B ...) after one warm-up step each; the median step
  time per variant and its ratio to the first, in the same invocation. The first step's loss and grad norm of each
  variant are printed too: variants that compute the same update print the same numbers (to float32 rounding).
- `--precision`: the logprob gap of `recipe: bf16` (autocast) against float32 on the batch's completion tokens, as
  the `mismatch_kl` the orchestrator would report (k3 of the two, `tidal.trainer.step.loss.drift_sums`): the
  float32 trainer stands in for a float32 vLLM (whose gap to the trainer is ~1e-11), a model with bfloat16 weights
  for a bfloat16 vLLM.

Run under the machine's heavy lock, e.g.
`flock /tmp/tidal-heavy.lock python bench/trainer_step.py --profile main --variants main new`.
Every result is also one line `TRAINER_STEP {json}` on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "real_model" / "train.yaml"
MODEL = "tidal:smollm2-135m-instruct"
TRL_LOSS = {"loss.loss_type": "dapo", "loss.beta": 0.0, "loss.token_mask_low": 0.0, "loss.token_mask_high": 1e30,
            "loss.geo_mask_low": 0.0, "loss.geo_mask_high": 1e30, "loss.sequence_mask_low": 0.0,
            "loss.sequence_mask_high": 1e30, "loss.is_correction": "sequence_masked", "loss.is_cap": 3.0}
"""bench/learn.py's `trl` algorithm (the loss keys it passes to `tidal grpo`)."""
REAL_LENGTHS = (
    64, 64, 64, 33, 47, 64, 22, 44, 64, 24, 32, 64, 25, 31, 64, 22, 64, 14, 23, 40, 4, 64, 36, 64, 32, 64, 64, 4,
    64, 58, 24, 30, 23, 62, 4, 13, 56, 24, 64, 35, 4, 4, 64, 20, 64, 64, 64, 64, 4, 64, 22, 36, 56, 64, 18, 64, 20,
    48, 64, 56, 38, 11, 64, 64, 16, 29, 37, 4, 20, 12, 64, 64, 12, 64, 64, 58, 50, 25, 3, 64, 64, 64, 34, 51, 8, 38,
    64, 12, 20, 44, 49, 64, 24, 64, 20, 12, 20, 64, 18, 45, 20, 12, 64, 64, 64, 25, 12, 64, 64, 64, 64, 64, 8, 64,
    64, 12, 44, 64, 64, 3, 12, 54, 5, 30, 64, 63, 17, 12)
"""Completion lengths of two SmolLM2 steps of the bench-learn workload (examples/real_model, `tidal grpo`, steps 1
and 2 of a run on this machine: mean 40.8 tokens)."""
MAIN = {"_flat": False, "_eager_head": False}
"""The bench keys that turn this branch's two cuts off: the trainer as main ran it."""
VARIANTS: dict[str, dict[str, Any]] = {
    "main": MAIN,
    "noshare": {"prompt_sharing": False, **MAIN},
    "flat": {"_eager_head": False},
    "head": {"_flat": False},
    "new": {},
    "new-512": {"sequence_len": 512, "per_device_train_batch_size": 4},
    "main-512": {"sequence_len": 512, "per_device_train_batch_size": 4, **MAIN},
    "bf16": {"recipe": "bf16"},
    "bf16-main": {"recipe": "bf16", **MAIN},
    "new-1thread": {"_threads": 1},
}
"""`--variants`: train keys over train.yaml's (`new` = train.yaml as `tidal grpo` runs it on this branch:
`prompt_sharing: auto`, flat micro-batches, the frozen head differentiated in the forward); a key starting with `_`
is the bench's own: `_threads`, torch threads for that variant's steps; `_flat: false`, the micro-batches' rows
padded as before (`tidal.trainer.grpo.flat_rows` answering no); `_eager_head: false`, the lm_head recomputed in the
backward as before (`tidal.trainer.step.logprobs`)."""


def load_avg() -> float:
    return os.getloadavg()[0]


def build_batch(tokenizer: Any, seed: int, prompts: int = 8, group: int = 8, zero_groups: int = 0) -> Any:
    """A bench-learn `TrainingBatch` (module doc): `prompts` addition prompts x `group` completions."""
    from tidal.envs.addition import Addition
    from tidal.transport.batch import TrainingBatch

    rng, env = np.random.default_rng(seed), Addition()
    pyrng = random.Random(seed)
    toks, lengths, mask, adv, inf = [], [], [], [], []
    for g in range(prompts):
        ex = env.sample(pyrng)
        prompt = list(tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True))
        if isinstance(prompt[0], list) or not isinstance(prompt[0], int):  # a BatchEncoding on some versions
            prompt = list(tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
        rewards = rng.integers(0, 2, size=group).astype(float)
        if g >= prompts - zero_groups:
            rewards[:] = 0.0
        elif rewards.std() == 0:
            rewards[0] = 1.0 - rewards[0]
        a = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for j in range(group):
            n = int(rng.choice(REAL_LENGTHS))
            toks += prompt + rng.integers(0, tokenizer.vocab_size, size=n).tolist()
            lengths.append(len(prompt) + n)
            mask += [0] * len(prompt) + [1] * n
            adv += [0.0] * len(prompt) + [float(a[j])] * n
            inf += [0.0] * len(prompt) + (-rng.exponential(1.5, size=n)).tolist()
    k = len(lengths)
    return TrainingBatch(step=1, temperature=1.0, tokens=np.array(toks, dtype=np.int64),
                         lengths=np.array(lengths, dtype=np.int64), loss_mask=np.array(mask, dtype=np.int8),
                         inference_logprobs=np.array(inf, dtype=np.float32),
                         advantages=np.array(adv, dtype=np.float32), rewards=np.zeros(k),
                         policy_steps=np.zeros(k, dtype=np.int64), truncated=np.zeros(k, dtype=bool))


def score(policy: Any, batch: Any, pad_id: int) -> np.ndarray:
    """(tokens,) float32 logprobs of `batch`'s loss tokens under `policy` (no grad; 0 elsewhere), in batch order."""
    import torch

    from tidal.trainer.step.logprobs import forward_logprobs
    from tidal.trainer.step.packing import pack

    out = np.zeros(len(batch.tokens), dtype=np.float32)
    starts = np.r_[0, np.cumsum(batch.lengths)[:-1]]
    for m in pack(batch, 256, 8, pad_id):
        with torch.no_grad():
            lp = forward_logprobs(policy, m.input_ids, m.position_ids, loss_mask=m.loss_mask)
        keep = m.loss_mask & (m.seq_ids >= 0)
        out[starts[m.seq_ids[keep].numpy()] + m.position_ids[keep].numpy()] = lp[keep].float().numpy()
    return out


def train_config(overrides: dict[str, Any]) -> Any:
    """train.yaml of examples/real_model with bench-learn's loss keys and `overrides` (keys without `_`)."""
    from tidal.config.load import load_config
    from tidal.config.train import TrainConfig

    keys = {**TRL_LOSS, "model": MODEL, **{k: v for k, v in overrides.items() if not k.startswith("_")}}
    return load_config(TrainConfig, EXAMPLE, keys)


class Setup:
    """One variant: its config, policy, optimizer and the step callable."""

    def __init__(self, name: str, batch: Any, pad_id: int) -> None:
        import torch

        from tidal.trainer.model.load import load_policy
        from tidal.trainer.step.optim import make_optimizer

        self.name, self.keys = name, VARIANTS[name]
        self.cfg = train_config(self.keys)
        self.threads = int(self.keys.get("_threads", torch.get_num_threads()))
        self.policy, self.device = load_policy(self.cfg)
        self.opt = make_optimizer(self.policy, self.cfg)
        self.batch, self.pad_id = batch, pad_id
        self.times: list[float] = []
        self.first: dict[str, Any] | None = None

    def step(self) -> dict[str, Any]:
        import torch

        from tidal.trainer import grpo
        from tidal.trainer.step import logprobs

        before, flat, apply = torch.get_num_threads(), grpo.flat_rows, logprobs._ChunkedLogprobs.apply
        torch.set_num_threads(self.threads)
        if self.keys.get("_flat", True) is False:
            grpo.flat_rows = lambda model, batch: False
        if self.keys.get("_eager_head", True) is False:  # argument 7 of the Function: `eager`
            logprobs._ChunkedLogprobs.apply = lambda *a: apply(*a[:6], False, *a[7:])  # type: ignore[method-assign]
        try:
            t0 = time.perf_counter()
            out = grpo.train_step(self.policy, self.opt, self.batch, self.cfg, self.device, self.pad_id)
            self.times.append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
            grpo.flat_rows = flat
            logprobs._ChunkedLogprobs.apply = apply  # type: ignore[method-assign]
        if self.first is None:
            self.first = {k: out[k] for k in ("loss", "grad_norm/pre_clip", "micro_batches", "processed_tokens",
                                               "packing_efficiency", "mismatch_kl") if k in out}
        return out  # type: ignore[no-any-return]


def accounting(batch: Any, cfg: Any, policy: Any, flat: bool = True) -> dict[str, Any]:
    """Tokens of the batch as `train_step` packs it for `cfg`: sample, processed (sharing), padded, loss."""
    from tidal.trainer.grpo import flat_rows, shares_prompts
    from tidal.trainer.step.packing import pack

    mbs = pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size, 0, max_tokens=cfg.micro_batch_tokens,
               share_prompts=shares_prompts(policy, cfg, batch), flat=flat and flat_rows(policy, batch))
    return {"sample_tokens": int(batch.lengths.sum()), "processed_tokens": sum(m.num_tokens for m in mbs),
            "padded_tokens": sum(m.input_ids.numel() for m in mbs), "loss_tokens": int(batch.loss_mask.sum()),
            "micro_batches": [list(m.input_ids.shape) for m in mbs]}


def profile(setup: Setup, steps: int) -> dict[str, Any]:
    """`steps` profiled steps of `setup` after one warm-up: `tidal.trainer.profile`'s rows (seconds per step)."""
    from tidal.trainer.profile import breakdown, markdown, profile_steps

    setup.step()
    load = load_avg()
    events = profile_steps(setup.step, steps, cuda=False)
    result = breakdown(events, cuda=False, lora_rank=setup.cfg.lora_rank)
    result["load_1min"] = load
    result["table"] = markdown(result)
    result["accounting"] = accounting(setup.batch, setup.cfg, setup.policy, setup.keys.get("_flat", True))
    return result


def compare(setups: list[Setup], rounds: int) -> list[dict[str, Any]]:
    """One warm-up step each, then `rounds` interleaved rounds; per variant the median and its ratio to the first."""
    for s in setups:
        s.step()
        s.times.clear()
    loads = []
    for _ in range(rounds):
        for s in setups:
            loads.append(load_avg())
            s.step()
    base = statistics.median(setups[0].times)
    rows = []
    for s in setups:
        med = statistics.median(s.times)
        rows.append({"variant": s.name, "keys": s.keys, "median_s": med, "min_s": min(s.times),
                     "max_s": max(s.times), "ratio": med / base, "first_step": s.first,
                     "accounting": accounting(s.batch, s.cfg, s.policy, s.keys.get("_flat", True)),
                     "threads": s.threads,
                     "load_1min_mean": statistics.mean(loads)})
    return rows


def precision_gap(batch: Any, pad_id: int, vllm: bool = False) -> dict[str, Any]:
    """mismatch_kl (k3, per completion token) between float32 logprobs and bf16 autocast / bf16-weight ones on
    `batch` (the base model plus a fresh LoRA, whose B = 0: the base); `vllm`: also against the batch's own
    inference logprobs (a real batch sampled by the base policy)."""
    import torch

    from tidal.trainer.model.load import load_policy
    from tidal.trainer.model.precision import AUTOCAST_ATTR
    from tidal.trainer.step.logprobs import forward_logprobs
    from tidal.trainer.step.loss import drift_sums
    from tidal.trainer.step.packing import pack

    policy, _ = load_policy(train_config({}))
    policy.eval()
    mbs = pack(batch, 256, 8, pad_id)

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            out = [forward_logprobs(policy, m.input_ids, m.position_ids, loss_mask=m.loss_mask)[m.loss_mask]
                   for m in mbs]
        return torch.cat(out).double()

    fp32 = logprobs()
    setattr(policy, AUTOCAST_ATTR, torch.bfloat16)
    cast = logprobs()
    delattr(policy, AUTOCAST_ATTR)
    policy.to(torch.bfloat16)
    weights = logprobs()
    pairs = {"bf16_autocast_vs_fp32": (cast, fp32), "bf16_weights_vs_fp32": (weights, fp32),
             "bf16_autocast_vs_bf16_weights": (cast, weights)}
    if vllm:  # the batch's own logprobs: a float32 vLLM's
        served = torch.cat([m.inference_logprobs[m.loss_mask] for m in mbs]).double()
        pairs |= {"fp32_vs_vllm_fp32": (fp32, served), "bf16_autocast_vs_vllm_fp32": (cast, served)}
    n = float(fp32.numel())
    gap = {name: drift_sums(a, b)["mismatch_kl"] / n for name, (a, b) in pairs.items()}
    gap |= {"max_abs_logprob_diff_autocast_vs_fp32": float((cast - fp32).abs().max()),
            "mean_abs_logprob_diff_autocast_vs_fp32": float((cast - fp32).abs().mean()), "tokens": int(n)}
    return gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS)[:2], choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed steps per variant")
    ap.add_argument("--profile", choices=list(VARIANTS), default=None, help="profile this variant first")
    ap.add_argument("--profile-steps", type=int, default=1)
    ap.add_argument("--precision", action="store_true", help="the bf16 logprob gap (module doc)")
    ap.add_argument("--zero-groups", type=int, default=0, help="groups whose rewards are all equal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real-batch", type=Path, default=None,
                    help="a rollouts/step_N.safetensors of a bench-learn run sampled by the base policy: --precision "
                         "also on its tokens, against its float32 vLLM logprobs")
    args = ap.parse_args()

    import torch

    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model(MODEL)))
    batch = build_batch(tokenizer, args.seed, zero_groups=args.zero_groups)
    pad_id = tokenizer.pad_token_id or 0
    from tidal.trainer.model.load import load_policy

    scorer, _ = load_policy(train_config({}))
    batch.inference_logprobs[:] = score(scorer.eval(), batch, pad_id)  # as if a float32 vLLM sampled it
    del scorer
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load "
          f"{load_avg():.2f}; batch: {batch.num_samples} samples, {int(batch.lengths.sum())} tokens, "
          f"{int(batch.loss_mask.sum())} completion tokens, {args.zero_groups} zero-signal groups", flush=True)
    if args.profile:
        result = profile(Setup(args.profile, batch, pad_id), args.profile_steps)
        print("\n".join(result.pop("table")), flush=True)
        print("TRAINER_STEP " + json.dumps({"mode": "profile", "variant": args.profile, **result}), flush=True)
    if args.variants:
        setups = [Setup(v, batch, pad_id) for v in args.variants]
        for row in compare(setups, args.rounds):
            print(f"{row['variant']}: median {row['median_s']:.3f} s ({row['min_s']:.3f}-{row['max_s']:.3f}), "
                  f"x{row['ratio']:.3f}; first step {row['first_step']}", flush=True)
            print("TRAINER_STEP " + json.dumps({"mode": "compare", **row}), flush=True)
        del setups
    if args.precision:
        gap = precision_gap(batch, pad_id)
        print("TRAINER_STEP " + json.dumps({"mode": "precision", **gap, "load_1min": load_avg()}), flush=True)
    if args.precision and args.real_batch is not None:
        from tidal.transport.batch import TrainingBatch

        gap = precision_gap(TrainingBatch.load(args.real_batch), pad_id, vllm=True)
        print("TRAINER_STEP " + json.dumps({"mode": "precision", "batch": str(args.real_batch), **gap,
                                            "load_1min": load_avg()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
