"""Async client for one or more vLLM servers: readiness with backoff, tokenize, sample, LoRA load/unload (the
vLLM backend of `tidal.inference.protocol.InferenceClient`).

Requests are spread round-robin over `client.base_url`; adapter loads go to every server. Prompts are tokenized by
the server itself (`/tokenize` with the chat template and `client.chat_template_kwargs` as extra template
variables, for training and evaluation prompts alike; a standard string prompt as plain text), and completions are
requested from those token ids with `return_token_ids`, so the orchestrator trains on exactly the tokens vLLM saw
and sampled, never on re-tokenized text. A prompt with images (`tidal.envs.images`) is tokenized from its
messages with the images as PNG data URLs (vLLM expands each image's placeholder tokens) and sampled through the
chat API (`sample_chat`), whose `prompt_token_ids` must equal those tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx

from tidal.config.orch import ClientSection
from tidal.envs.images import has_images, openai_messages
from tidal.inference.protocol import Completion, InferenceError, InferenceUnreachable, NotMultimodal, server_root
from tidal.models.chat_template import standard_prompt_ids

log = logging.getLogger("tidal.client")
FINAL_ONLY = 2
"""vLLM's `RequestOutputKind.FINAL_ONLY` (vllm/sampling_params.py, 0.24 and 0.32), as `/inference/v1/generate` parses
it: SamplingParams' enum fields are validated by value (pydantic), so the name is refused. Without it vLLM 0.24 keeps
the default CUMULATIVE, and with `n` > 1 its non-streaming generator answers with the choices of the last engine
output only (one child's, often unfinished; vllm/v1/engine/parallel_sampling.py `ParentRequest.get_outputs`);
0.32 sets FINAL_ONLY itself for a non-streaming request."""
READY_POLL_MAX_S = 0.5
"""Longest wait between two readiness probes of a starting server (a start takes ~20-50 s on 2 cores; a longer
backoff would let the orchestrator notice a ready server up to that much later). 0.5 s since `tidal grpo` starts
the orchestrator with vLLM on CPU (`tidal.colocate.start_order`), so its first request waits on this probe: a refused
connection costs well under a millisecond."""


KEEPALIVE_S = 2.0
"""How long an idle connection to vLLM is kept for reuse: below vLLM's own keep-alive (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`,
5 s), so the client never reuses a connection the server is closing at that moment. With httpx's default (5 s, the
same as the server's) a request sent after ~5 s of quiet (a weight reload, `tidal eval` merging the next adapter)
could meet the server's close: `ReadError('')`, seen ending a bench's eval (2026-12-02)."""

CONNECT_RETRY_WAITS_S = (0.5, 1.0, 2.0)
"""Waits before sending a request again whose connection to the server could not be made (refused, or not made
within the 10 s connect timeout): such a request never reached the server, so sending it again cannot run it twice.
After the last wait the request fails as before (InferenceError). Seen once without it: a `tidal eval` of 11 adapters
on 1,024 problems each ended in its last adapter with `ConnectTimeout` after 9,474 answered requests (2026-12-07,
2 cores, 256 connections to a busy server), losing 23 minutes of scoring. A read, write or protocol error, where the
server may have the request, is never sent again."""
CONNECT_WARN_EVERY_S = 10.0
"""At most one warning per client in this many seconds about connections sent again (a burst of 256 would print
256 lines)."""


class VllmClient:
    """`InferenceClient` (tidal.inference.protocol) over vLLM's OpenAI-compatible server(s)."""

    def __init__(self, cfg: ClientSection) -> None:
        self.cfg = cfg
        self.urls = [u.rstrip("/") for u in cfg.base_url]
        self._rr = itertools.cycle(range(len(self.urls)))
        self._synced = -math.inf
        self.streamed_tokens = 0  # tokens received by `sample_stream` so far (partial rollouts' progress)
        self.connect_retries = 0  # requests sent again after a failed connection (CONNECT_RETRY_WAITS_S)
        self._connect_warned = -math.inf
        key = os.environ.get(cfg.api_key_var)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout, connect=10.0), headers=headers,
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=64,
                                                          keepalive_expiry=KEEPALIVE_S))

    async def close(self) -> None:
        await self.http.aclose()

    async def discover(self) -> bool:
        """Elastic pools (`client.elastic`): re-resolve the hostname's IPv4 addresses (at most every
        `sync_interval` s) into `http://ADDR:PORT/v1` servers; True when the set of servers changed (the caller
        then loads the current policy into the new ones). No-op without `elastic`."""
        el = self.cfg.elastic
        if el is None or time.monotonic() - self._synced < el.sync_interval:
            return False
        self._synced = time.monotonic()
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(el.hostname, el.port, family=socket.AF_INET,
                                                                 type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("elastic pool: cannot resolve %s (%s); keeping %d server(s)", el.hostname, exc,
                        len(self.urls))
            return False
        urls = sorted({f"http://{info[4][0]}:{el.port}/v1" for info in infos})
        if not urls or urls == self.urls:
            return False
        log.info("elastic pool %s: %d server(s): %s", el.hostname, len(urls), ", ".join(urls))
        self.urls, self._rr = urls, itertools.cycle(range(len(urls)))
        return True

    async def _post(self, url: str, payload: dict[str, Any]) -> Any:
        for wait in (*CONNECT_RETRY_WAITS_S, None):
            try:
                r = await self.http.post(url, json=payload)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the server: safe to resend
                if wait is None:
                    raise InferenceError(f"POST {url} failed: {exc!r} (no connection in "
                                         f"{len(CONNECT_RETRY_WAITS_S) + 1} attempts)") from exc
                self.connect_retries += 1
                if time.monotonic() - self._connect_warned >= CONNECT_WARN_EVERY_S:
                    self._connect_warned = time.monotonic()
                    log.warning("POST %s: no connection (%r); sending it again in %.1f s (%d request(s) sent again "
                                "so far)", url, exc, wait, self.connect_retries)
                await asyncio.sleep(wait)
            except httpx.HTTPError as exc:
                raise InferenceError(f"POST {url} failed: {exc!r}") from exc
        if r.status_code == 400 and ("is not a multimodal model" in r.text
                                     or "At most 0 image(s) may be provided" in r.text):  # --language-model-only
            raise NotMultimodal(f"a prompt holds images, but model '{payload.get('model')}' served at {url} takes "
                                f"text only (vLLM: {r.text[:200]}); use a vision-language model or text prompts")
        if r.status_code == 400 and "messages" in payload and "chat template" in r.text.lower():
            raise InferenceError(f"model '{payload.get('model')}' served at {url} has no chat template to render a "
                                 f"chat-message prompt (vLLM: {r.text[:200]}): give plain-text prompts, or start the "
                                 f"server with infer chat_template (a file or an inline Jinja template; "
                                 f"docs/real-model.md, base models)")
        if r.status_code != 200:
            raise InferenceError(f"POST {url} -> HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    async def wait_ready(self) -> list[str]:
        """Wait until every server answers (probes back off from 0.25 s to READY_POLL_MAX_S, so a server that comes
        up is noticed within that much); returns the first server's model ids."""
        await self.discover()
        models: list[str] = []
        for url in self.urls:
            probe = f"{server_root(url)}/health" if self.cfg.skip_model_check else f"{url}/models"
            start, delay, last, next_log = time.monotonic(), 0.25, "", 0.0
            while True:
                try:
                    r = await self.http.get(probe, timeout=10.0)
                    if r.status_code == 200:
                        if not self.cfg.skip_model_check and not models:
                            models = [m["id"] for m in r.json().get("data", [])]
                        break
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                waited = time.monotonic() - start
                if waited > self.cfg.connect_timeout_s:
                    raise InferenceUnreachable(
                        f"inference server at {url} unreachable after {waited:.0f} s (last error: {last}); "
                        f"is `tidal grpo-infer` running there? (client.base_url, client.connect_timeout_s)")
                if waited >= next_log:  # a line every ~10 s, while probing every <= 2 s
                    log.info("waiting for inference server at %s (%.0f s, retry in %.1f s): %s", url, waited,
                             delay, last)
                    next_log = waited + 10.0
                await asyncio.sleep(delay)
                delay = min(delay * 2, READY_POLL_MAX_S)
        return models

    async def tokenize_chat(self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered by the server's chat template (with the generation prompt unless told
        otherwise), the template getting `client.chat_template_kwargs` (e.g. `enable_thinking: false`) and the
        tools' JSON schemas (`tools`), if any."""
        url = f"{server_root(self.urls[0])}/tokenize"
        payload: dict[str, Any] = {"model": model, "messages": messages, "add_generation_prompt": add_generation_prompt,
                                   "add_special_tokens": False}
        if tools:
            payload["tools"] = tools
        if self.cfg.chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(self.cfg.chat_template_kwargs)
        out = await self._post(url, payload)
        return list(out["tokens"])

    async def tokenize_prompt(self, model: str, prompt: list[dict[str, Any]] | str,
                              tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of an example's prompt: chat messages through `tokenize_chat` (conversational, with the
        tools' schemas if any); a string as plain text, no chat template, after the BOS token the tokenizer puts
        before a text, if any (standard; `tidal.models.chat_template.standard_prompt_ids`: a base model such as
        Gemma 3 expects its `<bos>`, as vLLM's own text prompts get it). Images go as PNG data URLs
        (`tidal.envs.images.openai_messages`), and vLLM expands their placeholder tokens."""
        if isinstance(prompt, str):
            if tools:
                raise ValueError("tools need conversational prompts (a list of chat messages), which the chat "
                                 "template renders with the tools; this prompt is a plain string")
            plain = await self.tokenize_text(model, prompt)
            out = await self._post(f"{server_root(self.urls[0])}/tokenize",
                                   {"model": model, "prompt": prompt, "add_special_tokens": True})
            return standard_prompt_ids(list(out["tokens"]), plain)
        return await self.tokenize_chat(model, openai_messages(prompt) if has_images(prompt) else prompt, tools)

    async def tokenize_text(self, model: str, text: str) -> list[int]:
        """Token ids of plain `text` (no chat template, no special tokens)."""
        out = await self._post(f"{server_root(self.urls[0])}/tokenize",
                               {"model": model, "prompt": text, "add_special_tokens": False})
        return list(out["tokens"])

    async def sample(self, model: str, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                     seed: int | None = None, extra: dict[str, Any] | None = None) -> list[Completion]:
        """`n` completions of `prompt_ids`, with token ids and sampled-token logprobs; `extra`: more vLLM
        sampling keys (repetition_penalty, min_tokens)."""
        if self.cfg.return_routed_experts:
            return await self.sample_generate(model, prompt_ids, n, max_tokens, temperature, seed, extra)
        url = f"{self.urls[next(self._rr)]}/completions"
        payload: dict[str, Any] = {"model": model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens,
                                   "temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": 0,
                                   "return_token_ids": True, "skip_special_tokens": True}
        if seed is not None:
            payload["seed"] = seed
        payload.update(extra or {})
        out = await self._post(url, payload)
        comps = []
        for choice in all_choices(out, url, n):
            ids = list(choice["token_ids"])
            lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            if len(ids) != len(lps):
                raise InferenceError(f"{url}: {len(ids)} token ids but {len(lps)} logprobs")
            texts = choice["logprobs"].get("tokens")
            comps.append(Completion(ids, lps, choice["text"], choice.get("finish_reason") or "",
                                    list(texts) if texts is not None and len(texts) == len(ids) else None))
        return comps

    async def sample_stream(self, model: str, prompt_ids: list[int], max_tokens: int, temperature: float,
                            stop: asyncio.Event, seed: int | None = None, extra: dict[str, Any] | None = None,
                            until: Callable[[str, int], bool] | None = None) -> Completion:
        """One completion of `prompt_ids`, streamed token by token, until it ends or `stop` is set: then the
        connection is closed (vLLM aborts the request) and the tokens received so far come back with finish reason
        `interrupted` (orch `partial_rollouts`, `tidal.orchestrator.partial`). Every token returned was received
        before `stop` was seen, so it was sampled before whatever the caller does next (load another policy).
        `until`: called with the text and the number of tokens received so far after each streamed chunk (one
        token per chunk without speculative decoding); True ends the request there with finish reason `stop` (a
        stop string that began in an earlier request of the same turn, which vLLM cannot match)."""
        url = f"{self.urls[next(self._rr)]}/completions"
        payload: dict[str, Any] = {"model": model, "prompt": prompt_ids, "n": 1, "max_tokens": max_tokens,
                                   "temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": 0,
                                   "return_token_ids": True, "skip_special_tokens": True, "stream": True,
                                   **({} if seed is None else {"seed": seed}), **(extra or {})}
        ids: list[int] = []
        lps: list[float] = []
        texts: list[str] = []
        text: list[str] = []
        reason = ""

        async def read() -> None:
            nonlocal reason
            try:
                async with self.http.stream("POST", url, json=payload) as r:
                    if r.status_code != 200:
                        raise InferenceError(f"POST {url} -> HTTP {r.status_code}: {(await r.aread())[:500]!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        for choice in json.loads(line[6:]).get("choices") or []:
                            new, lp = list(choice.get("token_ids") or []), choice.get("logprobs") or {}
                            got = [float(x) for x in lp.get("token_logprobs") or []]
                            if len(new) != len(got):
                                raise InferenceError(f"{url}: {len(new)} token ids but {len(got)} logprobs")
                            ids.extend(new)
                            lps.extend(got)
                            self.streamed_tokens += len(new)
                            texts.extend(lp.get("tokens") or [])
                            text.append(choice.get("text") or "")
                            reason = choice.get("finish_reason") or reason
                        if until is not None and not reason and until("".join(text), len(ids)):
                            reason = "stop"
                            return  # leaving the stream closes the connection: vLLM aborts the request
            except httpx.HTTPError as exc:
                raise InferenceError(f"POST {url} (stream) failed: {exc!r}") from exc

        reader, stopper = asyncio.ensure_future(read()), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not reader.done():
                reader.cancel()  # closes the connection: vLLM aborts the request
                await asyncio.gather(reader, return_exceptions=True)
                reason = reason or "interrupted"  # a finish reason received: it ended before the stop
        if reason != "interrupted":
            reader.result()  # raises the request's error
        return Completion(ids, lps, "".join(text), reason, texts if len(texts) == len(ids) else None)

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        """The text of `token_ids` as the server detokenizes it (special tokens skipped)."""
        return str((await self._post(f"{server_root(self.urls[0])}/detokenize",
                                     {"model": model, "tokens": token_ids}))["prompt"])

    async def sample_generate(self, model: str, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                              seed: int | None = None, extra: dict[str, Any] | None = None,
                              routes: bool = True) -> list[Completion]:
        """`sample` through vLLM's token-in/token-out `/inference/v1/generate`, the route that returns each token's
        routed experts in vLLM 0.24 (`tidal.models.routes`; `sample` takes it with `client.return_routed_experts`):
        token ids, logprobs and (`routes`) routes per completion, an answer without routes being an error; the
        text from `/detokenize` (without the final token when it stopped the completion: the EOS that
        `/v1/completions` leaves out of its text). Asks for `FINAL_ONLY` outputs, so all `n` choices come back."""
        root = server_root(self.urls[next(self._rr)])
        url = f"{root}/inference/v1/generate"
        params: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0,
                                  "top_k": -1, "logprobs": 0, "skip_special_tokens": True, **(extra or {}),
                                  "output_kind": FINAL_ONLY}
        if seed is not None:
            params["seed"] = seed
        out = await self._post(url, {"model": model, "token_ids": prompt_ids, "sampling_params": params})
        comps = []
        for choice in all_choices(out, url, n):
            ids, content = token_logprobs(choice, url)
            reason = choice.get("finish_reason") or ""
            shown = ids[:-1] if reason == "stop" and ids and "stop" not in params else ids
            text = (await self._post(f"{root}/detokenize", {"model": model, "tokens": shown}))["prompt"]
            comps.append(Completion(ids, [float(c["logprob"]) for c in content], text, reason,
                                    routed_experts=self._routes(url, choice) if routes else None))
        return comps

    @staticmethod
    def _routes(url: str, choice: dict[str, Any]) -> Any:
        """A `/inference/v1/generate` choice's routed experts, decoded (`tidal.models.routes.decode_routes`)."""
        from tidal.models.routes import decode_routes

        if not choice.get("routed_experts"):
            raise InferenceError(f"{url}: no routed_experts in the answer: start vLLM with infer "
                                 "return_routed_experts: true (--enable-return-routed-experts)")
        return decode_routes(choice["routed_experts"])

    async def sample_chat(self, model: str, messages: list[dict[str, Any]], prompt_ids: list[int], n: int,
                          max_tokens: int, temperature: float, seed: int | None = None,
                          extra: dict[str, Any] | None = None) -> list[Completion]:
        """`n` completions of chat `messages` (with images as data URLs: `tidal.envs.images.openai_messages`)
        through vLLM's chat API, rendered like `tokenize_chat`; the prompt token ids vLLM reports must equal
        `prompt_ids` (what the batch trains on), else InferenceError."""
        url = f"{self.urls[next(self._rr)]}/chat/completions"
        payload: dict[str, Any] = {"model": model, "messages": messages, "n": n, "max_tokens": max_tokens,
                                   "temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": True,
                                   "top_logprobs": 0, "return_token_ids": True, "skip_special_tokens": True,
                                   "add_generation_prompt": True}
        if self.cfg.chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(self.cfg.chat_template_kwargs)
        if seed is not None:
            payload["seed"] = seed
        payload.update(extra or {})
        out = await self._post(url, payload)
        if list(out.get("prompt_token_ids") or []) != prompt_ids:
            raise InferenceError(f"{url}: the chat API rendered {len(out.get('prompt_token_ids') or [])} prompt "
                                 f"tokens, /tokenize {len(prompt_ids)}; they must agree (tokens, not text)")
        comps = []
        for choice in all_choices(out, url, n):
            ids, content = token_logprobs(choice, url)
            msg = choice["message"]  # with infer reasoning_parser, vLLM splits the reasoning out of the content
            text = (msg.get("reasoning") or msg.get("reasoning_content") or "") + (msg.get("content") or "")
            comps.append(Completion(ids, [float(c["logprob"]) for c in content], text,
                                    choice.get("finish_reason") or "", [c["token"] for c in content]))
        return comps

    async def prompt_logprobs(self, model: str, token_ids: list[int]) -> list[float]:
        """Untempered logprob of every token of `token_ids` given the ones before it (the first gets 0)."""
        url = f"{self.urls[next(self._rr)]}/completions"
        out = await self._post(url, {"model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0,
                                     "temperature": 1.0})
        entries = out["choices"][0].get("prompt_logprobs")
        if not entries or len(entries) != len(token_ids):
            raise InferenceError(f"{url}: expected {len(token_ids)} prompt logprobs, got "
                                 f"{len(entries) if entries else 0}")
        lps = [0.0]
        for tid, entry in zip(token_ids[1:], entries[1:], strict=True):
            lps.append(float(entry[str(tid)]["logprob"]))
        return lps

    async def prompt_logprobs_many(self, model: str, seqs: list[list[int]], concurrency: int) -> list[list[float]]:
        """`prompt_logprobs` of each sequence, at most `concurrency` requests in flight."""
        gate = asyncio.Semaphore(concurrency)

        async def one(ids: list[int]) -> list[float]:
            async with gate:
                return await self.prompt_logprobs(model, ids)

        return list(await asyncio.gather(*(one(s) for s in seqs)))

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter under `name` on every server (in place: a name loaded before, e.g. a broadcast
        that a resumed trainer wrote again, gets the new weights)."""
        await asyncio.gather(*(self._post(f"{server_root(u)}/v1/load_lora_adapter",
                                          {"lora_name": name, "lora_path": path, "load_inplace": True})
                               for u in self.urls))

    async def server_epochs(self) -> dict[str, float | None]:
        """Each server's process start time (Prometheus `process_start_time_seconds` at /metrics), which
        changes when the server restarts; None where it is not available."""
        async def one(url: str) -> float | None:
            try:
                r = await self.http.get(f"{server_root(url)}/metrics", timeout=10.0)
            except httpx.HTTPError:
                return None
            for line in r.text.splitlines() if r.status_code == 200 else []:
                if line.startswith("process_start_time_seconds "):
                    return float(line.split()[1])
            return None

        return dict(zip(self.urls, await asyncio.gather(*(one(u) for u in self.urls)), strict=True))

    async def weight_versions(self) -> dict[str, int]:
        """Each server's weight version (`/weight_info`; the step a trainer pushed with `weight_broadcast.type:
        nccl`), 0 for a server that has had no push (base weights) and -1 for one that does not answer."""
        async def one(url: str) -> int:
            try:
                r = await self.http.get(f"{server_root(url)}/weight_info", timeout=10.0)
                version = r.json().get("weight_version") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return -1
            return int(version) if isinstance(version, str) and version.isdigit() else 0

        return dict(zip(self.urls, await asyncio.gather(*(one(u) for u in self.urls)), strict=True))

    async def reload_weights(self, path: str) -> None:
        """Reload full weights in place from checkpoint directory `path` on every server, then drop the prefix
        cache (its KV entries were computed with the old weights). Needs `infer.weight_reload`."""
        async def one(url: str) -> None:
            root = server_root(url)
            try:
                await self._post(f"{root}/collective_rpc",
                                 {"method": "reload_weights", "kwargs": {"weights_path": path}})
            except InferenceError as exc:
                if "404" in str(exc):
                    raise InferenceError(f"{root} cannot reload weights (no /collective_rpc): start it with "
                                         f"infer weight_reload: true, or use weight_broadcast.reload: lora") from exc
                raise
            await self._post(f"{root}/reset_prefix_cache", {})

        await asyncio.gather(*(one(u) for u in self.urls))

    async def merge_lora(self, path: str) -> None:
        """Serve the LoRA policy in `path` (a PEFT adapter directory) on every server by merging its factors into
        the weights inside each worker (`tidal.inference.backends.vllm.lora_merge`, orch `weight_broadcast.reload:
        factors`), then drop the prefix cache. Needs `infer.weight_reload` (the dev route and tidal's worker
        extension)."""
        async def one(url: str) -> None:
            root = server_root(url)
            try:
                out = await self._post(f"{root}/collective_rpc",
                                       {"method": "tidal_merge_lora", "kwargs": {"adapter_dir": path}})
            except InferenceError as exc:
                if "404" in str(exc) or "tidal_merge_lora" in str(exc):
                    raise InferenceError(f"{root} cannot merge LoRA factors in its worker (no /collective_rpc or "
                                         f"no tidal worker extension): start it with infer weight_reload: true, or "
                                         f"set orch weight_broadcast.reload: merged ({exc})") from exc
                raise
            log.debug("%s merged %s: %s", root, path, out)
            await self._post(f"{root}/reset_prefix_cache", {})

        await asyncio.gather(*(one(u) for u in self.urls))

    async def unload_adapter(self, name: str) -> None:
        results = await asyncio.gather(*(self._post(f"{server_root(u)}/v1/unload_lora_adapter",
                                                    {"lora_name": name}) for u in self.urls),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("unloading adapter %s: %s", name, r)


def token_logprobs(choice: dict[str, Any], url: str) -> tuple[list[int], list[dict[str, Any]]]:
    """A chat or generate choice's sampled token ids and their logprob entries, one per token, else
    InferenceError."""
    ids = list(choice["token_ids"])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(ids) != len(content):
        raise InferenceError(f"{url}: {len(ids)} token ids but {len(content)} logprobs")
    return ids, content


def all_choices(out: dict[str, Any], url: str, n: int) -> list[dict[str, Any]]:
    """The answer's choices by index: exactly the `n` asked for, indices 0..n-1, else InferenceError (a group
    shorter than `rollouts_per_example` must not reach the orchestrator's advantages)."""
    choices = sorted(out.get("choices") or [], key=lambda c: int(c.get("index", -1)))
    indices = [int(c.get("index", -1)) for c in choices]
    if indices != list(range(n)):
        raise InferenceError(f"{url}: asked for {n} completions, got {len(choices)} (choice indices "
                             f"{indices[:20]}{' ...' if len(indices) > 20 else ''})")
    return choices
