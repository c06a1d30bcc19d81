"""Every architecture: the inference server's LoRA layers are the trainer's LoRA targets (issue 33).

`vllm_argv` (and SGLang's argv) carry `--lora-target-modules` with infer `lora_target_modules` resolved on the
model, which for `all-linear` must equal what the trainer's PEFT adapter adapts (`tests.archs.ARCHS[...].linear`,
checked against the real trainer model in test_models.py): never the LM head or the embeddings. `tidal grpo`
makes infer's key follow train's, and switches LoRA off in vLLM wherever no adapter is ever loaded.
"""

from __future__ import annotations

import pytest

from tests.archs import ARCHS, build
from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError


def targets_in(argv: list[str]) -> list[str]:
    i = argv.index("--lora-target-modules")
    out = []
    for arg in argv[i + 1:]:
        if arg.startswith("--"):
            break
        out.append(arg)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {name: build(name, root / name) for name in ARCHS}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_vllm_argv_names_the_trainers_targets(name, model_dirs):
    from tidal.inference.backends.vllm.server import vllm_argv

    argv = vllm_argv(InferConfig(model=str(model_dirs[name]), enable_lora=True))
    got = targets_in(argv)
    assert got == sorted(ARCHS[name].linear)
    assert not {"lm_head", "embed_tokens"} & set(got)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_the_torch_free_table_agrees_with_the_meta_model(name, model_dirs):
    """`tidal grpo-infer` names the targets from config.json where `LINEAR_BY_MODEL_TYPE` decides (no torch import
    before vLLM's exec): the table must be what the trainer's PEFT resolves on the real module tree."""
    from tidal.models.lora import linear_names_from_config, meta_model, resolve_lora_targets

    table = linear_names_from_config(str(model_dirs[name]))
    model, arch = meta_model(str(model_dirs[name]))
    if table is not None:
        assert list(table) == resolve_lora_targets(model, "all-linear", arch)
    else:
        # built on the meta device: MoE experts, Gemma 4's optional per-layer-input projections and Qwen3.5's
        # linear-attention projections depend on more of the config than its model_type
        # (and a VLM checkpoint's language model, read from its text_config)
        assert ARCHS[name].vision is not None or ARCHS[name].config_class in (
            "Qwen3MoeConfig", "Gemma4TextConfig", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"), \
            f"{name}: add its model_type to the table"


def test_named_targets_pass_through_and_a_wrong_name_is_refused(model_dirs):
    from tidal.inference.backends.vllm.server import vllm_argv

    cfg = InferConfig(model=str(model_dirs["llama3"]), lora_target_modules=["q_proj", "v_proj"])
    assert targets_in(vllm_argv(cfg)) == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="lm_head matches no linear module"):
        vllm_argv(cfg.model_copy(update={"lora_target_modules": ["lm_head"]}))


def test_no_lora_no_target_list(model_dirs):
    from tidal.inference.backends.vllm.server import vllm_argv

    argv = vllm_argv(InferConfig(model=str(model_dirs["llama3"]), enable_lora=False))
    assert "--enable-lora" not in argv and "--lora-target-modules" not in argv


def test_sglang_argv_names_the_trainers_targets(model_dirs):
    from tidal.inference.backends.sglang.server import sglang_argv

    argv = sglang_argv(InferConfig(model=str(model_dirs["phi3"]), backend="sglang", gpu_memory_utilization=0.5))
    assert targets_in(argv) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert "all" not in targets_in(argv)
    llama = InferConfig(model=str(model_dirs["llama3"]), backend="sglang", gpu_memory_utilization=0.5)
    assert targets_in(sglang_argv(llama)) == sorted(ARCHS["llama3"].linear)


def test_the_host_adapter_cache_defaults_to_one_batch_and_is_never_below_it(model_dirs, tmp_path):
    """vLLM keeps every adapter it was given until `--max-cpu-loras` push the oldest out (an API unload only forgets
    the name), so with `reload: lora` host memory holds that many policies: null passes `max_loras`, an explicit
    value passes as is, and one below `max_loras` (vLLM refuses it at start) is a config error naming both keys."""
    from tidal.config.load import load_config
    from tidal.inference.backends.sglang.server import sglang_argv
    from tidal.inference.backends.vllm.server import vllm_argv

    def after(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    model = str(model_dirs["llama3"])
    for max_loras, cpu, want in ((8, None, "8"), (3, None, "3"), (3, 40, "40"), (5, 5, "5")):
        cfg = InferConfig(model=model, enable_lora=True, max_loras=max_loras, max_cpu_loras=cpu)
        assert after(vllm_argv(cfg), "--max-cpu-loras") == want, (max_loras, cpu)
        assert after(vllm_argv(cfg), "--max-loras") == str(max_loras)
        sg = cfg.model_copy(update={"backend": "sglang", "gpu_memory_utilization": 0.5})
        assert after(sglang_argv(sg), "--max-loaded-loras") == want, (max_loras, cpu)
    path = tmp_path / "infer.yaml"
    path.write_text(f"model: {model}\nmax_loras: 4\nmax_cpu_loras: 2\n")
    with pytest.raises(ConfigError, match=r"max_cpu_loras 2 is below max_loras 4") as e:
        load_config(InferConfig, path)
    assert str(path) in str(e.value)
