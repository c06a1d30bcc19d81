"""Config parsing: the seed's Quick Start files, shipped examples, overrides, and every kind of mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tidal.cli import extract_overrides, split_overrides
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig, load_config
from tidal.config.orch import EvalSection

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "src" / "tidal" / "examples").rglob("*.yaml")) + sorted((REPO / "examples").rglob("*.yaml"))
KIND = {"train": TrainConfig, "infer": InferConfig, "orch": OrchConfig}

# The seed's Quick Start files as written there (seed 000), model path aside.
SEED_TRAIN = """
model: "Qwen/Qwen3-0.6B"
output_dir: ./outputs
gpus: 1
per_device_train_batch_size: 1
sequence_len: 2048
max_steps: 40
logging_steps: 1
learning_rate: 2e-4
lr_scheduler_type: constant
max_grad_norm: 1.0
weight_decay: 0.01
recipe: fp8-hybrid
lora: true
lora_rank: 16
lora_alpha: 32
lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]
loss:
  ratio_type: token
  kl_tau: 0.0
  adv_tau: 1.0
  token_mask_low: 0.125
  token_mask_high: 8.0
  geo_mask_low: 0.1
  geo_mask_high: 10.0
"""
SEED_INFER = """
model: "Qwen/Qwen3-0.6B"
enable_lora: true
max_lora_rank: 32
"""
SEED_ORCH = """
model:
  name: "Qwen/Qwen3-0.6B"
  lora_adapter: "default"
  lora_rank: 16
  lora_alpha: 32
env:
  - id: reverse-text
batch_size: 128
rollouts_per_example: 16
seq_len: 2048
max_steps: 40
sampling:
  max_tokens: 128
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_seed_quick_start_files_parse_with_seed_values(tmp_path):
    train = load_config(TrainConfig, write(tmp_path, "train.yaml", SEED_TRAIN))
    infer = load_config(InferConfig, write(tmp_path, "infer.yaml", SEED_INFER))
    orch = load_config(OrchConfig, write(tmp_path, "orch.yaml", SEED_ORCH))
    assert train.learning_rate == 2e-4 and train.loss.token_mask_low == 0.125 and train.recipe == "fp8-hybrid"
    assert infer.max_lora_rank == 32 and infer.port == 8000 and infer.max_loras == 8
    assert orch.batch_size == 128 and orch.rollouts_per_example == 16 and orch.sampling.max_tokens == 128
    assert orch.max_async_level == 1 and orch.max_off_policy_steps == 8  # seed defaults
    assert orch.client.base_url == ["http://localhost:8000/v1"] and orch.sampling.temperature == 1.0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_example_parses(path):
    load_config(KIND[path.stem], path)


def test_unknown_key_names_file_key_and_nearest_valid_key(tmp_path):
    p = write(tmp_path, "orch.yaml", SEED_ORCH + "rollouts_per_exmple: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(OrchConfig, p)
    msg = str(e.value)
    assert str(p) in msg and "rollouts_per_exmple" in msg and "did you mean 'rollouts_per_example'" in msg


def test_unknown_nested_key_is_reported_with_its_path(tmp_path):
    p = write(tmp_path, "train.yaml", SEED_TRAIN.replace("kl_tau: 0.0", "kl_tua: 0.0"))
    with pytest.raises(ConfigError, match=r"loss\.kl_tua.*did you mean 'kl_tau'"):
        load_config(TrainConfig, p)


def test_wrong_type_names_key_and_value(tmp_path):
    p = write(tmp_path, "train.yaml", SEED_TRAIN.replace("learning_rate: 2e-4", "learning_rate: fast"))
    with pytest.raises(ConfigError, match=r"'learning_rate'.*'fast'"):
        load_config(TrainConfig, p)


def test_batch_size_must_be_a_multiple_of_group_size(tmp_path):
    with pytest.raises(ConfigError, match="multiple of rollouts_per_example"):
        load_config(OrchConfig, write(tmp_path, "orch.yaml", SEED_ORCH.replace("batch_size: 128", "batch_size: 100")))


@pytest.mark.parametrize("snippet,ok", [  # seed 000 "QLoRA for RL Training", as written there
    ("lora: true\nqlora_fp8: true\nrecipe: bf16\n", True),
    ("lora: true\nqlora_bnb: true\nrecipe: bf16\n", True),
    ("lora: true\nqlora_fp4: true\nrecipe: nvfp4\n", False),
])
def test_seed_qlora_snippets_load_or_are_refused_with_the_reason(tmp_path, snippet, ok):
    text = SEED_TRAIN.replace("recipe: fp8-hybrid\nlora: true\n", "") + snippet
    if ok:
        cfg = load_config(TrainConfig, write(tmp_path, "t.yaml", text))
        assert cfg.qlora_bnb or cfg.qlora_fp8
        return
    with pytest.raises(ConfigError, match="Blackwell") as e:
        load_config(TrainConfig, write(tmp_path, "t.yaml", text))
    assert "qlora_fp4" in str(e.value) or "nvfp4" in str(e.value)


def test_sampling_keys_validate(tmp_path):
    base = {"max_steps": 10, "sampling": {"temp_scheduler": {"type": "cosine", "start_temperature": 1.2,
                                                              "end_temperature": 0.6}}}
    cfg = OrchConfig.model_validate(base)
    assert OrchConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # dumped configs revalidate
    with pytest.raises(ValueError, match="temperature or sampling.temp_scheduler, not both"):
        OrchConfig.model_validate({**base, "sampling": {**base["sampling"], "temperature": 0.7}})
    with pytest.raises(ValueError, match="temp_scheduler needs max_steps"):
        OrchConfig.model_validate({"sampling": base["sampling"]})
    with pytest.raises(ValueError, match="min_tokens .* exceeds sampling.max_tokens"):
        OrchConfig.model_validate({"sampling": {"min_tokens": 9, "max_tokens": 8}})


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_temperature_schedule_matches_a_float64_formula(kind):
    import math

    from tidal.orchestrator.sampling import temperature_at

    start, end, n = 1.3, 0.5, 9
    cfg = OrchConfig.model_validate({"max_steps": n, "sampling": {"temp_scheduler": {
        "type": kind, "start_temperature": start, "end_temperature": end}}})
    for step in range(1, n + 1):
        p = (step - 1) / (n - 1)
        cos = end + (start - end) * 0.5 * (1 + math.cos(math.pi * p))
        want = start + (end - start) * p if kind == "linear" else cos
        assert abs(temperature_at(cfg.sampling, cfg.max_steps, step) - want) < 1e-12
    assert temperature_at(cfg.sampling, cfg.max_steps, 1) == start
    assert abs(temperature_at(cfg.sampling, cfg.max_steps, n) - end) < 1e-12
    assert temperature_at(OrchConfig.model_validate({"sampling": {"temperature": 0.8}}).sampling, None, 5) == 0.8


def test_unimplemented_key_at_its_default_is_accepted(tmp_path):
    cfg = load_config(OrchConfig, write(tmp_path, "orch.yaml", SEED_ORCH + "filters: []\n"))
    assert cfg.filters == []


def test_dotted_overrides_are_typed_like_yaml(tmp_path):
    cfg = load_config(OrchConfig, write(tmp_path, "orch.yaml", SEED_ORCH),
                      {"batch_size": "32", "sampling.temperature": "0.7", "client.base_url": "[http://a:1/v1]"})
    assert cfg.batch_size == 32 and cfg.sampling.temperature == 0.7 and cfg.client.base_url == ["http://a:1/v1"]


def test_override_parsing_routes_by_component():
    rest, extra = extract_overrides(["grpo", "--orch.batch_size", "32", "--train", "t.yaml",
                                     "--train.loss.kl_tau=0.1", "--dry-run"])
    assert rest == ["grpo", "--train", "t.yaml", "--dry-run"]
    assert split_overrides(extra, {"train", "orch", "infer"}) == {"orch": {"batch_size": "32"},
                                                                  "train": {"loss.kl_tau": "0.1"}}
    with pytest.raises(ConfigError, match="overrides for train"):
        split_overrides(["--orch.batch_size", "3"], {"train"})


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_cli_unknown_key_exits_2_with_message():
    r = run_cli("grpo", "--orch.batch_sise", "3", "--dry-run")
    assert r.returncode == 2
    assert "batch_sise" in r.stderr and "did you mean 'batch_size'" in r.stderr and "orch.yaml" in r.stderr


def test_cli_wrong_type_exits_2(tmp_path):
    p = write(tmp_path, "orch.yaml", SEED_ORCH.replace("batch_size: 128", "batch_size: many"))
    r = run_cli("grpo", "--orch", str(p), "--dry-run")
    assert r.returncode == 2 and "batch_size" in r.stderr and str(p) in r.stderr


def test_cli_missing_model_path_exits_2(tmp_path):
    r = run_cli("grpo-train", "--train.model", str(tmp_path / "nope"), "--dry-run")
    assert r.returncode == 2 and "nope" in r.stderr and "model" in r.stderr


def test_cli_missing_config_file_exits_2(tmp_path):
    r = run_cli("grpo-orch", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "missing.yaml" in r.stderr and "not found" in r.stderr


def test_cli_dry_run_prints_resolved_configs_with_output_dir(tmp_path):
    r = run_cli("grpo", "--dry-run", "--output-dir", str(tmp_path / "run"), "--train.learning_rate", "1e-4",
                "--infer.port", "8123")
    assert r.returncode == 0, r.stderr
    docs = [yaml.safe_load(part) for part in r.stdout.split("# --- ")[1:] for part in [part.split("---\n", 1)[1]]]
    train, infer, orch = docs
    assert train["learning_rate"] == 1e-4 and infer["port"] == 8123
    assert train["output_dir"] == orch["output_dir"] == str(tmp_path / "run")
    assert orch["client"]["base_url"] == ["http://127.0.0.1:8123/v1"]
    assert not (tmp_path / "run").exists(), "--dry-run must start and write nothing"


def test_configuration_docs_are_current():
    from tidal.config.docs import render

    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == render(), "run: .venv/bin/python -m tidal.config.docs > docs/configuration.md"


def test_docs_list_every_seed_orchestrator_key():
    text = (REPO / "docs" / "configuration.md").read_text()
    for key in ["sampling.temp_scheduler", "buffer.env_ratios", "advantage.length_weighted_mean", "client.elastic",
                "rollout_transport.hwm", "weight_broadcast.timeout", "max_off_policy_steps", "env[].address"]:
        assert f"`{key}" in text, key


def test_no_orchestrator_or_inference_key_is_unsupported():
    text = (REPO / "docs" / "configuration.md").read_text()
    orch_and_infer = text[text.index("## Inference (`infer.yaml`)"):]
    rows = [line for line in orch_and_infer.splitlines() if line.startswith("| `")]
    assert len(rows) > 120
    assert not [r for r in rows if "not supported" in r]


def test_grpo_with_nccl_broadcast_configures_all_three_components(tmp_path):
    r = run_cli("grpo", "--dry-run", "--output-dir", str(tmp_path / "run"), "--infer.port", "8123",
                "--orch.weight_broadcast.type", "nccl", "--orch.weight_broadcast.port", "29555",
                "--orch.weight_broadcast.timeout", "77", "--orch.client.api_key_var", "MY_KEY")
    assert r.returncode == 0, r.stderr
    train, infer, orch = [yaml.safe_load(part.split("---\n", 1)[1]) for part in r.stdout.split("# --- ")[1:]]
    assert infer["weight_broadcast_type"] == "nccl"
    assert train["weight_broadcast"] == {"type": "nccl", "host": "localhost", "port": 29555, "timeout": 77,
                                         "base_url": ["http://127.0.0.1:8123/v1"], "api_key_var": "MY_KEY",
                                         "backend": "vllm"}
    assert train["broadcast_merged"] is False, "pushed weights need no merged files"
    assert orch["weight_broadcast"]["type"] == "nccl"


def test_cli_grpo_port_in_use_exits_2_and_starts_nothing(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("grpo", "--infer.port", str(port), "--output-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr
    assert not (tmp_path / "run").exists(), "nothing may be started or written"


@pytest.mark.parametrize("cls,data,match", [
    (InferConfig, {"model": "m", "reasoning_parser": "qwen3"}, r"'reasoning_parser' would have no effect.*chat"),
    (InferConfig, {"model": "m", "enable_auto_tool_choice": True}, r"'enable_auto_tool_choice' would have no eff"),
    (InferConfig, {"model": "m", "tool_call_parser": "hermes"}, r"'tool_call_parser' would have no effect"),
    (OrchConfig, {"eval": {"env": [{"id": "reverse-text"}], "cancel_inflight_rollouts_on_eval": True}},
     r"cancel_inflight_rollouts_on_eval' would have no effect: evaluations run between batches"),
    (OrchConfig, {"oversampling_factor": 2.0}, r"oversampling_factor 2.0 has no effect without group filters"),
])
def test_keys_that_would_have_no_effect_are_refused_with_the_reason(cls, data, match):
    with pytest.raises(ValueError, match=match):
        cls.model_validate(data)
    refused = {**InferConfig.REFUSED, **EvalSection.REFUSED}
    assert any(key in match for key in refused) or "oversampling_factor" in match  # docs say "default only"


def test_refused_keys_accept_their_defaults_and_oversampling_works_with_filters():
    InferConfig.model_validate({"model": "m", "reasoning_parser": None, "enable_auto_tool_choice": False})
    OrchConfig.model_validate({"eval": {"env": [{"id": "reverse-text"}], "cancel_inflight_rollouts_on_eval": False}})
    assert OrchConfig.model_validate({"oversampling_factor": 2.0, "dynamic_sampling": True}).oversampling_factor == 2
    ok = OrchConfig.model_validate({"oversampling_factor": 2.0, "buffer": {"online_difficulty_filtering": True}})
    assert ok.oversampling_factor == 2.0


def test_infer_backend_is_vllm_or_sglang_and_sglang_refuses_the_keys_it_cannot_map(tmp_path):
    assert load_config(InferConfig, write(tmp_path, "i.yaml", SEED_INFER + "backend: vllm\n")).backend == "vllm"
    assert load_config(InferConfig, write(tmp_path, "i.yaml", SEED_INFER + "backend: sglang\n")).backend == "sglang"
    with pytest.raises(ConfigError, match="(?s)i.yaml.*backend sglang: cpu_kvcache_space_gib"):
        load_config(InferConfig, write(tmp_path, "i.yaml", SEED_INFER + "backend: sglang\ncpu_kvcache_space_gib: 4\n"))
    with pytest.raises(ConfigError, match="backend"):
        load_config(InferConfig, write(tmp_path, "i.yaml", SEED_INFER + "backend: trtllm\n"))
