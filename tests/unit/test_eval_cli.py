"""`tidal eval`'s refusals: each exits 2 naming what is wrong, before any server starts (`--dry-run` would start
nothing anyway; without it the same checks run first): an adapter of another base model or with a wrong rank, a
missing adapter, an environment without a fixed eval set and no --num-examples, an unreadable GGUF, nothing to do.
Models are built from configs (random init, no downloads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import MODEL
from tidal.config.evaluate import EvalConfig
from tidal.evaluate.cli import add_parser, eval_config


def run_eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidal.cli", "eval", *args], capture_output=True, text=True,
                          timeout=300)


def other_model(path: Path) -> Path:
    """A tiny random Llama with other shapes than the bundled model (hidden 48)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def adapter_of(model_dir: Path, out: Path, r: int = 4) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    get_peft_model(model, LoraConfig(r=r, target_modules=["q_proj", "v_proj"])).save_pretrained(str(out))
    return out


def test_an_adapter_of_another_base_model_is_refused_naming_the_tensor(tmp_path):
    adapter = adapter_of(other_model(tmp_path / "llama"), tmp_path / "adapter")
    done = run_eval("--model", MODEL, "--env", "reverse-text", "--num-examples", "4", "--adapter", str(adapter))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"adapter {adapter}" in done.stderr and "shape" in done.stderr and "needs" in done.stderr


def test_an_adapter_whose_rank_contradicts_its_tensors_is_refused(tmp_path):
    from tidal.models.sources import resolve_model

    adapter = adapter_of(Path(resolve_model(MODEL)), tmp_path / "adapter", r=4)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    done = run_eval("--model", MODEL, "--env", "reverse-text", "--num-examples", "4", "--adapter", str(adapter),
                    "--dry-run")
    assert done.returncode == 2 and "rank 8" in done.stderr, done.stderr[-2000:]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    ok = run_eval("--model", MODEL, "--env", "reverse-text", "--num-examples", "4", "--adapter", str(adapter),
                  "--dry-run")
    assert ok.returncode == 0 and "2 rows, 4 examples: checked" in ok.stdout, ok.stderr[-2000:]


@pytest.mark.parametrize(("extra", "named"), [({"use_dora": True}, "use_dora"),
                                              ({"modules_to_save": ["lm_head"]}, "modules_to_save")])
def test_dora_and_modules_to_save_adapters_are_refused_before_vllm_starts(tmp_path, extra, named):
    """Issue 66: vLLM's LoRA loader serves lora_A/B only: a DoRA adapter was scored without its magnitude vectors
    (silently another model) and a modules_to_save adapter crashed the run after vLLM started. Both exit 2 naming
    the adapter and the key, in the dry run already (nothing started)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tidal.models.sources import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL))
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra)).save_pretrained(str(adapter))
    done = run_eval("--model", MODEL, "--env", "reverse-text", "--num-examples", "4", "--adapter", str(adapter),
                    "--dry-run")
    assert done.returncode == 2, (done.stdout[-1000:], done.stderr[-2000:])
    assert f"adapter {adapter}" in done.stderr and named in done.stderr, done.stderr[-2000:]


def test_a_run_directory_means_its_final_adapter(tmp_path):
    from tidal.evaluate.targets import adapter_dir
    from tidal.models.sources import resolve_model

    run = tmp_path / "run"
    adapter_of(Path(resolve_model(MODEL)), run / "final" / "adapter")
    assert adapter_dir(str(run)) == run / "final" / "adapter"
    assert adapter_dir(str(run / "final" / "adapter")) == run / "final" / "adapter"


def test_missing_adapter_env_without_eval_set_unreadable_gguf_and_nothing_to_do_exit_2(tmp_path):
    missing = run_eval("--model", MODEL, "--env", "reverse-text", "--num-examples", "4", "--adapter",
                       str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
    no_set = run_eval("--model", MODEL, "--env", "reverse-text")
    assert no_set.returncode == 2 and "has no fixed eval set" in no_set.stderr and "--num-examples" in no_set.stderr
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00not a gguf file at all")
    gguf = run_eval("--model", str(bad), "--env", "addition", "--dry-run")
    assert gguf.returncode == 2 and f"model {bad}" in gguf.stderr, gguf.stderr[-2000:]
    nothing = run_eval("--model", MODEL, "--env", "addition", "--no-greedy")
    assert nothing.returncode == 2 and "nothing to sample" in nothing.stderr
    unknown = run_eval("--model", MODEL, "--env", "no-such-env", "--num-examples", "2", "--dry-run")
    assert unknown.returncode == 2 and "env no-such-env" in unknown.stderr, unknown.stderr[-2000:]


def test_flags_override_the_file_and_env_entries_parse_as_yaml(tmp_path):
    import argparse

    cfg_file = tmp_path / "eval.yaml"
    cfg_file.write_text("model: m\nsamples: 4\nenv: {id: addition, args: {eval_size: 32}}\n")
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["eval", str(cfg_file), "--samples", "8", "--adapter", "a", "--adapter", "b"])
    cfg = eval_config(args)
    assert (cfg.model, cfg.samples, cfg.adapters, cfg.env.args) == ("m", 8, ["a", "b"], {"eval_size": 32})
    args = p.parse_args(["eval", "--env", "{id: math, name: m2}", "--env-args", "{level: 2}"])
    assert eval_config(args).env.model_dump(include={"id", "name", "args"}) == {"id": "math", "name": "m2",
                                                                                  "args": {"level": 2}}
    with pytest.raises(ValueError, match="address"):
        EvalConfig(address="http://x:1", serve="merged")


def test_on_cpu_the_eval_server_gets_every_core_unless_the_user_bound_it(monkeypatch):
    import os

    from tidal.config.infer import InferConfig
    from tidal.evaluate.serve import every_core
    from tidal.inference.backends.vllm.server import vllm_env

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    env = vllm_env(InferConfig(model=MODEL), every_core(True))
    engine_threads = env.get("TIDAL_ENGINE_OMP_THREADS", env["OMP_NUM_THREADS"])  # a forked engine core's: fork_core
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores)) and engine_threads == str(len(cores))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in every_core(False)  # not on CPU: vLLM's own binding
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert every_core(True)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_keys_without_effect_are_refused_naming_the_key():
    """Issue 66: `--temperature` without `--samples` (greedy rows have no temperature) and `--port` / `--dtype`
    with `--address` (a running server: tidal eval starts none) were accepted and ignored; each is a ConfigError
    naming the key and what would give it effect (exit 2 through the CLI); with their partner they are taken."""
    from tidal.config.load import ConfigError

    p = __import__("argparse").ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    cases = [(["--temperature", "0.7"], r"temperature .*samples"),
             (["--address", "http://127.0.0.1:9", "--port", "8123"], r"port .*address"),
             (["--address", "http://127.0.0.1:9", "--dtype", "bfloat16"], r"dtype .*address")]
    for flags, match in cases:
        with pytest.raises(ConfigError, match=match):
            eval_config(p.parse_args(["eval", *flags]))
    assert eval_config(p.parse_args(["eval", "--temperature", "0.7", "--samples", "4"])).temperature == 0.7
    assert eval_config(p.parse_args(["eval", "--port", "8123", "--dtype", "bfloat16"])).port == 8123
    assert eval_config(p.parse_args(["eval", "--address", "http://127.0.0.1:9", "--dtype", "auto"])).dtype == "auto"
    done = run_eval("--model", MODEL, "--env", "reverse-text", "--num-examples", "4", "--temperature", "0.5",
                    "--dry-run")
    assert done.returncode == 2 and "temperature" in done.stderr, done.stderr[-2000:]
