"""A base model (the bundled tiny model without its chat template) given chat-message prompts (reverse-text), through
the real `tidal grpo`: without `chat_template` it exits 2 before vLLM starts, naming the model and both ways out;
with `--infer.chat_template FILE` (a template unlike the model's ChatML) it trains 2 GRPO steps, and every prompt the
trainer gets is exactly the template's rendering of the example's messages (token ids, by the trainer's tokenizer),
and the exported adapter carries the template.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import free_port, kill_group, tidal
from tidal.assets import ASSETS
from tidal.envs.reverse_text import SYSTEM_PROMPT
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def base_model(out: Path) -> Path:
    shutil.copytree(ASSETS / "tiny-reverse", out, ignore=shutil.ignore_patterns("chat_template.jinja"))
    return out


def grpo(model: Path, run_dir: Path, *extra: str, timeout: float = 900) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", "2", "--orch.batch_size", "16", "--orch.rollouts_per_example", "4",
                 "--orch.sampling.max_tokens", "24", "--orch.sampling.seed", "7", *extra)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, out, time.monotonic() - t0


def test_chat_prompts_on_a_base_model_exit_2_before_vllm_starts(tmp_path):
    model = base_model(tmp_path / "base")
    rc, out, seconds = grpo(model, tmp_path / "run", timeout=120)
    assert rc == 2, out[-3000:]
    assert f"model '{model}' has no chat template" in out and "'reverse-text'" in out, out[-3000:]
    assert "plain-text prompts" in out and "chat_template" in out
    assert "vLLM" not in out.split("config error")[0], "nothing started before the refusal"
    assert not (tmp_path / "run" / "logs").exists() or not any((tmp_path / "run" / "logs").glob("*vllm*"))
    assert seconds < 10, f"refused after {seconds:.1f} s"


def test_chat_template_key_trains_a_base_model_on_chat_prompts(tmp_path):
    from tidal.trainer.model.load import load_tokenizer

    model = base_model(tmp_path / "base")
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    run_dir = tmp_path / "run"
    rc, out, _ = grpo(model, run_dir, "--infer.chat_template", str(template))
    assert rc == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and abs(rows[0]["mismatch_kl"]) <= 1e-3
    tok = load_tokenizer(str(model), chat_template=str(template))  # the trainer's tokenizer, as train.yaml gets it
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    head, tail = f"[system] {SYSTEM_PROMPT}\n[user] ", "\n[assistant] "
    for s in batch.samples():
        mask, toks = batch.loss_mask[s].astype(int), batch.tokens[s]
        prompt = [int(t) for t in toks[:int(np.argmax(mask > 0))]]
        text = tok.decode(prompt)
        assert text.startswith(head) and text.endswith(tail), text
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": text[len(head):-len(tail)]}]
        rendered = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert prompt == list(rendered)
    assert (run_dir / "final" / "adapter" / "chat_template.jinja").read_text() == TEMPLATE
