"""Oversized co-located runs exit 2 before anything starts, naming the keys to lower and the figures that would
fit (issue 42): the Llama-3.1-8B shape at 64k context with 128 rollouts on an 80 GB card, through the split
(`tidal.colocate.split`), `tidal.colocate.start.derive` on a real model directory, and `tidal grpo --dry-run`; a
fitting Qwen3-0.6B shape on the same card; a hand-set `gpu_memory_utilization` checked instead of split.

The GPU's total memory is an input (`Machine.gpu_memory_gib`): nothing here touches CUDA."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tidal.colocate import start
from tidal.colocate.derive import Machine, ModelFacts, derive_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.models.sources import resolve_model

H100_GIB = 79.18
GPU = Machine(cores=tuple(range(16)), has_gpu=True, gpu_memory_gib=H100_GIB)
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
"""meta-llama/Llama-3.1-8B's config.json (as published; no weights needed: the split reads the config)."""
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}
"""Qwen/Qwen3-0.6B's config.json."""
BIG = {"batch_size": 128, "rollouts_per_example": 16, "seq_len": 65536}
"""8 prompts x 16 rollouts at 64k context."""


def figures(text: str, pattern: str) -> int:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return int(m.group(1))


def refusal(orch: dict, train: TrainConfig | None = None) -> str:
    with pytest.raises(ConfigError) as exc:
        derive_colocate(train or TrainConfig(model="m"), InferConfig(model="m"), OrchConfig.model_validate(orch), GPU,
                        model=ModelFacts(config=LLAMA_3_1_8B))
    return str(exc.value)


def test_the_8b_shape_at_64k_with_128_rollouts_is_refused_naming_keys_and_figures():
    text = refusal(BIG)
    assert "79.2 GiB GPU" in text and "KV cache 1126.4 GiB for 128 sequences x 65536 tokens" in text
    assert "weights 15.0" in text and "the trainer" in text
    for key in ("orch seq_len (65536", "infer max_model_len", "orch batch_size", "rollouts_per_example",
                "per_device_train_batch_size or micro_batch_tokens", "qlora_bnb", "gpu_memory_utilization"):
        assert key in text, key


def test_the_figures_a_refusal_names_fit_when_applied():
    train = TrainConfig(model="m", gradient_checkpointing=True, per_device_train_batch_size=1)
    orch = {**BIG, "seq_len": 8192}
    text = refusal(orch, train)
    assert "orch seq_len (8192" in text and "kv_cache_dtype: fp8" in text
    length = figures(text, r"at most ~(\d+) tokens fit for 128 sequences")
    seqs = figures(text, r"at most (\d+) fit at 8192 tokens")
    assert 0 < seqs < 128 and 0 < length < 8192
    for fits in ({**orch, "seq_len": length}, {**orch, "batch_size": seqs, "rollouts_per_example": 1}):
        co = derive_colocate(train, InferConfig(model="m"), OrchConfig.model_validate(fits), GPU,
                             model=ModelFacts(config=LLAMA_3_1_8B))
        assert 0 < co.infer.gpu_memory_utilization < 1


def test_the_0_6b_shape_fits_the_same_card_with_a_plan():
    orch = OrchConfig.model_validate({**BIG, "seq_len": 2048})
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), orch, GPU, model=ModelFacts(config=QWEN3_0_6B))
    notice = next(n for n in co.placement.notices if n.startswith("GPU ("))
    assert "128 sequences x 2048 tokens" in notice and "trainer needs" in notice
    assert co.infer.max_model_len == 2048 and co.train.gradient_checkpointing in (True, False)
    # with less memory the same run is refused: the total is an input, not read from a device
    with pytest.raises(ConfigError, match="do not both fit on this 8.0 GiB GPU"):
        derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), orch,
                        Machine(cores=(0,), has_gpu=True, gpu_memory_gib=8.0), model=ModelFacts(config=QWEN3_0_6B))


def model_dir(tmp_path: Path, config: dict) -> Path:
    """A model directory of `config` with the bundled tokenizer and a one-tensor model.safetensors standing in for
    its 16 GB of weights (the CLI checks that weights are there; the refusal comes before anything loads them)."""
    import numpy as np
    from safetensors.numpy import save_file

    out = tmp_path / "llama-8b-shape"
    out.mkdir()
    save_file({"lm_head.weight": np.zeros((1, 1), dtype=np.float32)}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    bundled = Path(resolve_model("tidal:tiny-reverse"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled / name, out / name)
    return out


def test_start_derive_refuses_before_calibrating_or_starting(tmp_path):
    model = str(model_dir(tmp_path, LLAMA_3_1_8B))
    with pytest.raises(ConfigError, match="do not both fit") as exc:
        # calibrate=True as a real start: the estimate alone refuses, nothing is measured on a GPU
        start.derive(TrainConfig(model=model), InferConfig(model=model), OrchConfig.model_validate(BIG),
                     output_dir=tmp_path / "run", calibrate=True, machine=GPU)
    assert "orch seq_len" in str(exc.value)
    assert not (tmp_path / "run").exists()


def test_tidal_grpo_dry_run_exits_2_naming_the_keys(tmp_path, monkeypatch, capsys):
    from tidal import cli

    model = str(model_dir(tmp_path, LLAMA_3_1_8B))
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: GPU))  # this machine's facts: an 80 GB GPU
    code = cli.main(["grpo", "--dry-run", "--model", model, "--output-dir", str(tmp_path / "run"),
                     "--orch.batch_size", "128", "--orch.rollouts_per_example", "16", "--orch.seq_len", "65536",
                     "--train.sequence_len", "65536", "--infer.max_model_len", "65536"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "do not both fit on this 79.2 GiB GPU" in err and "orch seq_len (65536" in err
    assert not (tmp_path / "run").exists()


def test_a_hand_set_share_is_checked_not_split():
    orch = OrchConfig.model_validate({**BIG, "seq_len": 2048})
    facts = ModelFacts(config=LLAMA_3_1_8B)
    with pytest.raises(ConfigError, match="infer gpu_memory_utilization 0.1 gives vLLM 7.9 GiB.*at least 0.2"):
        derive_colocate(TrainConfig(model="m"), InferConfig(model="m", gpu_memory_utilization=0.1), orch, GPU,
                        model=facts)
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", gpu_memory_utilization=0.9), orch, GPU,
                         model=facts)
    assert co.infer.gpu_memory_utilization == 0.9 and "--kv-cache-memory-bytes" not in co.infer.extra_args
    note = next(n for n in co.placement.notices if "set by hand" in n)
    assert "expect CUDA to run out of memory in the trainer" in note
    roomy = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", gpu_memory_utilization=0.3), orch, GPU,
                            model=ModelFacts(config=QWEN3_0_6B))
    assert not any("expect CUDA" in n for n in roomy.placement.notices)


def test_a_max_model_len_above_the_in_flight_tokens_gets_a_cache_that_holds_one_request():
    """vLLM refuses to start when its KV cache cannot hold one max_model_len request: the split sizes it so."""
    from tidal.colocate.split import kv_bytes_per_token

    orch = OrchConfig.model_validate({"batch_size": 2, "rollouts_per_example": 2, "seq_len": 512})
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", max_model_len=32768), orch, GPU,
                         model=ModelFacts(config=QWEN3_0_6B))
    kv = int(co.infer.extra_args[co.infer.extra_args.index("--kv-cache-memory-bytes") + 1])
    assert kv >= 32768 * kv_bytes_per_token(QWEN3_0_6B, "bfloat16")


def test_grpo_trainer_construction_refuses_before_anything_starts(tmp_path, monkeypatch):
    """The Python API derives at construction (`GRPOTrainer(...)`): the same refusal, a ValueError naming the keys."""
    from tidal import GRPOConfig, GRPOTrainer

    model = str(model_dir(tmp_path, LLAMA_3_1_8B))
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: GPU))
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=16, generation_batch_size=128,
                      per_device_train_batch_size=8, max_prompt_length=1024, max_completion_length=64512)
    with pytest.raises(ValueError, match="do not both fit on this 79.2 GiB GPU.*orch seq_len \\(65536"):
        GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=[{"prompt": "abc"}] * 8)
    assert not (tmp_path / "run").exists()
