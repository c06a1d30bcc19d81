"""Every refusal comes before anything starts: the trainer's and the orchestrator's start-up refusals (and the
model's length limit) each make `tidal grpo --dry-run` exit 2 naming the key, in a real subprocess that starts
nothing (`tidal.colocate.preflight`). The same checks run in `GRPOTrainer(...)` (a `ValueError`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tidal.examples import __file__ as examples_init

EXAMPLE = Path(examples_init).parent / "reverse_text"


def orch_file(tmp_path: Path, name: str, **update: object) -> str:
    """The bundled example's orch.yaml with `update` applied, written to `tmp_path`."""
    cfg = yaml.safe_load((EXAMPLE / "orch.yaml").read_text()) | update
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def sliding_window_model(tmp_path: Path) -> str:
    from tests.archs import build

    return str(build("gemma2", tmp_path / "gemma2"))  # sliding window 64: prompts cannot be shared in 512 tokens


def cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (the arguments after `tidal grpo --dry-run`, what the error must say)."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "abc"}\n')
    dataset = [{"id": "dataset", "args": {"path": str(data)}}]
    o = lambda name, **kw: ["--orch", orch_file(tmp_path, name, **kw)]  # noqa: E731
    return {
        # the model's limit (1,024 positions)
        "orch seq_len": (["--orch.seq_len", "2048", "--train.sequence_len", "2048", "--infer.max_model_len", "2048"],
                         r"orch seq_len is 2048, but model tidal:tiny-reverse holds 1024 positions"),
        "infer max_model_len": (["--infer.max_model_len", "4096"], r"infer max_model_len is 4096.*1024 positions"),
        # the trainer's
        "train sequence_len": (["--train.sequence_len", "1500"], r"train sequence_len is 1500.*holds 1024"),
        "lora targets": (["--train.lora_target_modules", "[nope_proj]"], r"lora_target_modules: nope_proj"),
        "qerl without merged weights": (["--train.noise_scheduler.enabled", "true",
                                         "--orch.weight_broadcast.reload", "lora"], r"noise_scheduler.enabled"),
        "qerl without a run length": ([*o("no_steps", max_steps=None), "--train.noise_scheduler.enabled", "true"],
                                      r"needs train max_steps"),
        "prompt sharing": (["--model", sliding_window_model(tmp_path), "--train.prompt_sharing", "true"],
                           r"prompt_sharing: true.*sliding-window"),
        "rope scaling": (["--train.rope_scaling", "{rope_type: nope}"], r"unknown rope_type 'nope'"),
        "teacher": (["--train.loss.teacher_tau", "0.5"], r"loss.teacher_tau is 0.5 but orch teacher is not set"),
        # the orchestrator's
        "environment": (o("env", env=[{"id": "nope"}]), r"unknown environment id 'nope'"),
        "environment args": (o("env_args", env=[{"id": "reverse-text", "args": {"nope": 1}}]), r"bad args"),
        "reward function": (o("rf", reward_funcs=[{"import_path": "tidal_no_such_module:f"}]),
                            r"cannot import 'tidal_no_such_module:f'"),
        "nothing scores": (o("unscored", env=dataset), r"nothing scores the completions"),
        "advantage function": (o("adv", advantage={"type": "custom", "import_path": "tidal_no_such_module:f"}),
                               r"cannot import 'tidal_no_such_module:f'"),
        "eval env without reward": (o("eval", eval={"env": dataset}), r"eval env 'dataset' has no reward"),
    }


def cli(*args: str) -> subprocess.CompletedProcess:
    """`tidal ARGS` in a subprocess (this checkout's sources first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return cli("grpo", "--dry-run", *args)


def test_every_trainer_and_orchestrator_refusal_exits_2_from_the_dry_run(tmp_path, capsys):
    """Each case through the CLI's `main` (what the `tidal` script exits with), in process for speed; the
    subprocess test below checks that path end to end."""
    from tidal.cli import main

    for name, (args, match) in cases(tmp_path).items():
        code = main(["grpo", "--dry-run", *args])
        out, err = capsys.readouterr()
        assert code == 2, f"{name}: exit {code}\n{err[-2000:]}"
        assert re.search(match, err), f"{name}: {err[-2000:]}"
        assert "# --- train ---" not in out, f"{name}: the dry run printed configs after refusing"


def test_the_tidal_command_exits_2_before_anything_starts(tmp_path):
    refused = dry_run("--train.sequence_len", "1500", "--output-dir", str(tmp_path / "run"))
    assert refused.returncode == 2 and "train sequence_len is 1500" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "run").exists(), "nothing was started or written"
    ok = dry_run()
    assert ok.returncode == 0 and "# --- orch ---" in ok.stdout, ok.stderr[-2000:]  # the checks can pass
    # grpo-orch refuses with the same check (it builds its loop from it)
    orch = cli("grpo-orch", orch_file(tmp_path, "o", env=[{"id": "nope"}]), "--output-dir", str(tmp_path / "o-run"))
    assert orch.returncode == 2 and "unknown environment id 'nope'" in orch.stderr, orch.stderr[-2000:]


@pytest.mark.parametrize("kw,match", [
    ({"max_completion_length": 2048}, r"orch seq_len is 2560, but model tidal:tiny-reverse holds 1024 positions"),
    ({"vllm_max_model_length": 4096, "max_prompt_length": None}, r"orch seq_len is 4096"),
])
def test_the_python_api_refuses_in_its_constructor(kw, match):
    from tidal import GRPOConfig, GRPOTrainer

    with pytest.raises(ValueError, match=match):
        GRPOTrainer("tidal:tiny-reverse", reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=GRPOConfig(output_dir="/nonexistent/never-written", **kw), train_dataset=[{"prompt": "ab"}])


def test_the_model_limit_follows_vllms_rule_for_rope_scaling():
    from tidal.config import ConfigError
    from tidal.models.limits import check_lengths, max_positions

    base = {"max_position_embeddings": 1024, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert max_positions(base) == (1024, "max_position_embeddings")
    assert max_positions({**base, "n_positions": 512})[0] == 512, "the smallest key set wins"
    assert max_positions({"text_config": base, "vision_config": {}})[0] == 1024, "a VLM's text config"
    assert max_positions({}) is None
    linear = max_positions(base, {"rope_type": "linear", "factor": 4.0})
    assert linear is not None and linear[0] == 4096 and "factor 4" in linear[1]
    assert max_positions(base, {"type": "dynamic", "factor": 2})[0] == 2048, "the legacy `type` key"
    for kind in ("yarn", "llama3", "longrope"):  # their config's length is already the stretched one
        assert max_positions(base, {"rope_type": kind, "factor": 8.0})[0] == 1024, kind
    old = {"max_position_embeddings": 1024, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e4}
    assert max_positions(old)[0] == 2048, "the model's own (pre-transformers-5) scaling"
    check_lengths("m", base, {"orch seq_len": 1024, "infer max_model_len": None})
    with pytest.raises(ConfigError, match=r"orch seq_len is 1025, but model m holds 1024 positions.*factor: 2"):
        check_lengths("m", base, {"orch seq_len": 1025})
    check_lengths("m", base, {"orch seq_len": 3000}, {"rope_type": "linear", "factor": 4.0})


def weightless_model(tmp_path: Path) -> Path:
    """The bundled model's directory without its weights: config.json, tokenizer and chat template only."""
    import shutil

    from tidal.models.sources import bundled

    out = tmp_path / "no-weights"
    shutil.copytree(bundled("tidal:tiny-reverse"), out, ignore=shutil.ignore_patterns("*.safetensors"))
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    return out


def test_a_model_directory_without_weights_exits_2_naming_what_is_missing(tmp_path):
    """Before: the dry run passed (exit 0), and the real run started vLLM before the trainer died with
    transformers' `OSError: Error no file named model.safetensors`."""
    model = weightless_model(tmp_path)
    refused = dry_run("--model", str(model), "--output-dir", str(tmp_path / "run"))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"model directory {model.resolve()}" in refused.stderr, refused.stderr[-2000:]
    assert "no weight files (*.safetensors, *.bin, *.pt, model.safetensors.index.json" in refused.stderr
    assert not (tmp_path / "run").exists(), "nothing was started or written"


def test_teacher_and_reward_model_directories_without_weights_exit_2(tmp_path, capsys):
    """The teacher `tidal grpo` serves and a reward model in a local directory are checked the same way (a Hub id
    is left to load when used)."""
    from tidal.cli import main

    model = str(weightless_model(tmp_path))
    runs = {"orch teacher": orch_file(tmp_path, "teacher", teacher={"model": model}),
            "orch reward_funcs[0].kwargs.model": orch_file(tmp_path, "rm", reward_funcs=[
                {"import_path": "tidal.rewards.model:reward_model", "kwargs": {"model": model}}])}
    for where, orch in runs.items():
        assert main(["grpo", "--dry-run", "--orch", orch]) == 2, where
        err = capsys.readouterr().err
        assert where in err and "holds a config.json but no weight files" in err, f"{where}: {err[-2000:]}"
    hub = orch_file(tmp_path, "hub-rm", reward_funcs=[{"import_path": "tidal.rewards.model:reward_model",
                                                       "kwargs": {"model": "nobody/not-downloaded-here"}}])
    assert main(["grpo", "--dry-run", "--orch", hub]) == 0, capsys.readouterr().err[-2000:]


def huge_model(tmp_path: Path) -> Path:
    """A Llama-3-70B-shaped config.json with the bundled tokenizer and a stand-in weights file (the dry run reads
    no weight, it only checks they are there)."""
    import json
    import shutil

    from tidal.models.sources import bundled

    out = tmp_path / "llama-70b-shape"
    shutil.copytree(bundled("tidal:tiny-reverse"), out, ignore=shutil.ignore_patterns("*.safetensors", "config*"))
    (out / "model.safetensors").write_bytes(b"stand-in")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}))
    return out


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="on a GPU machine the GPU split refuses it instead")
def test_a_model_beyond_this_machines_memory_exits_2_with_the_figures(tmp_path, capsys):
    from tidal.cli import main

    assert main(["grpo", "--dry-run", "--model", str(huge_model(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert re.search(r"does not fit this machine's memory: vLLM and the trainer need at least \d+\.\d GiB "
                     r"\(vLLM weights \d+\.\d, vLLM KV cache 1\.0, trainer \d+\.\d GiB.*\), \d+\.\d GiB is available",
                     err), err[-2000:]


def test_the_cpu_memory_need_adds_vllms_copy_and_the_trainers():
    from tidal.colocate.cpu_memory import check_cpu_memory, cpu_need
    from tidal.config import ConfigError, InferConfig, TrainConfig
    from tidal.models.config import model_config
    from tidal.models.memory import GIB, parameter_count

    config = model_config("tidal:tiny-reverse")
    train = TrainConfig(model="tidal:tiny-reverse", sequence_len=512)
    infer = InferConfig(model="tidal:tiny-reverse", dtype="float32", enable_lora=False, cpu_kvcache_space_gib=2)
    need = cpu_need(train, infer, config)
    assert need.parts["vLLM weights"] == parameter_count(config) * 4 and need.parts["vLLM KV cache"] == 2 * GIB
    assert need.parts["trainer"] > GIB  # the estimate's runtime GiB, weights, LoRA state, activations, margin
    two = cpu_need(train, infer.model_copy(update={"dp": 2}), config, teacher=(infer, config))
    assert two.parts["vLLM KV cache x 2 servers"] == 4 * GIB and two.parts["teacher vLLM KV cache"] == 2 * GIB
    check_cpu_memory(train, infer, config, available_gib=need.total / GIB + 0.1)  # fits
    check_cpu_memory(train, infer, config, available_gib=None)  # unknown: not checked
    with pytest.raises(ConfigError, match=r"need at least \d+\.\d GiB \(vLLM weights 0\.0, vLLM KV cache 2\.0, "
                                          r"trainer \d\.\d GiB.*\), 1\.5 GiB is available"):
        check_cpu_memory(train, infer, config, available_gib=1.5)


def test_the_python_api_refuses_a_reward_model_directory_without_weights(tmp_path):
    from tidal import GRPOConfig, GRPOTrainer

    with pytest.raises(ValueError, match=r"reward function 'no-weights': model directory .* holds a config.json but "
                                         r"no weight files"):
        GRPOTrainer("tidal:tiny-reverse", reward_funcs=str(weightless_model(tmp_path)),
                    args=GRPOConfig(output_dir=str(tmp_path / "never-written")), train_dataset=[{"prompt": "ab"}])
    assert not (tmp_path / "never-written").exists()
