"""The SGLang client against a local HTTP server speaking SGLang 0.5.16's documented shapes.

No SGLang runs on this project's CPU machines (docs/sglang.md), so the server here is the one failure tidal cannot
cause otherwise: a stand-in built from SGLang's request/response shapes (read from the 0.5.16 wheel:
`sglang/srt/managers/io_struct.py` GenerateReqInput / UpdateWeightFromDiskReqInput / LoadLoRAAdapterReqInput,
`entrypoints/http_server.py` routes and status codes, `managers/tokenizer_manager.py` `meta_info`,
`layers/sampler.py` logprobs = log softmax(logits / temperature), `entrypoints/openai/protocol.py`
TokenizeRequest). Its "model" is a float64 function of the prefix, so every logprob the client returns is checked
against a reference computed here. The real server is exercised by tests/e2e/test_sglang_gpu.py on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from tidal.config.orch import ClientSection, SamplingSection
from tidal.inference.backends import make_client
from tidal.inference.backends.sglang.client import SglangClient
from tidal.inference.protocol import BackendUnsupported, InferenceError
from tidal.orchestrator.rollout import multi_turn_group, rollout_group

VOCAB, EOS = 16, 0


def logits(prefix: list[int]) -> np.ndarray:
    """The stand-in model: next-token logits (V,) as a float64 function of the prefix."""
    k = 1 + sum(prefix) % 7 + len(prefix) % 3
    return 3.0 * np.sin(np.arange(VOCAB) * 0.37 * k + 0.1 * len(prefix))


def log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.logaddexp.reduce(x)


def text_of(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids if t != EOS)


class FakeSglang:
    """State of the stand-in server: requests seen, adapters loaded, weight version, scripted failures."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.adapters: dict[str, str] = {}
        self.version = "tidal-launch-1000"  # tidal's launcher: --weight-version tidal-launch-<ns>
        self.abort_next = False
        self.deterministic = True

    def generate_one(self, ids: list[int], sp: dict[str, Any], with_text: bool, start: int | None,
                     rng: np.random.Generator) -> dict[str, Any]:
        temp, out, lps = float(sp.get("temperature", 1.0)), [], []
        stops = sp.get("stop") or []
        finish: dict[str, Any] = {"type": "length", "length": sp["max_new_tokens"]}
        for _ in range(sp["max_new_tokens"]):
            lp = log_softmax(logits(ids + out) / temp)  # SGLang: log(softmax(logits / T)), not renormalised
            p = np.exp(lp)
            if len(out) < sp.get("min_new_tokens", 0):
                p[EOS] = 0.0
            tok = int(rng.choice(VOCAB, p=p / p.sum()))
            out.append(tok)
            lps.append(float(lp[tok]))
            if tok == EOS:
                finish = {"type": "stop", "matched": EOS}
                break
            if any(text_of(out).endswith(s) for s in stops):
                finish = {"type": "stop", "matched": next(s for s in stops if text_of(out).endswith(s))}
                break
        text = text_of(out)
        if finish.get("matched") in stops and not sp.get("no_stop_trim"):
            text = text[:-len(finish["matched"])]
        meta: dict[str, Any] = {"id": "r", "finish_reason": finish, "prompt_tokens": len(ids),
                                "completion_tokens": len(out), "weight_version": self.version,
                                "output_token_logprobs": [[lp_, t, text_of([t]) if with_text else None]
                                                          for lp_, t in zip(lps, out, strict=True)]}
        if start is not None:
            meta["input_token_logprobs"] = [[None, ids[0], None]] + [
                [float(log_softmax(logits(ids[:i]))[ids[i]]), ids[i], None] for i in range(1, len(ids))]
        return {"text": text, "output_ids": out, "meta_info": meta}

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.abort_next:
            self.abort_next = False
            one = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort",
                                                                                  "message": "weights updating"}}}
            return 200, [one]
        if body.get("lora_path") is not None and body["lora_path"] not in self.adapters:
            return 400, {"error": {"message": f"LoRA adapter {body['lora_path']} is not loaded"}}
        batch = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batch else [body["input_ids"]]
        sps = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
        outs = []
        for ids, sp in zip(prompts, sps, strict=True):
            seed = sp.get("sampling_seed")
            rng = np.random.default_rng(seed) if seed is not None else np.random.default_rng()
            outs.append(self.generate_one(ids, sp, bool(body.get("return_text_in_logprobs")),
                                          body.get("logprob_start_len"), rng))
        return 200, outs if batch else outs[0]

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        self.seen.append((path, body))
        if path == "/generate":
            return self.generate(body)
        if path == "/tokenize":
            if "messages" in body:
                rendered = "".join(f"{m['role']}:{m['content']}|" for m in body["messages"]) + "assistant:"
            else:
                rendered = body["prompt"]
            return 200, {"tokens": [ord(c) % VOCAB for c in rendered], "count": len(rendered), "max_model_len": 64}
        if path == "/load_lora_adapter":
            if body["lora_name"] in self.adapters:  # lora_registry.py: "LoRA with name X already exists"
                return 400, {"success": False, "error_message": f"LoRA with name {body['lora_name']} already exists"}
            self.adapters[body["lora_name"]] = body["lora_path"]
            return 200, {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}
        if path == "/unload_lora_adapter":
            self.adapters.pop(body["lora_name"], None)
            return 200, {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}
        if path == "/update_weights_from_disk":
            if "missing" in body["model_path"]:
                return 400, {"success": False, "message": f"Failed to load {body['model_path']}",
                             "num_paused_requests": 0}
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        return 404, {"detail": "Not Found"}

    def get(self, path: str) -> tuple[int, Any]:
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "m"}, *({"id": a} for a in self.adapters)]}
        if path == "/health":
            return 200, {}
        if path == "/server_info":  # dataclasses.asdict(server_args) + scheduler info
            return 200, {"tp_size": 1, "enable_deterministic_inference": self.deterministic}
        if path == "/model_info":
            return 200, {"model_path": "/models/m", "weight_version": self.version, "is_generation": True}
        return 404, {"detail": "Not Found"}


@pytest.fixture()
def fake() -> Iterator[tuple[FakeSglang, str]]:
    state = FakeSglang()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            return

        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._reply(*state.get(self.path))

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._reply(*state.post(self.path, body))

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def with_client(url: str, fn: Any) -> Any:
    async def go() -> Any:
        client = make_client(ClientSection(base_url=[url], backend="sglang"))
        assert isinstance(client, SglangClient)
        try:
            await client.wait_ready()
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(go())


def test_samples_are_token_ids_with_logprobs_after_temperature(fake):
    state, url = fake
    prompt, temp = [3, 5, 7], 0.7
    comps = with_client(url, lambda c: c.sample("m", prompt, 4, 12, temp, seed=11))
    assert len(comps) == 4
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        ref = [float(log_softmax(logits(prompt + c.token_ids[:i]) / temp)[t]) for i, t in enumerate(c.token_ids)]
        np.testing.assert_allclose(c.logprobs, ref, rtol=0, atol=1e-12)
        assert c.token_texts == [text_of([t]) for t in c.token_ids]
        assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
    body = state.seen[-1][1]
    assert body["input_ids"] == [prompt] * 4 and body["return_logprob"] is True
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [11, 12, 13, 14], "one seed per completion"
    assert all(p["max_new_tokens"] == 12 and p["temperature"] == temp and "n" not in p for p in body["sampling_params"])
    assert "lora_path" not in body, "the base model is sampled without an adapter"


def test_seeded_requests_need_a_deterministic_server(fake):
    state, url = fake
    state.deterministic = False
    with_client(url, lambda c: c.sample("m", [1], 2, 4, 1.0))  # unseeded: fine
    with pytest.raises(BackendUnsupported, match="--enable-deterministic-inference"):
        with_client(url, lambda c: c.sample("m", [1], 2, 4, 1.0, seed=3))


def test_orchestrator_sampling_keys_are_renamed_and_unknown_ones_refused(fake):
    state, url = fake
    sampling = SamplingSection(temperature=1.0, max_tokens=6, min_tokens=3, top_p=0.9, top_k=5,
                               repetition_penalty=1.1)
    comps = with_client(url, lambda c: rollout_group(c, "m", [1, 2], 2, sampling, 64, seed=0))
    assert all(len(c.token_ids) >= 3 for c in comps), "min_tokens reached SGLang as min_new_tokens"
    sp = state.seen[-1][1]["sampling_params"][0]
    assert (sp["min_new_tokens"], sp["top_p"], sp["top_k"], sp["repetition_penalty"]) == (3, 0.9, 5, 1.1)
    with_client(url, lambda c: c.sample("m", [1], 1, 4, 1.0, extra={"skip_special_tokens": False}))
    assert state.seen[-1][1]["sampling_params"][0]["skip_special_tokens"] is False, "tool markers must survive"
    with pytest.raises(BackendUnsupported, match="'logit_bias' has no SGLang equivalent"):
        with_client(url, lambda c: c.sample("m", [1], 1, 4, 1.0, extra={"logit_bias": {}}))


def test_multi_turn_continues_through_generate_with_masked_environment_tokens(fake, tmp_path):
    from tidal.envs.base import Example

    class Env:
        id, max_turns, stop = "echo", 2, ["c"]

        @staticmethod
        def respond(example: Example, text: str) -> str | None:
            return "ok"

    state, url = fake
    sampling = SamplingSection(max_tokens=20)
    comps = with_client(url, lambda c: multi_turn_group(c, "m", [4, 4], 2, sampling, 64, 5, 1.0, Env(),
                                                          Example(prompt="x")))
    for c in comps:
        assert c.mask is not None and len(c.mask) == len(c.token_ids) == len(c.logprobs)
        inserted = [i for i, m in enumerate(c.mask) if m == 0]
        assert all(c.logprobs[i] == 0.0 for i in inserted)
    assert any(0 in (c.mask or []) for c in comps), "no rollout reached a second turn (the test proves nothing)"
    stops = [b["sampling_params"][0].get("stop") for p, b in state.seen if p == "/generate"]
    assert stops and all(s == ["c"] for s in stops)
    assert all(b["sampling_params"][0].get("no_stop_trim") for p, b in state.seen if p == "/generate")


def test_adapters_load_replace_and_route_requests(fake):
    state, url = fake

    async def go(c: SglangClient) -> None:
        await c.load_adapter("pol-step-1", "/run/broadcasts/step_1")
        await c.sample("pol-step-1", [1, 2], 1, 3, 1.0)
        assert state.seen[-1][1]["lora_path"] == "pol-step-1"
        await c.load_adapter("pol-step-1", "/run/broadcasts/step_1b")  # a name loaded before: replaced
        assert state.adapters == {"pol-step-1": "/run/broadcasts/step_1b"}
        await c.unload_adapter("pol-step-1")
        await c.unload_adapter("never-loaded")  # logged, not raised
        await c.sample("pol-step-1", [1, 2], 1, 3, 1.0)  # no longer an adapter: the base model
        assert "lora_path" not in state.seen[-1][1]

    with_client(url, go)
    paths = [p for p, _ in state.seen if "lora" in p]
    assert paths == ["/load_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter",
                     "/unload_lora_adapter", "/unload_lora_adapter"]


def test_weights_reload_from_disk_and_versions_come_from_model_info(fake):
    state, url = fake

    async def go(c: SglangClient) -> dict[str, int]:
        await c.reload_weights("/run/merged/step_3")
        assert state.seen[-1] == ("/update_weights_from_disk", {"model_path": "/run/merged/step_3",
                                                                 "flush_cache": True})
        before = await c.weight_versions()
        state.version = "7"  # what a trainer's /update_weights_from_distributed stamps
        return {"before": next(iter(before.values())), "after": next(iter((await c.weight_versions()).values()))}

    assert with_client(url, go) == {"before": 0, "after": 7}
    with pytest.raises(InferenceError, match="update_weights_from_disk -> HTTP 400.*Failed to load"):
        with_client(url, lambda c: c.reload_weights("/run/missing"))


def test_a_restart_is_noticed_by_its_new_launch_stamp_not_by_pushes(fake):
    state, url = fake

    async def go(c: SglangClient) -> list[float | None]:
        seen = [next(iter((await c.server_epochs()).values()))]
        state.version = "3"  # a push (or a reload with a version) replaces the stamp: no restart
        seen.append(next(iter((await c.server_epochs()).values())))
        state.version = "tidal-launch-2000"  # restarted
        seen.append(next(iter((await c.server_epochs()).values())))
        return seen

    assert with_client(url, go) == [1000.0, 1000.0, 2000.0]


def test_teacher_prompt_logprobs_are_untempered_input_logprobs(fake):
    _, url = fake
    ids = [2, 9, 4, 4, 1]
    lps = with_client(url, lambda c: c.prompt_logprobs("m", ids))
    ref = [0.0] + [float(log_softmax(logits(ids[:i]))[ids[i]]) for i in range(1, len(ids))]
    np.testing.assert_allclose(lps, ref, rtol=0, atol=1e-12)


def test_errors_name_the_server_and_the_reason(fake):
    state, url = fake
    state.abort_next = True
    with pytest.raises(InferenceError, match="aborted the request: weights updating"):
        with_client(url, lambda c: c.sample("m", [1], 1, 3, 1.0))
    state.adapters["gone"] = "/p"
    client_adapters = {"gone"}

    async def stale(c: SglangClient) -> None:
        c.adapters |= client_adapters
        state.adapters.clear()  # the server restarted and lost it
        await c.sample("gone", [1], 1, 3, 1.0)

    with pytest.raises(InferenceError, match=r"/generate -> HTTP 400.*gone is not loaded"):
        with_client(url, stale)
    with pytest.raises(BackendUnsupported, match="SGLang client samples token ids only"):
        with_client(url, lambda c: c.sample_chat("m", [], [1], 1, 3, 1.0))


def test_tokenize_renders_chat_on_the_server_and_refuses_no_generation_prompt(fake):
    state, url = fake
    msgs = [{"role": "user", "content": "hi"}]

    async def go(c: SglangClient) -> list[int]:
        c.cfg = c.cfg.model_copy(update={"chat_template_kwargs": {"enable_thinking": False}})
        return await c.tokenize_prompt("m", msgs)

    ids = with_client(url, go)
    assert ids == [ord(ch) % VOCAB for ch in "user:hi|assistant:"]
    body = state.seen[-1][1]
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and "add_generation_prompt" not in body
    assert with_client(url, lambda c: c.tokenize_text("m", "ab")) == [ord("a") % VOCAB, ord("b") % VOCAB]
    with pytest.raises(BackendUnsupported, match="always appends the generation prompt"):
        with_client(url, lambda c: c.tokenize_chat("m", msgs, add_generation_prompt=False))


def test_make_client_picks_the_backend():
    from tidal.inference.backends.vllm.client import VllmClient

    async def kinds() -> tuple[type, type]:
        a, b = make_client(ClientSection()), make_client(ClientSection(backend="sglang"))
        await a.close()
        await b.close()
        return type(a), type(b)

    assert asyncio.run(kinds()) == (VllmClient, SglangClient)
