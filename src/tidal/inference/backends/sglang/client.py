"""Async client for SGLang servers (the SGLang backend of `tidal.inference.protocol.InferenceClient`).

Request and response shapes are SGLang 0.5.16's (read from its wheel: `sglang/srt/entrypoints/http_server.py`,
`managers/io_struct.py`, `sampling/sampling_params.py`, `entrypoints/openai/protocol.py`):

- rollouts, token in / token out: `POST /generate` with `input_ids` (a batch: the prompt once per completion),
  `sampling_params` per completion (`max_new_tokens`, `temperature`, `top_p`, ..., `sampling_seed`: seed + i,
  since one `n: N` request with one seed would give N copies of the same sample; SGLang honours seeds only when
  started with `--enable-deterministic-inference`, which seeded requests therefore require), `return_logprob: true` and
  `return_text_in_logprobs: true`; each answer holds `output_ids`, `text` and `meta_info.output_token_logprobs`
  (`[logprob, token_id, token_text]` per sampled token) and `meta_info.finish_reason` (`{"type": "stop" |
  "length" | "abort", ...}`). With `SGLANG_RETURN_ORIGINAL_LOGPROB` off (tidal's server sets it), the logprobs are
  `log softmax(logits / temperature)`: the distribution sampled from, as vLLM's `processed_logprobs`, except that
  SGLang does not renormalise them after top-p / top-k / min-p truncation (vLLM does); with those keys at their
  defaults (tidal's) the two agree (docs/sglang.md).
- prompts: `/tokenize` (SGLang serves vLLM's fields: `messages`, `tools`, `chat_template_kwargs`, `prompt`,
  `add_special_tokens`; answer `tokens`). SGLang always renders the generation prompt, so
  `add_generation_prompt=False` (tool environments' splicing, `tidal.orchestrator.toolloop`) is refused
  (`BackendUnsupported`, which stops the orchestrator with exit 2), as are prompts with images (`sample_chat`).
- teacher logprobs: `/generate` with `logprob_start_len: 0`, `max_new_tokens: 1`; `meta_info.input_token_logprobs`.
- weights: LoRA adapters with `/load_lora_adapter` {`lora_name`, `lora_path`} and `/unload_lora_adapter`
  {`lora_name`}, then `lora_path: <name>` per `/generate` request; merged weights with `/update_weights_from_disk`
  {`model_path`, `flush_cache`}; the version pushed over NCCL (`tidal.trainer.publish.push_sglang`) from
  `/model_info`'s `weight_version`.

The connection pool, readiness probes (`/v1/models`, `/health`), elastic discovery and `/tokenize` are the vLLM
client's (SGLang answers them in the same shapes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import BackendUnsupported, Completion, InferenceError, server_root

log = logging.getLogger("tidal.client")

LAUNCH_VERSION = "tidal-launch-"
"""Prefix of the weight version each server starts with (`--weight-version tidal-launch-<ns>`, tidal's launcher):
SGLang reports no process start time, so this stamp, which only a restart brings back, is how the client notices
one (`SglangClient.server_epochs`)."""

SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens", "top_p": "top_p",
                 "top_k": "top_k", "min_p": "min_p", "stop": "stop", "include_stop_str_in_output": "no_stop_trim",
                 "skip_special_tokens": "skip_special_tokens"}
"""The orchestrator's sampling keys (vLLM's names: `tidal.orchestrator.sampling.extra_sampling`, multi-turn `stop`,
the tool loop's `skip_special_tokens`) -> SGLang's `sampling_params` names; any other key is an error, never dropped."""


def sampling_params(max_tokens: int, temperature: float, seed: int | None,
                    extra: dict[str, Any] | None) -> dict[str, Any]:
    """SGLang `sampling_params` of one completion."""
    out: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature, "skip_special_tokens": True}
    for key, value in (extra or {}).items():
        if key not in SAMPLING_KEYS:
            raise BackendUnsupported(f"sampling key '{key}' has no SGLang equivalent in tidal's SGLang client "
                                     f"(known: {', '.join(sorted(SAMPLING_KEYS))})")
        out[SAMPLING_KEYS[key]] = value
    if seed is not None:
        out["sampling_seed"] = seed
    return out


def parse_generation(url: str, item: dict[str, Any]) -> Completion:
    """One `/generate` answer -> Completion; InferenceError when it was aborted or its ids and logprobs disagree."""
    meta = item.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type", "") if isinstance(finish, dict) else str(finish)
    if kind == "abort":
        raise InferenceError(f"{url}: SGLang aborted the request: {finish.get('message', finish)}")
    ids = [int(t) for t in item["output_ids"]]
    entries = meta.get("output_token_logprobs") or []
    if [int(e[1]) for e in entries] != ids:
        raise InferenceError(f"{url}: {len(ids)} output ids but {len(entries)} logprob entries for other ids; "
                             "was the request sent with return_logprob?")
    texts = [e[2] for e in entries] if entries and all(isinstance(e[2], str) for e in entries) else None
    return Completion(ids, [float(e[0]) for e in entries], item.get("text") or "", kind, texts)


class SglangClient(VllmClient):
    """`InferenceClient` over SGLang server(s); adapters are tracked by name (`lora_path` of their requests)."""

    def __init__(self, cfg: ClientSection) -> None:
        super().__init__(cfg)
        self.adapters: set[str] = set()
        self._seeded: dict[str, bool] = {}  # server root -> started with --enable-deterministic-inference
        self._launches: dict[str, float] = {}  # server URL -> the launch stamp it reported last

    async def _check_seeds(self, root: str) -> None:
        """SGLang uses `sampling_seed` only with `--enable-deterministic-inference` (`SamplingBatchInfo`: the seed
        tensor is None otherwise), so seeded requests (orch `sampling.seed`) need a server started with it."""
        if root not in self._seeded:
            try:
                r = await self.http.get(f"{root}/server_info", timeout=30.0)
            except httpx.HTTPError as exc:
                raise InferenceError(f"GET {root}/server_info failed: {exc!r}") from exc
            if r.status_code != 200:
                raise InferenceError(f"GET {root}/server_info -> HTTP {r.status_code}: {r.text[:300]}")
            self._seeded[root] = bool(r.json().get("enable_deterministic_inference"))
        if not self._seeded[root]:
            raise BackendUnsupported(f"orch sampling.seed is set, but SGLang at {root} ignores request seeds unless "
                                     "started with --enable-deterministic-inference (add it to infer extra_args, "
                                     "with --sampling-backend pytorch when top-p/top-k are set) or drop "
                                     "sampling.seed")

    async def tokenize_chat(self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered by the server's chat template with the generation prompt (SGLang
        always appends it), the template getting `client.chat_template_kwargs` and the tools' schemas."""
        if not add_generation_prompt:
            raise BackendUnsupported("SGLang's /tokenize always appends the generation prompt (sglang 0.5.16, "
                                     "serving_chat.py), so tool environments cannot splice tool results with the "
                                     "SGLang backend yet; use backend vllm for tools")
        payload: dict[str, Any] = {"model": model, "messages": messages, "add_special_tokens": False}
        if tools:
            payload["tools"] = tools
        if self.cfg.chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(self.cfg.chat_template_kwargs)
        out = await self._post(f"{server_root(self.urls[0])}/tokenize", payload)
        return list(out["tokens"])

    def _lora(self, model: str) -> dict[str, Any]:
        return {"lora_path": model} if model in self.adapters else {}

    async def sample(self, model: str, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                     seed: int | None = None, extra: dict[str, Any] | None = None) -> list[Completion]:
        """`n` completions of `prompt_ids` through `/generate` (one batch of `n` requests, completion i seeded with
        `seed + i`), with token ids and behaviour logprobs."""
        root = server_root(self.urls[next(self._rr)])
        if seed is not None:
            await self._check_seeds(root)
        url = f"{root}/generate"
        params = [sampling_params(max_tokens, temperature, None if seed is None else seed + i, extra)
                  for i in range(n)]
        payload = {"input_ids": [list(prompt_ids)] * n, "sampling_params": params, "return_logprob": True,
                   "return_text_in_logprobs": True, **self._lora(model)}
        out = await self._post(url, payload)
        items = out if isinstance(out, list) else [out]
        if len(items) != n:
            raise InferenceError(f"{url}: asked for {n} completions, got {len(items)}")
        return [parse_generation(url, item) for item in items]

    async def sample_chat(self, model: str, messages: list[dict[str, Any]], prompt_ids: list[int], n: int,
                          max_tokens: int, temperature: float, seed: int | None = None,
                          extra: dict[str, Any] | None = None) -> list[Completion]:
        raise BackendUnsupported("prompts with images are sampled through vLLM's chat API; tidal's SGLang client "
                                 "samples token ids only (use backend vllm for vision-language models)")

    async def prompt_logprobs(self, model: str, token_ids: list[int]) -> list[float]:
        """Untempered logprob of every token of `token_ids` given the ones before it (the first gets 0)."""
        url = f"{server_root(self.urls[next(self._rr)])}/generate"
        out = await self._post(url, {"input_ids": list(token_ids), "return_logprob": True, "logprob_start_len": 0,
                                     "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                                     **self._lora(model)})
        entries = (out.get("meta_info") or {}).get("input_token_logprobs") or []
        if [int(e[1]) for e in entries] != list(token_ids):
            raise InferenceError(f"{url}: expected {len(token_ids)} prompt logprobs, got {len(entries)}")
        return [0.0] + [float(e[0]) for e in entries[1:]]

    async def load_adapter(self, name: str, path: str) -> None:
        """Load LoRA adapter `name` on every server, replacing one of that name (SGLang refuses a name twice)."""
        async def one(url: str) -> None:
            root = server_root(url)
            payload = {"lora_name": name, "lora_path": path}
            try:
                await self._post(f"{root}/load_lora_adapter", payload)
            except InferenceError as exc:
                if "already" not in str(exc):
                    raise
                await self._post(f"{root}/unload_lora_adapter", {"lora_name": name})
                await self._post(f"{root}/load_lora_adapter", payload)

        await asyncio.gather(*(one(u) for u in self.urls))
        self.adapters.add(name)

    async def unload_adapter(self, name: str) -> None:
        self.adapters.discard(name)
        results = await asyncio.gather(*(self._post(f"{server_root(u)}/unload_lora_adapter", {"lora_name": name})
                                         for u in self.urls), return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("unloading adapter %s: %s", name, r)

    async def server_epochs(self) -> dict[str, float | None]:
        """Each server's launch stamp (`--weight-version tidal-launch-<ns>` from tidal's launcher, in `/model_info`),
        which changes when it restarts; SGLang exposes no process start time. A pushed or reloaded version
        replaces the stamp until the next restart, so the last stamp seen stands; None: never seen one (a server
        not started by tidal, or no answer)."""
        async def one(url: str) -> float | None:
            version = await self._version(url)
            if version is not None and version.startswith(LAUNCH_VERSION) and version[len(LAUNCH_VERSION):].isdigit():
                self._launches[url] = float(version[len(LAUNCH_VERSION):])
            return self._launches.get(url)

        return dict(zip(self.urls, await asyncio.gather(*(one(u) for u in self.urls)), strict=True))

    async def _version(self, url: str) -> str | None:
        """`/model_info`'s `weight_version` (None: no answer)."""
        try:
            r = await self.http.get(f"{server_root(url)}/model_info", timeout=10.0)
            version = r.json().get("weight_version") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return version if isinstance(version, str) else None

    async def weight_versions(self) -> dict[str, int]:
        """Each server's weight version (`/model_info` `weight_version`: the step a trainer pushed over NCCL), 0 for
        base weights (`default`) and -1 for a server that does not answer."""
        async def one(url: str) -> int:
            version = await self._version(url)
            if version is None:
                return -1
            return int(version) if version.isdigit() else 0

        return dict(zip(self.urls, await asyncio.gather(*(one(u) for u in self.urls)), strict=True))

    async def merge_lora(self, path: str) -> None:
        """Not with SGLang (refused up front: orch `weight_broadcast.reload: factors` needs vLLM's worker)."""
        raise BackendUnsupported("orch weight_broadcast.reload: factors merges LoRA factors inside vLLM's worker; "
                                 "SGLang has no such route: use reload: merged or lora")

    async def reload_weights(self, path: str) -> None:
        """Reload full weights in place from checkpoint directory `path` on every server (`/update_weights_from_disk`,
        which also flushes the radix cache: its KV entries were computed with the old weights)."""
        await asyncio.gather(*(self._post(f"{server_root(u)}/update_weights_from_disk",
                                          {"model_path": path, "flush_cache": True}) for u in self.urls))
