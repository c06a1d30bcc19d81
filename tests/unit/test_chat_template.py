"""The `chat_template` key and the up-front refusal of chat prompts on a model without a template
(`tidal.config.chat_template`, `tidal.models.chat_template`): file vs inline, a missing or empty file (exit 2 naming
the key), which template a model directory carries, `tidal grpo` keeping infer's and train's equal, the value reaching
vLLM's command line, the trainer's tokenizer, the merged export and the Python API, and `tidal grpo` / `tidal eval`
on a base model (the bundled tiny model without its template) refusing chat prompts before anything starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.assets import ASSETS
from tidal.config.chat_template import is_inline, template_arg, template_text
from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError, load_config
from tidal.config.train import TrainConfig
from tidal.models.chat_template import check_chat_prompts, model_template

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
REPO = Path(__file__).resolve().parents[2]


def base_model(out: Path) -> Path:
    """The bundled tiny model without its chat template: a base model."""
    shutil.copytree(ASSETS / "tiny-reverse", out, ignore=shutil.ignore_patterns("chat_template.jinja"))
    assert model_template(out) is None
    return out


def test_inline_and_file_give_the_same_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert is_inline(TEMPLATE) and not is_inline(str(f))
    assert template_text(TEMPLATE) == template_text(str(f)) == TEMPLATE
    assert template_arg(TEMPLATE) == TEMPLATE and template_arg(str(f)) == str(f.resolve())
    assert InferConfig(model="m", chat_template=str(f)).chat_template == str(f)
    assert TrainConfig(model="m", chat_template=TEMPLATE).chat_template == TEMPLATE


@pytest.mark.parametrize("what", ["missing", "empty", "blank"])
def test_a_bad_value_is_refused_naming_the_key(tmp_path, what):
    value = {"missing": str(tmp_path / "nope.jinja"), "empty": str(tmp_path / "e.jinja"), "blank": "  "}[what]
    (tmp_path / "e.jinja").write_text("\n")
    (tmp_path / "infer.yaml").write_text(f"model: tidal:tiny-reverse\nchat_template: {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=r"chat_template.*(no file .*nope\.jinja|is empty)"):
        load_config(InferConfig, tmp_path / "infer.yaml")


def test_which_template_a_model_directory_carries(tmp_path):
    d = base_model(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": [
        {"name": "tool_use", "template": "{{ 'x' }}"}, {"name": "default", "template": TEMPLATE}]}))
    assert model_template(d) == TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": [{"name": "rag", "template": "y"}]}))
    assert model_template(d) is None  # named templates without a default: transformers would refuse too
    (d / "chat_template.jinja").write_text("{{ 'jinja' }}")
    assert model_template(d) == "{{ 'jinja' }}"
    assert model_template(ASSETS / "tiny-reverse") == (ASSETS / "tiny-reverse" / "chat_template.jinja").read_text()


def test_chat_prompts_without_a_template_are_refused_with_both_ways_out(tmp_path):
    d = base_model(tmp_path / "m")
    with pytest.raises(ConfigError) as err:
        check_chat_prompts("my-base", d, None, ["reverse-text"], "chat_template")
    msg = str(err.value)
    assert "model 'my-base' has no chat template" in msg and "'reverse-text'" in msg
    assert "plain-text prompts" in msg and "set chat_template to a chat template" in msg
    check_chat_prompts("my-base", d, TEMPLATE, ["reverse-text"], "chat_template")  # the key gives one
    check_chat_prompts("my-base", d, None, [], "chat_template")  # plain-text prompts need none
    check_chat_prompts("tidal:tiny-reverse", ASSETS / "tiny-reverse", None, ["reverse-text"], "chat_template")


def test_grpo_keeps_infer_and_train_templates_equal(tmp_path):
    from tidal.colocate.wire import wire_colocate
    from tidal.config.orch import OrchConfig

    orch = OrchConfig(output_dir=str(tmp_path / "run"))
    t, i, _ = wire_colocate(TrainConfig(model="tidal:tiny-reverse"), InferConfig(model="tidal:tiny-reverse",
                                                                                 chat_template=TEMPLATE), orch)
    assert t.chat_template == i.chat_template == TEMPLATE
    t, i, _ = wire_colocate(TrainConfig(model="tidal:tiny-reverse", chat_template=TEMPLATE),
                            InferConfig(model="tidal:tiny-reverse"), orch)
    assert t.chat_template == i.chat_template == TEMPLATE
    with pytest.raises(ConfigError, match="(?s)train chat_template .* and infer chat_template .* differ"):
        wire_colocate(TrainConfig(model="tidal:tiny-reverse", chat_template=TEMPLATE),
                      InferConfig(model="tidal:tiny-reverse", chat_template=TEMPLATE + " "), orch)


def test_vllm_and_sglang_get_the_template(tmp_path):
    from tidal.inference.backends.vllm.server import vllm_argv

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    for value, arg in ((str(f), str(f.resolve())), (TEMPLATE, TEMPLATE)):
        argv = vllm_argv(InferConfig(model="tidal:tiny-reverse", chat_template=value))
        assert argv[argv.index("--chat-template") + 1] == arg
    assert "--chat-template" not in vllm_argv(InferConfig(model="tidal:tiny-reverse"))
    with pytest.raises(ValueError, match="SGLang's --chat-template reads a file"):
        InferConfig(model="tidal:tiny-reverse", backend="sglang", chat_template=TEMPLATE)


def test_the_trainer_tokenizer_and_the_merged_export_carry_it(tmp_path):
    pytest.importorskip("torch")
    from tidal.trainer.model.load import load_tokenizer

    d = base_model(tmp_path / "m")
    tok = load_tokenizer(str(d), chat_template=TEMPLATE)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids) == "[system] be brief\n[user] abc\n[assistant] "
    assert load_tokenizer(str(d)).chat_template is None
    from tidal.trainer.publish import export

    class Flat:  # write_merged's model: only its merged weights are read (monkeypatched below)
        pass

    saved = export.merged_state_dict
    export.merged_state_dict = lambda model, keys: {}  # type: ignore[assignment]
    try:
        out = export.write_merged(Flat(), d, tmp_path / "merged", tok.chat_template)
    finally:
        export.merged_state_dict = saved  # type: ignore[assignment]
    assert model_template(out) == TEMPLATE


def test_the_python_api_maps_chat_template_path(tmp_path):
    from tidal.api.grpo_config import GRPOConfig, to_tidal

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    d = to_tidal(GRPOConfig(chat_template_path=str(f), max_prompt_length=64, output_dir=str(tmp_path / "o")),
                 "tidal:tiny-reverse", 8, 1)
    assert d.infer.chat_template == d.train.chat_template == str(f)


def run_cli(*args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_grpo_dry_run_refuses_chat_prompts_on_a_base_model(tmp_path):
    """The same refusal `tidal grpo` runs before vLLM starts (`tidal.colocate.preflight.check_run`; the real run's is
    in tests/integration/test_base_model_template.py); with `--infer.chat_template` the dry run passes."""
    d = base_model(tmp_path / "m")
    rc, out, _ = run_cli("grpo", "--dry-run", "--model", str(d), "--output-dir", str(tmp_path / "run"))
    assert rc == 2, out[-2000:]
    assert f"model '{d}' has no chat template" in out and "'reverse-text'" in out and "plain-text prompts" in out
    rc, out, _ = run_cli("grpo", "--dry-run", "--model", str(d), "--output-dir", str(tmp_path / "run"),
                         "--infer.chat_template", TEMPLATE)
    assert rc == 0, out[-2000:]


def test_eval_refuses_chat_prompts_on_a_base_model(tmp_path):
    d = base_model(tmp_path / "m")
    rc, out, _ = run_cli("eval", "--dry-run", "--model", str(d), "--env", "reverse-text", "--num-examples", "2")
    assert rc == 2 and "has no chat template" in out and "tidal eval --chat-template" in out, out[-2000:]
    rc, out, _ = run_cli("eval", "--dry-run", "--model", str(d), "--env", "reverse-text", "--num-examples", "2",
                         "--chat-template", TEMPLATE)
    assert rc == 0, out[-2000:]


def test_a_standard_prompt_keeps_the_leading_bos_and_drops_a_trailing_eos():
    from tidal.models.chat_template import standard_prompt_ids

    assert standard_prompt_ids([2, 5, 6, 7], [5, 6, 7]) == [2, 5, 6, 7]  # Gemma: <bos> text
    assert standard_prompt_ids([1, 5, 6, 2], [5, 6]) == [1, 5, 6]  # BOS text EOS: the prompt goes on
    assert standard_prompt_ids([5, 6], [5, 6]) == [5, 6]  # Qwen, SmolLM2, the bundled model: nothing added
    assert standard_prompt_ids([9, 9], [5, 6]) == [5, 6]  # not the same text framed: the plain ids


def test_a_gguf_tokenizer_gets_back_the_bos_its_file_asks_for(tmp_path):
    """transformers' GGUF tokenizer drops `add_bos_token` (Gemma 3's `<bos>`); `restore_bos` puts it back, only
    when the file's record says so."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tidal.models.sources.gguf import TOKENIZER_FILE, restore_bos

    for add_bos, first in ((True, "<|im_start|>"), (False, None)):
        d = base_model(tmp_path / f"m{add_bos}")
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": "<|im_start|>"}))
        (d / TOKENIZER_FILE).write_text(json.dumps({"add_bos_token": add_bos}))
        plain = AutoTokenizer.from_pretrained(str(d))("ab", add_special_tokens=False).input_ids
        restore_bos(d)
        restore_bos(d)  # idempotent
        tok = AutoTokenizer.from_pretrained(str(d))
        ids = tok("ab").input_ids
        assert ids == ([tok.convert_tokens_to_ids(first)] if first else []) + plain


def test_a_server_without_a_template_is_named_with_both_ways_out():
    """Split mode (`grpo-orch` against a server started elsewhere): the orchestrator cannot know the server's template
    up front, so vLLM's HTTP 400 at the first chat `/tokenize` becomes an error naming both ways out. The server is a
    stand-in answering as vLLM 0.32 does for a model without a template."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.inference.protocol import InferenceError

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            return

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"error": {"message": "As of transformers v4.44, default chat template is no longer "
                                         "allowed, so you must provide a chat template if the tokenizer does not "
                                         "define one.", "code": 400}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    async def go():
        client = VllmClient(ClientSection(base_url=[f"http://127.0.0.1:{srv.server_address[1]}/v1"]))
        try:
            return await client.tokenize_prompt("base", [{"role": "user", "content": "hi"}])
        finally:
            await client.close()

    try:
        with pytest.raises(InferenceError, match=r"model 'base' .* has no chat template .* plain-text prompts, or "
                                                 r"start the server with infer chat_template"):
            asyncio.run(go())
    finally:
        srv.shutdown()


def test_sft_refuses_chat_prompts_on_a_base_model_before_loading_it(tmp_path):
    d = base_model(tmp_path / "m")
    rc, out, _ = run_cli("sft", "--train.model", str(d), "--train.output_dir", str(tmp_path / "o"),
                         "--train.max_steps", "1")
    assert rc == 2 and "has no chat template" in out and "train chat_template (--train.chat_template)" in out, \
        out[-2000:]
