"""What the orchestrator sees of inference: the `InferenceClient` protocol, the `Completion` record and the errors.

Two backends implement the protocol (`tidal.inference.backends`): vLLM's OpenAI-compatible server (`backends.vllm`)
and SGLang's native server (`backends.sglang`); `tidal.inference.backends.make_client` picks one from orch
`client.backend`. Whatever serves it, a completion carries the token ids the engine sampled and their logprobs
under the distribution it sampled from (after temperature), so the orchestrator trains on tokens, never on
re-tokenized text. Nothing here imports torch or an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tidal.config.orch import ClientSection


class InferenceUnreachable(RuntimeError):
    """No server answered within `client.connect_timeout_s`."""


class InferenceError(RuntimeError):
    """A server answered with an error; the message names the URL and the server's reason."""


class NotMultimodal(ValueError):
    """A prompt holds images but the served model takes text only (not retried: the run cannot go on)."""


class BackendUnsupported(ValueError):
    """The run asks for something its inference backend cannot do (not retried: the run cannot go on)."""


@dataclass
class Completion:
    """One sampled completion: its token ids, their logprobs under the sampling distribution, its text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    token_texts: list[str] | None = None
    """Each sampled token's text as the server detokenized it (maps character offsets to token positions)."""
    mask: list[int] | None = None
    """Per token: 1 sampled by the model (trained), 0 inserted by the environment (multi-turn tool output);
    None: all sampled."""
    messages: list[dict[str, Any]] | None = None
    """A tool-calling rollout as chat messages (assistant turns with their `tool_calls`, `tool` results), what
    reward functions get as the completion of a conversational prompt; None: one assistant message of `text`."""
    environment: Any = None
    """The rollout's environment instance (`environment_factory`), passed to reward functions in `environments`."""
    prompt_ids: list[int] | None = None
    """The prompt these tokens continue when the rollout changed it (an environment's `reset` observation);
    None: the group's prompt."""
    routed_experts: Any = None
    """(prompt + completion tokens - 1, layers, top_k) numpy integers: the experts the engine routed each token to
    (orch `client.return_routed_experts`, MoE router replay: `tidal.models.routes`); None: not asked for."""
    env_error: str | None = None
    """Why the environment's side failed this rollout (its server unreachable, a server error, a timeout, a
    service a reward function needs: `tidal.rewards.ServiceUnavailable`); such a rollout was not judged, carries no
    loss and stays out of its group's baseline (`tidal.orchestrator.outage`). None: judged."""
    versions: list[int] | None = None
    """Per token, the policy version that sampled it (orch `partial_rollouts`: a completion stopped at a policy
    switch and continued under the new policy has tokens of several versions); None: one policy, the group's."""
    fields: dict[str, Any] | None = None
    """Extra fields a rollout function returned for this completion (`GRPOTrainer(rollout_func=...)`,
    `tidal.orchestrator.rollout_func`), passed to reward functions as keyword arguments; None: none."""
    extra_rows: list[Completion] | None = None
    """More training rows of this rollout (an agent session's rows forked off its conversation,
    `tidal.envs.agent`): each with its own whole `prompt_ids`, trained after this row with this rollout's reward,
    advantage and loss mask (a filter or a failure masks them all); None: this one row."""

    def training_rows(self, prompt: list[int]) -> list[tuple[list[int], Completion]]:
        """(prompt ids, completion) of each training row of this rollout, `prompt` being its group's prompt: this
        completion, then its `extra_rows` (the order of the batch's samples and of a teacher's sequences)."""
        return [(prompt, self), *((list(x.prompt_ids or []), x) for x in self.extra_rows or [])]


def server_root(base_url: str) -> str:
    """`http://h:p/v1` -> `http://h:p` (both servers answer /health and /tokenize at the root)."""
    return base_url.rstrip("/").removesuffix("/v1")


class InferenceClient(Protocol):
    """One or more inference servers of one backend, as the orchestrator uses them. `model` arguments name the
    served base model (`model.name`) or a LoRA adapter loaded with `load_adapter`."""

    cfg: ClientSection
    urls: list[str]
    """The servers' `/v1` base URLs (requests go round-robin; loads go to every one)."""

    async def close(self) -> None: ...

    async def discover(self) -> bool:
        """Elastic pools: re-resolve the servers; True when the set changed."""
        ...

    async def wait_ready(self) -> list[str]:
        """Wait until every server answers; the first server's served model ids."""
        ...

    async def tokenize_chat(self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered by the server's chat template."""
        ...

    async def tokenize_prompt(self, model: str, prompt: list[dict[str, Any]] | str,
                              tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of an example's prompt (chat messages or a plain string)."""
        ...

    async def tokenize_text(self, model: str, text: str) -> list[int]:
        """Token ids of plain `text` (no chat template, no special tokens)."""
        ...

    async def sample(self, model: str, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                     seed: int | None = None, extra: dict[str, Any] | None = None) -> list[Completion]:
        """`n` completions of `prompt_ids` with token ids and behaviour logprobs; `extra`: more sampling keys in
        vLLM's names (`tidal.orchestrator.sampling.extra_sampling`, multi-turn `stop`)."""
        ...

    async def sample_chat(self, model: str, messages: list[dict[str, Any]], prompt_ids: list[int], n: int,
                          max_tokens: int, temperature: float, seed: int | None = None,
                          extra: dict[str, Any] | None = None) -> list[Completion]:
        """`n` completions of chat `messages` (prompts with images) whose prompt tokens must equal `prompt_ids`."""
        ...

    async def prompt_logprobs(self, model: str, token_ids: list[int]) -> list[float]:
        """Untempered logprob of every token given the ones before it (the first gets 0)."""
        ...

    async def prompt_logprobs_many(self, model: str, seqs: list[list[int]], concurrency: int) -> list[list[float]]:
        """`prompt_logprobs` of each sequence, at most `concurrency` requests in flight."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Load (or replace) LoRA adapter `name` from directory `path` on every server."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter `name` from every server (failures are logged, not raised)."""
        ...

    async def server_epochs(self) -> dict[str, float | None]:
        """Per server, a value that changes when it restarts (None: unknown)."""
        ...

    async def weight_versions(self) -> dict[str, int]:
        """Per server, the policy step pushed into it (0: base weights, -1: no answer)."""
        ...

    async def reload_weights(self, path: str) -> None:
        """Reload full weights in place from checkpoint directory `path` on every server."""
        ...

    async def merge_lora(self, path: str) -> None:
        """Serve the LoRA policy in adapter directory `path` by merging its factors into the weights inside every
        server (orch `weight_broadcast.reload: factors`; vLLM only)."""
        ...
