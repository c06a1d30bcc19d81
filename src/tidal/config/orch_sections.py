"""The sections of the orchestrator config (`orch.yaml`): the model, sampling, client, buffer, advantage, reward
functions, checkpoints, filters, eval, transports, teacher, reports and environment outages. `tidal.config.orch`
composes them into `OrchConfig` (and re-exports them, so `from tidal.config.orch import SamplingSection` works).
Split from `tidal.config.orch` so that a new section or option has room (modules stay <= 600 lines).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tidal.config.base import StrictModel
from tidal.config.environments import EnvSection

TEMPLATE_OWN_KWARGS = ("messages", "conversation", "add_generation_prompt", "continue_final_message", "tokenize",
                       "chat_template", "tools", "return_dict")
"""Arguments of the chat template call that tidal sets itself (not template variables)."""


def check_chat_template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs` must not set the arguments tidal passes itself (`TEMPLATE_OWN_KWARGS`)."""
    own = sorted(set(value) & set(TEMPLATE_OWN_KWARGS))
    if own:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(own)}: tidal sets it itself (the prompt ends "
                         f"with the generation prompt); give template variables only, e.g. enable_thinking")
    return value


class ModelSection(StrictModel):
    """Which model the orchestrator asks vLLM for, and the LoRA adapter it trains."""

    name: str | None = None
    """Model name/path served by vLLM (null: the first model the server lists; in `tidal grpo`: infer `model`)."""
    lora_adapter: str = "default"
    """Prefix of the adapter names registered in vLLM (`{lora_adapter}-step-{n}`)."""
    lora_rank: int | None = Field(None, ge=1)
    """Expected LoRA rank of the trainer's adapters (null: any). When set, a broadcast adapter of another rank
    stops the orchestrator with an error naming both, and `tidal grpo` refuses a train.yaml `lora_rank` that
    differs (exit 2)."""
    lora_alpha: float | None = Field(None, gt=0)
    """Expected LoRA alpha of the trainer's adapters (null: any); checked like `lora_rank`."""


class TempSchedulerSection(StrictModel):
    """Sampling temperature as a function of the step (needs `max_steps`)."""

    type: Literal["linear", "cosine"]
    """Schedule shape from `start_temperature` (step 1) to `end_temperature` (step `max_steps`)."""
    start_temperature: float = Field(gt=0)
    """Temperature at the first step."""
    end_temperature: float = Field(gt=0)
    """Temperature at the final step."""


class SamplingSection(StrictModel):
    """Sampling parameters sent to vLLM with every rollout request.

    vLLM reports the logprobs of the distribution it sampled from after temperature, repetition penalty,
    top-p/top-k/min-p and `min_tokens` (tidal starts it with `--logprobs-mode processed_logprobs`); the trainer
    scores at the batch's temperature but does not replicate the penalty, the truncations or `min_tokens`, so
    with those the inference policy differs from the trained one and the importance ratio (and `mismatch_kl`)
    carries the difference."""

    max_tokens: int | None = Field(None, ge=1)
    """Max completion tokens (null: up to `seq_len` minus the prompt)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scores tokens at the same temperature. Set this or `temp_scheduler`."""
    temp_scheduler: TempSchedulerSection | None = None
    """Temperature schedule over the run (replaces `temperature`; each batch carries its own temperature)."""
    repetition_penalty: float = Field(1.0, gt=0)
    """vLLM's repetition penalty (> 1 discourages repeated tokens; 1: off)."""
    min_tokens: int = Field(0, ge=0)
    """Minimum completion tokens before EOS may be sampled."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches `top_p` (1: off).
    Like the penalty, the trainer does not replicate the truncation (the importance ratio carries it)."""
    top_k: int = Field(-1, ge=-1)
    """Sample among the `top_k` most likely tokens only (-1 or 0: off); not replicated by the trainer."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Drop tokens less likely than `min_p` x the most likely one (0: off); not replicated by the trainer."""
    seed: int | None = None
    """Per-request sampling seed base (request i uses seed + i); null: random."""

    @model_validator(mode="after")
    def _one_temperature(self) -> SamplingSection:
        if self.temp_scheduler is not None and self.temperature != 1.0:
            raise ValueError("set sampling.temperature or sampling.temp_scheduler, not both")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"sampling.min_tokens ({self.min_tokens}) exceeds sampling.max_tokens "
                             f"({self.max_tokens})")
        return self


class ElasticSection(StrictModel):
    """An inference pool found through DNS: every IPv4 address the hostname resolves to is a server."""

    hostname: str
    """DNS name whose A records are the pool's servers (e.g. a Kubernetes headless service)."""
    port: int = Field(8000, ge=1, le=65535)
    """Port of the pool's servers."""
    sync_interval: float = Field(5.0, gt=0)
    """Seconds between re-resolutions; a server that joins gets the current policy loaded."""


class ClientSection(StrictModel):
    """How the orchestrator reaches inference."""

    base_url: list[str] = Field(default_factory=lambda: ["http://localhost:8000/v1"], min_length=1)
    """Inference server URL(s); requests are spread across them round-robin, adapters load on all."""
    backend: Literal["vllm", "sglang"] = "vllm"
    """The servers' engine (infer `backend`; `tidal grpo` copies it): `vllm` (OpenAI-compatible API) or `sglang`
    (SGLang's native `/generate` and weight routes, `tidal.inference.backends.sglang`)."""
    timeout: float = Field(1200, gt=0)
    """Request timeout (s)."""
    api_key_var: str = "VLLM_API_KEY"
    """Environment variable holding the API key."""
    skip_model_check: bool = False
    """Skip checking the `/models` endpoint at start-up."""
    elastic: ElasticSection | None = None
    """Discover the servers through DNS instead of `base_url` (re-checked every `sync_interval`)."""
    connect_timeout_s: float = Field(300.0, gt=0)
    """Keep retrying (with backoff) to reach the server for this long before giving up."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the model's chat template when prompts are rendered (vLLM's `/tokenize`, for training
    and evaluation prompts alike), e.g. `{enable_thinking: false}` for Qwen3. `tidal sft` renders its prompts
    with train `sft.chat_template_kwargs`: give both the same value."""

    return_routed_experts: bool = False
    """Ask the servers for each token's routed experts (they must run with infer `return_routed_experts`): completions
    are requested from vLLM's token-in/token-out `/inference/v1/generate` (vLLM 0.24 returns routes there only), and
    the batch carries the routes (`routed_experts`, uint8/int16 per token x layer x top_k) for train
    `router_replay`. vLLM backend only; `tidal grpo` sets it when train `router_replay` resolves on."""

    _template_kwargs = field_validator("chat_template_kwargs")(check_chat_template_kwargs)

    @model_validator(mode="after")
    def _routes_backend(self) -> ClientSection:
        if self.return_routed_experts and self.backend != "vllm":
            raise ValueError("client.return_routed_experts: tidal's SGLang backend neither asks SGLang for routed "
                             "experts nor reads them; use backend: vllm or set it false")
        return self


class BufferSection(StrictModel):
    """Example sampling, deduplication, difficulty pools and group filters (see `tidal.orchestrator.buffer`)."""

    seed: int | None = None
    """Seed for example sampling (null: the top-level `seed`)."""
    online_difficulty_filtering: bool = False
    """Drop groups whose mean reward is exactly 0 or 1 (no learning signal) and sample replacements."""
    easy_threshold: float | None = None
    """A problem whose group mean reward is >= this moves to the easy pool and is not drawn again."""
    hard_threshold: float | None = None
    """A problem whose group mean reward is <= this moves to the hard pool and is not drawn again."""
    easy_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of the easy pool promoted back to normal when a run resumes."""
    hard_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of the hard pool promoted back to normal when a run resumes."""
    hash_keys: list[str] = Field(default_factory=lambda: ["task", "prompt"], min_length=1)
    """Example fields identifying an example (`task`, `prompt`, `answer` or an `info` column): a batch never
    holds the same example twice, and pooled examples are recognised."""
    skip_verification: bool = False
    """Skip reward scoring (all rewards 0)."""
    env_ratios: list[float] | None = None
    """Share of examples drawn from each `env[]` entry, in order (normalized; null: equal shares)."""

    @model_validator(mode="after")
    def _thresholds(self) -> BufferSection:
        if (self.easy_threshold is not None and self.hard_threshold is not None
                and self.hard_threshold >= self.easy_threshold):
            raise ValueError(f"buffer.hard_threshold ({self.hard_threshold}) must be below buffer.easy_threshold "
                             f"({self.easy_threshold})")
        return self


class AdvantageSection(StrictModel):
    """How rewards become advantages (formulas: docs/algorithms.md)."""

    type: Literal["default", "custom", "process", "none"] = "default"
    """`default`: reward minus the group baseline, optionally scaled; `custom`: `import_path(rewards=...,
    lengths=..., group_size=..., **kwargs)`; `process`: process supervision from the environment's step
    rewards (DeepSeekMath): normalized over the group, summed from each step's end backwards; `none`: every
    advantage is 0 and no reward function is needed (reward-free on-policy distillation: the signal is train
    `loss.teacher_tau`'s teacher term, which must be > 0; rewards an environment has are still logged)."""
    scale_rewards: Literal["group", "batch", "none"] = "none"
    """Divide by the group's reward std (`group`, TRL's default), the batch's (`batch`) or not at all (`none`,
    seed 000 and Dr. GRPO)."""
    length_weighted_mean: bool = False
    """Baseline = completion-length-weighted mean of the group's rewards instead of the plain mean."""
    import_path: str | None = None
    """(custom) `package.module:function` computing one advantage per rollout."""
    kwargs: dict[str, Any] | None = None
    """(custom) Extra keyword arguments for that function."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """(default) With several reward functions: `sum_then_normalize` sums the weighted rewards, then takes the
    group baseline; `normalize_then_sum` (GDPO, TRL 1.16) normalizes each function's rewards within the group,
    sums them with the weights and normalizes the sums over the batch (its own scaling: `scale_rewards` and
    `length_weighted_mean` must stay at their defaults)."""

    @model_validator(mode="after")
    def _consistent(self) -> AdvantageSection:
        if self.multi_objective_aggregation == "normalize_then_sum" and (
                self.type != "default" or self.scale_rewards != "none" or self.length_weighted_mean):
            raise ValueError("advantage.multi_objective_aggregation 'normalize_then_sum' needs advantage.type "
                             "'default' with scale_rewards 'none' and length_weighted_mean false (it normalizes per "
                             "group and then over the batch itself)")
        if self.type == "custom" and not self.import_path:
            raise ValueError("advantage.type 'custom' needs advantage.import_path ('package.module:function')")
        if self.type != "custom" and (self.import_path or self.kwargs):
            raise ValueError("advantage.import_path / kwargs only apply with advantage.type 'custom'")
        if self.type != "default" and (self.scale_rewards != "none" or self.length_weighted_mean):
            raise ValueError(f"advantage.scale_rewards / length_weighted_mean apply to advantage.type 'default' "
                             f"only (type '{self.type}' computes its own normalization)")
        return self


class RewardFuncSection(StrictModel):
    """An extra reward function (TRL's interface), added to the environment's own reward with a weight."""

    import_path: str
    """`package.module:function` called as `fn(prompts=..., completions=..., completion_ids=...,
    trainer_state=..., answer=..., **info columns, **kwargs)` once per group; returns one float or None per
    completion (None: not applicable, TRL's multi-task semantics)."""
    weight: float = 1.0
    """Weight of this function in the total reward."""
    name: str | None = None
    """Name in the metrics (`reward/{name}/mean`); null: the function's name."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments."""


class CkptSection(StrictModel):
    """Orchestrator checkpoints (`{output_dir}/checkpoints/orch/step_n/`): progress and sampler state, for
    exact resume (docs/resume.md)."""

    interval: int | None = Field(None, ge=1)
    """Save a checkpoint every N steps (null: never; `tidal grpo --resume` then has nothing to resume from)."""
    resume_step: int | None = Field(None, ge=-1)
    """Step to resume from (-1: the newest complete checkpoint, or a fresh start when the run directory has
    none); null: a new run. `--resume` on the command line sets -1."""
    wait_for_weights_timeout: float | None = Field(None, gt=0)
    """On resume, seconds to wait for the policy the next batch needs (the trainer may be restarting too);
    null: `weights_timeout_s`."""
    keep_last: int | None = Field(None, ge=1)
    """Keep at most N recent checkpoints (null: keep all)."""
    keep_interval: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of N, whatever `keep_last` says."""
    skip_progress: bool = False
    """On resume, do not restore the progress counters (total tokens and samples); the step always comes from
    the checkpoint, since it must match the trainer's."""
    skip_buffer: bool = False
    """On resume, do not restore the example sampler (its RNG restarts from the seed)."""


class GibberishFilter(StrictModel):
    """Flag completions holding a rare token (id >= `token_id_threshold`) sampled with a probability close to
    uniform over the vocabulary: logprob < -ln(vocab_size) + `logprob_offset`."""

    type: Literal["gibberish"]
    """Filter kind."""
    enforce: bool = False
    """Mask flagged completions out of the training loss (false: only count them in `filters/...`)."""
    token_id_threshold: int = Field(100000, ge=0)
    """Smallest token id that can be a gibberish candidate."""
    logprob_offset: float = 2.0
    """Offset from the uniform-distribution logprob -ln(vocab_size)."""
    vocab_size: int | None = Field(None, ge=2)
    """Vocabulary size (null: read from the model directory's config.json)."""


class RepetitionFilter(StrictModel):
    """Flag completions stuck in a loop: `window` consecutive tokens each sampled with probability >
    `prob_threshold`."""

    type: Literal["repetition"]
    """Filter kind."""
    enforce: bool = False
    """Mask flagged completions out of the training loss (false: only count them in `filters/...`)."""
    window: int = Field(3000, ge=1)
    """Consecutive high-probability tokens before a completion is flagged."""
    prob_threshold: float = Field(0.99, gt=0, le=1)
    """Per-token probability above which a token counts as high-probability."""


class EvalSection(StrictModel):
    """Online evaluation on held-out examples while training (`eval.jsonl` + the metric sinks)."""

    REFUSED = {"cancel_inflight_rollouts_on_eval": "would have no effect: evaluations run between batches, so no "
                                                   "training rollout is ever in flight to cancel"}

    env: list[EnvSection] = Field(min_length=1)
    """Evaluation environments (ids from the registry, with their args and names)."""
    num_examples: int = Field(-1, ge=-1)
    """Examples per environment (-1: the environment's whole finite eval set, or 128 generated ones with a fixed
    seed for a generated environment). The same examples at every evaluation."""
    rollouts_per_example: int = Field(1, ge=1)
    """Completions per example (pass@k-style metrics use them)."""
    interval: int = Field(100, ge=1)
    """Evaluate the policy every N training steps (the first policy >= each multiple of N)."""
    eval_base_model: bool = True
    """Also evaluate the base model (policy 0) before the first step."""
    skip_eval_on_resume: bool = True
    """After a resume, skip the evaluation that would run right away (base model, or the resumed policy)."""
    cancel_inflight_rollouts_on_eval: bool = False
    """Evaluations run between batches, so no training rollout is ever in flight during one: nothing to cancel.
    `false` (let them finish) is what happens; `true` is refused rather than accepted without an effect."""


class RolloutTransportSection(StrictModel):
    """How batches reach the trainer."""

    type: Literal["filesystem", "zmq"] = "filesystem"
    """`filesystem` (temp file + rename under `{output_dir}/rollouts`) or `zmq` (the orchestrator serves batches
    over TCP; the trainer sets `transport_type: zmq` with the same host and port)."""
    host: str = "localhost"
    """(zmq) Bind host (localhost by default: no other machine can ask for batches)."""
    port: int = Field(5555, ge=1, le=65535)
    """(zmq) Bind port."""
    hwm: int = Field(10, ge=1)
    """(zmq) High-water mark: batches held for the trainer beyond which the orchestrator waits."""


class WeightBroadcastSection(StrictModel):
    """How new weights reach inference."""

    type: Literal["filesystem", "nccl"] = "filesystem"
    """`filesystem`: the orchestrator loads `{output_dir}/broadcasts/step_n` into vLLM (see `reload`). `nccl`: the
    trainer pushes merged weights straight into vLLM's workers (NCCL on GPUs, gloo on CPU) and stamps the
    servers with the step; the orchestrator checks each server's `/weight_info` version and asks the trainer
    to push again when a restarted server is behind. Needs train `weight_broadcast.type: nccl` and infer
    `weight_broadcast_type: nccl` (`tidal grpo` sets both)."""
    host: str = "localhost"
    """(nccl) Rendezvous host: where the trainer opens rank 0 and the inference workers connect. `tidal grpo`
    copies it (and `port`) to train `weight_broadcast`; the orchestrator itself does not use them, so in
    three-process mode set train.yaml's `weight_broadcast.host` / `port` instead."""
    port: int = Field(29501, ge=1, le=65535)
    """(nccl) Rendezvous port (see `host`)."""
    timeout: float = Field(1200, gt=0)
    """(nccl) Seconds to wait for a policy push (one push by the trainer; a server's catch-up after a restart)."""
    reload: Literal["auto", "lora", "merged", "factors"] = "auto"
    """How vLLM picks up policy n: `lora` loads `broadcasts/step_n` as a LoRA adapter; `merged` reloads the
    full weights the trainer merged (`train.broadcast_merged`, `infer.weight_reload`), which serves at vLLM's
    plain speed (its CPU LoRA path is ~5x slower); `factors` (LoRA, vLLM): the trainer publishes the adapter only
    (~20 MB for SmolLM2-135M against a ~425 MB merged copy) and each vLLM worker merges it into its weights in place,
    W_base + scale * B A from an exact copy of the adapted base weights it keeps (one more copy of them in memory;
    `tidal.inference.backends.vllm.lora_merge`; needs `infer.weight_reload`, `train.broadcast_merged: false`; refused
    with QLoRA, QeRL noise, full fine-tuning, SGLang, infer tp > 1 and a quantized checkpoint). `auto`: in `tidal grpo`
    on a CPU-only machine `factors` for a LoRA policy the merge can serve, else `merged` (the three configs are set
    together); `lora` elsewhere. `merged` or `factors` set
    by hand in `tidal grpo` sets the other two as well; in three-process mode set them yourself."""
    policy_zero: Literal["served", "published"] = "served"
    """Which weights sample the first batches. `served`: the model vLLM loaded (a policy 0 the trainer publishes
    anyway is reloaded once it appears). `published`: wait for the trainer's policy 0 (`broadcasts/step_0/merged`,
    its quantized QLoRA base dequantized: train `qlora_bnb` / `qlora_fp8`) and reload it in place before any
    rollout, so vLLM samples the policy the trainer scores (needs infer `weight_reload: true`). `tidal grpo`
    sets it (and `weight_reload`) from train.yaml; set it yourself in three-process mode."""
    policy_check: bool = True
    """The policy identity check (docs/orchestrator.md): after each policy n is loaded (LoRA load, merged reload or
    push), score the probe the trainer published with it (`broadcasts/step_n/probe.json`: its logprobs of 32
    fixed tokens, and the previous policy's and the base's) through every inference server, and stop the run
    (exit code 4, one line naming the step, the path and the distances) when a server's logprobs are farther from
    policy n's than the tolerance, i.e. it serves the previous policy, the base model or something else. Logs
    `policy/probe_gap` every step. false: no check and no metric (a sampler that changes weights on purpose)."""
    policy_check_tolerance: float | None = Field(None, gt=0)
    """The check's tolerance: the largest mean |logprob difference| over the probe taken as numerical. null: by the
    trainer's dtype (`tidal.transport.probe.TOLERANCE`: float32 0.01, 16-bit 0.1)."""


class TeacherSection(StrictModel):
    """A teacher model served by vLLM whose logprobs of the sampled completions go into each batch (for the
    trainer's `loss.teacher_tau`; on-policy distillation: docs/algorithms.md)."""

    base_url: str | None = None
    """The teacher's OpenAI-compatible vLLM endpoint (may be the policy's own server). null: `tidal grpo` starts,
    supervises and stops a teacher vLLM server for `model` itself (port: the one after infer's servers);
    `tidal grpo-orch` needs an address (start the teacher with `tidal grpo-infer`)."""
    model: str
    """Model name the teacher server serves (e.g. the base model's name for self-distillation); with
    `base_url: null` also the model `tidal grpo` loads into the teacher server (a `tidal:` name, a local
    directory or a Hub id)."""
    max_concurrency: int = Field(1, ge=1)
    """Teacher requests in flight at once. 1 by default: vLLM 0.32's CPU LoRA path crashes the engine on
    concurrent prompt-logprob requests (einsum shape error in punica_cpu); raise it on GPU servers."""


class ReportSection(StrictModel):
    """Metric sinks beyond `metrics.jsonl` (seed 000's W&B keys, plus TensorBoard)."""

    project: str = "tidal"
    """W&B project name."""
    name: str | None = None
    """W&B run name (null: the run directory's name)."""
    offline: bool = False
    """Run W&B offline (files under `{output_dir}/wandb`, sync later with `wandb sync`); no network needed."""
    samples: bool | None = None
    """Log prompt/completion/reward samples to the sinks (null: yes). `samples.jsonl` always gets them."""
    distributions: bool | None = None
    """Log reward and advantage histograms (null: yes)."""
    interval: int = Field(10, ge=1)
    """Samples and distributions every N steps (and at step 1)."""
    wandb: bool = True
    """Send metrics to Weights & Biases (needs the `wandb` package; `offline: true` for no network)."""
    tensorboard: bool = True
    """Write TensorBoard event files under `{output_dir}/tensorboard`."""


class EnvOutageSection(StrictModel):
    """Environment outages: a step most of whose rollouts failed on the environment's side (its server refused
    the connection, answered 5xx or timed out; a reward function raised `tidal.rewards.ServiceUnavailable`) is not
    trained on: the orchestrator waits for the environment with backoff and samples the step again
    (docs/orchestrator.md, "Environment failures vs model failures")."""

    fraction: float = Field(0.5, gt=0, le=1)
    """Share of a step's rollouts failed on the environment's side at which the step is an outage (waited out
    and sampled again, never trained on); below it the failed rollouts only get no loss and stay out of their
    group's baseline (a group left with fewer than 2 judged rollouts is dropped: `env/dropped_groups`)."""
    timeout_s: float = Field(600.0, gt=0)
    """How long one outage may last (from its first failed step) before the orchestrator stops (exit 1) with a
    message naming the environment and its URL."""
