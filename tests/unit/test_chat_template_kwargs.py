"""`chat_template_kwargs` reach every place a prompt is rendered with a chat template: the orchestrator's
training prompts and evaluation prompts (vLLM's `/tokenize`, through `VllmClient.tokenize_chat`) and
`tidal sft`'s prompts (the tokenizer's `apply_chat_template`). The tokenizer's template reads a variable,
`enable_thinking`, the way Qwen3's does, so the rendered ids differ exactly when the kwarg arrives.

The inference server here is a local HTTP server that renders `/tokenize` requests with the same tokenizer,
reading the request's `chat_template_kwargs` field the way vLLM's `TokenizeChatRequest` does (a misspelled
field would be ignored there too, and the ids would not differ)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tidal.config import ConfigError, OrchConfig, TrainConfig
from tidal.config.load import validate
from tidal.config.orch import ClientSection
from tidal.envs import make_env
from tidal.inference.backends.vllm.client import VllmClient
from tidal.models.sources import bundled
from tidal.monitor.metrics import MetricsWriter
from tidal.orchestrator.evaluation import Evaluator
from tidal.orchestrator.groups import draw_prompts
from tidal.trainer.sft import make_sft_batch, render_prompt

THINKING_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
NO_THINKING = {"enable_thinking": False}
MESSAGES = [{"role": "user", "content": "abc def"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """The bundled model's tokenizer with a chat template that reads `enable_thinking`."""
    out = tmp_path_factory.mktemp("thinking-tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(bundled("tidal:tiny-reverse")) / name, out / name)
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    from tidal.trainer.model.load import load_tokenizer

    return load_tokenizer(str(tok_dir))


@pytest.fixture(scope="module")
def server(tok):
    """A stand-in for vLLM: `/tokenize` renders with `tok`, `/v1/completions` returns a fixed completion."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            return

        def do_POST(self) -> None:  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize" and "messages" in req:
                ids = render_prompt(tok, req["messages"], req.get("chat_template_kwargs"))
                body: dict[str, Any] = {"tokens": ids, "count": len(ids)}
            elif self.path == "/tokenize":
                body = {"tokens": tok(req["prompt"], add_special_tokens=False)["input_ids"]}
            else:  # /v1/completions
                body = {"choices": [{"index": i, "text": "fed cba", "token_ids": [5, 6], "finish_reason": "stop",
                                     "logprobs": {"token_logprobs": [-0.1, -0.2]}} for i in range(req["n"])]}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def client_for(url: str, kwargs: dict[str, Any] | None) -> VllmClient:
    return VllmClient(ClientSection(base_url=[url], chat_template_kwargs=kwargs or {}))


def test_the_template_variable_changes_the_rendered_ids(tok):
    plain, no_think = render_prompt(tok, MESSAGES), render_prompt(tok, MESSAGES, NO_THINKING)
    assert no_think[:len(plain)] == plain and len(no_think) > len(plain)
    assert render_prompt(tok, MESSAGES, {"enable_thinking": True}) == plain


@pytest.mark.parametrize("kwargs", [None, NO_THINKING])
def test_training_prompts_are_rendered_with_the_client_kwargs(server, tok, kwargs):
    cfg = OrchConfig.model_validate({"client": {"chat_template_kwargs": kwargs or {}}})
    env = make_env("reverse-text")

    async def go() -> tuple[list[Any], list[list[int]]]:
        client = client_for(server, kwargs)
        try:
            return await draw_prompts(env, random.Random(0), client, "m", 3, cfg, {})
        finally:
            await client.close()

    examples, prompts = asyncio.run(go())
    assert prompts == [render_prompt(tok, ex.prompt, kwargs) for ex in examples]
    other = NO_THINKING if kwargs is None else None
    assert all(p != render_prompt(tok, ex.prompt, other) for p, ex in zip(prompts, examples, strict=True))


def test_evaluation_prompts_are_rendered_with_the_client_kwargs(server, tok, tmp_path):
    cfg = OrchConfig.model_validate({"eval": {"env": [{"id": "reverse-text"}], "num_examples": 2}})
    assert cfg.eval is not None

    async def prompts_with(kwargs: dict[str, Any] | None) -> list[list[int]]:
        ev = Evaluator(cfg.eval, cfg.sampling, cfg.seq_len, MetricsWriter(tmp_path / f"eval-{bool(kwargs)}.jsonl"))
        client = client_for(server, kwargs)
        try:
            await ev.run(client, "m", "m", 0, 0, 1.0)
        finally:
            await client.close()
        return ev.prompts["reverse-text"]

    plain, no_think = asyncio.run(prompts_with(None)), asyncio.run(prompts_with(NO_THINKING))
    examples = Evaluator(cfg.eval, cfg.sampling, cfg.seq_len, MetricsWriter(tmp_path / "x.jsonl")).sets[
        "reverse-text"][1]
    assert no_think == [render_prompt(tok, ex.prompt, NO_THINKING) for ex in examples]
    assert plain == [render_prompt(tok, ex.prompt) for ex in examples] and plain != no_think


def test_sft_prompts_are_rendered_with_the_sft_kwargs(tok):
    env, rng = make_env("reverse-text"), random.Random(0)
    examples = [env.sample(rng) for _ in range(3)]
    targets = [env.reference_completion(e) for e in examples]
    plain = make_sft_batch(tok, examples, targets, 1)
    no_think = make_sft_batch(tok, examples, targets, 1, NO_THINKING)
    extra = len(render_prompt(tok, MESSAGES, NO_THINKING)) - len(render_prompt(tok, MESSAGES))
    assert list(no_think.lengths - plain.lengths) == [extra] * 3 and extra > 0
    assert no_think.loss_mask.sum() == plain.loss_mask.sum()  # the completion tokens are the same


def test_template_arguments_tidal_sets_itself_are_refused():
    with pytest.raises(ConfigError, match=r"client\.chat_template_kwargs.*add_generation_prompt"):
        validate(OrchConfig, {"client": {"chat_template_kwargs": {"add_generation_prompt": False}}}, "orch.yaml")
    with pytest.raises(ConfigError, match=r"sft\.chat_template_kwargs.*tokenize"):
        validate(TrainConfig, {"model": "m", "sft": {"chat_template_kwargs": {"tokenize": False}}}, "train.yaml")
    assert TrainConfig(model="m", sft={"chat_template_kwargs": NO_THINKING}).sft.chat_template_kwargs == NO_THINKING
