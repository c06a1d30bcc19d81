"""`tidal eval` against a real vLLM on the bundled model: the base model and a LoRA adapter (random B, so it changes
the model) scored greedily, each completion checked against transformers' own greedy decoding of the same prompt
tokens (float32): equal, or diverging only at a near tie (the two tokens' logprobs within 1e-3 at the first
different position, where vLLM's and torch's float32 sums may order them differently); the JSON report, its intervals
and the paired difference to the base row. The refusals (exit 2, nothing started) are in tests/unit/test_eval_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import MODEL, tidal
from tidal.models.sources import resolve_model

pytestmark = pytest.mark.vllm

NEAR_TIE = 1e-3
N = 16


def random_adapter(path: Path, seed: int = 0) -> Path:
    from peft import LoraConfig, get_peft_model

    from tidal.trainer.model.load import load_base_model

    torch.manual_seed(seed)
    model = load_base_model(resolve_model(MODEL), torch.device("cpu"), torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    peft.save_pretrained(str(path))
    return path


def reference_check(model: torch.nn.Module, sample: dict, max_tokens: int) -> bool:
    """transformers' greedy completion of the sample's prompt tokens; True when equal to vLLM's, False when they
    diverge at a near tie (asserted), else the assertion fails."""
    prompt = torch.tensor([sample["prompt_ids"]])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    ref = out[0, prompt.shape[1]:].tolist()
    got = sample["token_ids"]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ref = ref[:next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
    if ref == got:
        return True
    j = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
    assert j < min(len(ref), len(got)), f"one completion is a prefix of the other: {ref} vs {got}"
    with torch.no_grad():
        logits = model(torch.tensor([sample["prompt_ids"] + ref[:j]])).logits[0, -1].double().log_softmax(-1)
    gap = abs(float(logits[ref[j]] - logits[got[j]]))
    assert gap < NEAR_TIE, f"example {sample['example']}: vLLM chose {got[j]} over {ref[j]} at {j} (gap {gap})"
    return False


def test_eval_scores_base_and_adapter_as_transformers_decodes_them(tmp_path):
    from peft import PeftModel

    from tidal.trainer.model.load import load_base_model

    adapter = random_adapter(tmp_path / "adapter")
    out = tmp_path / "eval.json"
    proc = tidal("eval", "--model", MODEL, "--env", "reverse-text", "--num-examples", str(N), "--seed", "3",
                 "--adapter", str(adapter), "--samples", "3", "--max-tokens", "24", "--show-samples", str(N),
                 "--out", str(out), "--quiet")
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text[-3000:]
    report = json.loads(out.read_text())
    assert report["serve"] == "merged" and report["examples"] == N  # CPU: merged weights reloaded in place
    base, tuned = report["rows"]
    assert base["label"] == "base" and tuned["adapter"] == str(adapter.resolve())
    for row in (base, tuned):
        g, s = row["greedy"], row["sampled"]
        assert g["examples"] == N and g["completions"] == 1 and s["completions"] == 3
        assert g["accuracy_lo"] <= g["accuracy"] <= g["accuracy_hi"] and {"pass@1", "pass@3"} <= set(s)
        assert s["pass@1"] <= s["pass@2"] <= s["pass@3"] and 0 <= g["cut/share"] <= 1
        assert len(row["samples"]) == N
    assert "vs_first" in tuned and "greedy/accuracy" in tuned["vs_first"]
    assert not out.with_name("eval.json.partial").exists()  # the rows written as they finished, removed at the end
    assert "greedy accuracy" in text and "base" in text  # the terminal table
    path = resolve_model(MODEL)
    plain = load_base_model(path, torch.device("cpu"), torch.float32).eval()
    equal = sum(reference_check(plain, s, 24) for s in base["samples"])
    peft = PeftModel.from_pretrained(load_base_model(path, torch.device("cpu"), torch.float32), str(adapter)).eval()
    equal_tuned = sum(reference_check(peft, s, 24) for s in tuned["samples"])
    assert equal >= N - 2 and equal_tuned >= N - 2, (equal, equal_tuned)
    differ = sum(a["token_ids"] != b["token_ids"] for a, b in zip(base["samples"], tuned["samples"], strict=True))
    assert differ >= 1, "the adapter row was sampled with the adapter's weights (an ignored adapter: no difference)"


@pytest.mark.slow  # 73 s; the check firing stays in the default suite: tests/integration/test_policy_identity.py
def test_eval_stops_on_an_adapter_row_vllm_serves_as_the_base_unless_the_check_is_off(tmp_path):
    """The policy identity check of `tidal eval`: an adapter published with its probe (as tidal's trainer publishes
    `broadcasts/step_n`), whose weights were then made a no-op, is served as the base model: exit 4 and one line
    naming the row's adapter, the step and the distances; the base row scored before it is in the partial report
    (`tidal.evaluate.partial`), and `--resume --no-policy-check` keeps it and scores the adapter row anyway."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    from tidal.trainer.model.load import load_base_model, load_tokenizer
    from tidal.trainer.publish.probe import Prober

    adapter = random_adapter(tmp_path / "adapter", seed=1)
    path = resolve_model(MODEL)
    peft = PeftModel.from_pretrained(load_base_model(path, torch.device("cpu"), torch.float32), str(adapter))
    Prober(peft, load_tokenizer(path)).record(peft, 5).write(adapter)
    file = str(adapter / "adapter_model.safetensors")
    save_file({k: v * 0 if "lora_B" in k else v for k, v in load_file(file).items()}, file)
    args = ["eval", "--model", MODEL, "--env", "reverse-text", "--num-examples", "2", "--max-tokens", "4",
            "--adapter", str(adapter), "--out", str(tmp_path / "eval.json"), "--quiet"]
    proc = tidal(*args)
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 4, text[-3000:]
    [line] = [x for x in text.splitlines() if "policy identity check failed" in x]
    assert "at step 5" in line and str(adapter) in line and "it serves the base model" in line
    assert not (tmp_path / "eval.json").exists()
    [base] = json.loads((tmp_path / "eval.json.partial").read_text())["rows"]
    assert base["label"] == "base" and base["greedy"]["examples"] == 2
    proc = tidal(*args, "--resume", "--no-policy-check")
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and (tmp_path / "eval.json").is_file(), text[-3000:]
    rows = json.loads((tmp_path / "eval.json").read_text())["rows"]
    assert rows[0] == {**base, "vs_first": {}} and rows[1]["adapter"] == str(adapter.resolve())
    assert not (tmp_path / "eval.json.partial").exists()
