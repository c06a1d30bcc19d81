"""The sampling side of tidal's Tinker server: a real vLLM server, started by tidal, adapters hot-loaded.

vLLM is started like `tidal grpo-infer` starts it (`tidal.inference.backends.vllm.server.vllm_argv`: processed
logprobs, tidal's generation config, runtime LoRA loading) on 127.0.0.1, with LoRA layers for every linear module
the trainer may adapt, plus the output layer when `unembed` (vLLM serves an lm_head adapter; checked against PEFT
on CPU), and up to 20 logprobs per position for the SDK's top-k requests; it is a `tidal.procs.Child` (its own
process group, stopped as a whole, killed if this process dies), its output in `vllm.log`. A sampler checkpoint is
loaded under its own adapter name the first time it is sampled (`/v1/load_lora_adapter`); the least recently used
adapters are unloaded beyond `MAX_LOADED` and loaded again when asked for.

`sample` maps the SDK's `SamplingParams` onto vLLM's completions API from token ids: `max_tokens`, `temperature`,
`top_p`, `top_k`, `seed`; `stop` as strings or token ids (None keeps EOS; `[]` also ignores EOS). It returns the
sampled token ids and their logprobs (of the distribution sampled from), why each sequence stopped, and on request
the prompt's logprobs and top-k logprobs of prompt or sampled positions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tidal.inference.backends.vllm.client import KEEPALIVE_S
from tidal.procs import Child, NotHealthy, wait_healthy
from tidal.tinker.wire import Sequence

log = logging.getLogger("tidal.tinker")
MAX_LOADED = 16
MAX_LOGPROBS = 20


class SamplerError(RuntimeError):
    """vLLM refused or failed a request (its answer in the message)."""


@dataclass(frozen=True)
class SampleParams:
    """The SDK's `SamplingParams` plus the request's logprob options."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None


def vllm_command(argv: list[str], targets: list[str]) -> list[str]:
    """`vllm_argv`'s command with `--lora-target-modules` replaced by `targets` and `--max-logprobs` raised to
    `MAX_LOGPROBS`."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in ("--lora-target-modules", "--max-logprobs"):
            flag = argv[i]
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            out += [flag, *targets] if flag == "--lora-target-modules" else [flag, str(MAX_LOGPROBS)]
            continue
        out.append(argv[i])
        i += 1
    return out


def _topk(entries: list[Any], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, k) ids and logprobs from vLLM's per-position {"token_id:ID": logprob} dicts (missing rows: -1 / nan)."""
    ids = np.full((len(entries), k), -1, dtype=np.int32)
    lps = np.full((len(entries), k), np.nan, dtype=np.float32)
    for t, entry in enumerate(entries):
        if not entry:
            continue
        items = [(int(str(tok).split(":")[-1]), float(v if not isinstance(v, dict) else v["logprob"]))
                 for tok, v in entry.items()]
        for j, (tid, lp) in enumerate(sorted(items, key=lambda x: -x[1])[:k]):
            ids[t, j], lps[t, j] = tid, lp
    return ids, lps


class Sampler:
    """One vLLM server on the served model, and the adapters loaded into it."""

    def __init__(self, infer_cfg: Any, targets: list[str], log_path: Path) -> None:
        self.infer_cfg = infer_cfg
        self.targets = targets
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{infer_cfg.port}"
        self.child: Child | None = None
        self.loaded: collections.OrderedDict[str, str] = collections.OrderedDict()  # adapter name -> path
        self._lock = asyncio.Lock()
        # pool=None: with `retrieve_futures` the SDK no longer caps its in-flight samples, so a large batch queues
        # for httpx's 100 connections to vLLM; a queued request waits its turn instead of failing after 600 s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0, pool=None),
                                      limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                                          keepalive_expiry=KEEPALIVE_S))  # httpx's, idle below vLLM's

    def start(self) -> None:
        """Start vLLM (`tidal.procs.Child`: its own process group, killed if this process dies), its output
        appended to `log_path`."""
        from tidal.inference.backends.vllm.server import vllm_argv, vllm_env

        argv = vllm_command(vllm_argv(self.infer_cfg), self.targets)
        self.child = Child("vllm", argv, log_path=self.log_path, env=vllm_env(self.infer_cfg))
        log.info("vLLM starting on %s (log: %s)", self.url, self.log_path)

    def wait_ready(self, timeout: float = 900.0) -> None:
        try:
            waited = wait_healthy(f"{self.url}/health", self.child, timeout, poll_s=0.5)
        except NotHealthy as exc:
            if exc.code is not None:
                assert self.child is not None
                raise SamplerError(f"vLLM exited with {exc.code} while starting:\n{self.child.tail(40)[-3000:]}"
                                   ) from None
            raise SamplerError(f"vLLM not ready after {timeout:.0f} s (log: {self.log_path})") from None
        log.info("vLLM ready after %.0f s", waited)

    def stop(self) -> None:
        """Stop vLLM and its engine processes (the whole group; SIGKILL after 20 s)."""
        if self.child is not None:
            self.child.stop(20.0)

    async def _post(self, route: str, payload: dict[str, Any]) -> Any:
        try:
            r = await self.http.post(f"{self.url}{route}", json=payload)
        except httpx.HTTPError as exc:
            raise SamplerError(f"vLLM {route} failed: {exc!r}") from exc
        if r.status_code != 200:
            raise SamplerError(f"vLLM {route} -> HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    async def ensure_adapter(self, name: str, path: Path) -> bool:
        """Load the adapter at `path` as `name` unless it is loaded (True: loaded now); unload the least recently
        used beyond `MAX_LOADED`."""
        async with self._lock:
            if name in self.loaded:
                self.loaded.move_to_end(name)
                return False
            while len(self.loaded) >= MAX_LOADED:
                old, _ = self.loaded.popitem(last=False)
                with contextlib.suppress(SamplerError):
                    await self._post("/v1/unload_lora_adapter", {"lora_name": old})
            await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            self.loaded[name] = str(path)
            return True

    async def forget(self, name: str) -> None:
        """Unload adapter `name` (its next use loads it again)."""
        async with self._lock:
            if self.loaded.pop(name, None) is not None:
                with contextlib.suppress(SamplerError):
                    await self._post("/v1/unload_lora_adapter", {"lora_name": name})

    async def prompt_logprobs(self, model: str, ids: list[int]) -> list[float]:
        """Untempered logprob of each of `ids` given the ones before (the first: 0), as `model` serves it."""
        _, lps, _ = await self.sample(model, ids, 1, SampleParams(max_tokens=1, prompt_logprobs=True))
        assert lps is not None
        return [0.0, *(float(x) for x in lps[1:])]

    async def sample(self, model: str, prompt: list[int], n: int,
                     p: SampleParams) -> tuple[list[Sequence], np.ndarray | None, tuple[np.ndarray, np.ndarray] | None]:
        """`n` samples of `prompt` from `model` (the served name or a loaded adapter's): the sequences, the
        prompt's logprobs (NaN where none) and its top-k, each when asked."""
        payload: dict[str, Any] = {"model": model, "prompt": prompt, "n": n, "temperature": p.temperature,
                                   "top_p": p.top_p, "top_k": p.top_k, "logprobs": p.topk_sample_logprobs,
                                   "return_token_ids": True, "return_tokens_as_token_ids": True,
                                   "skip_special_tokens": False}
        if p.max_tokens is not None:
            payload["max_tokens"] = p.max_tokens
        if p.seed is not None:
            payload["seed"] = p.seed
        if isinstance(p.stop, str):
            payload["stop"] = [p.stop]
        elif p.stop is not None and len(p.stop) == 0:
            payload["ignore_eos"] = True
        elif p.stop is not None and all(isinstance(s, int) for s in p.stop):
            payload["stop_token_ids"] = list(p.stop)
        elif p.stop is not None:
            payload["stop"] = list(p.stop)
        if p.prompt_logprobs or p.topk_prompt_logprobs:
            payload["prompt_logprobs"] = p.topk_prompt_logprobs
        out = await self._post("/v1/completions", payload)
        seqs = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            ids = [int(t) for t in choice["token_ids"]]
            lp = choice.get("logprobs") or {}
            lps = [float(x) for x in lp.get("token_logprobs") or []]
            if len(lps) != len(ids):
                raise SamplerError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs")
            reason = choice.get("finish_reason")
            if reason not in ("stop", "length"):
                raise SamplerError(f"vLLM stopped a sequence with finish_reason {reason!r}")
            topk = _topk(lp.get("top_logprobs") or [], p.topk_sample_logprobs) if p.topk_sample_logprobs else None
            seqs.append(Sequence(ids, lps, reason, topk))
        prompt_lps, topk_prompt = None, None
        if p.prompt_logprobs or p.topk_prompt_logprobs:
            entries = out["choices"][0].get("prompt_logprobs") or []
            if len(entries) != len(prompt):
                raise SamplerError(f"vLLM returned {len(entries)} prompt logprobs for {len(prompt)} prompt tokens")
            skip = len(prompt) - p.prompt_logprobs_last_n if p.prompt_logprobs_last_n else 1
            prompt_lps = np.full(len(prompt), np.nan, dtype=np.float32)
            for t in range(max(skip, 1), len(prompt)):
                entry = entries[t] or {}
                value = entry.get(str(prompt[t])) or entry.get(f"token_id:{prompt[t]}")
                if value is not None:
                    prompt_lps[t] = float(value["logprob"] if isinstance(value, dict) else value)
            if p.topk_prompt_logprobs:
                masked = [e if t >= max(skip, 1) else None for t, e in enumerate(entries)]
                topk_prompt = _topk(masked, p.topk_prompt_logprobs)
        return seqs, prompt_lps, topk_prompt

    async def close(self) -> None:
        await self.http.aclose()

    async def check_served(self, name: str, path: Path, *, enabled: bool) -> None:
        """The policy identity check of a sampler checkpoint vLLM just loaded as `name` (`probe.json` written by
        `TrainerHost`; `enabled`: serve-tinker without `--no-policy-check`): on a mismatch the adapter is unloaded
        and the request fails with the check's one line."""
        from tidal.orchestrator.identity import check_served
        from tidal.transport.probe import PolicyMismatch, ProbeRecord

        record = ProbeRecord.read(path) if enabled else None
        if record is None:
            return
        try:
            await check_served(lambda ids: self.prompt_logprobs(name, ids), record,
                               what="the Tinker sampler's vLLM", path=str(path), off="tidal serve-tinker "
                               "--no-policy-check")
        except PolicyMismatch:
            await self.forget(name)
            raise
