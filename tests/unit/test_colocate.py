"""`tidal grpo`'s co-locate derivation (`tidal.colocate.derive`): new configs plus a placement, inputs untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.colocate.derive import CPU_NO_LORA_NOTICE, NO_LORA_NOTICE, ON_POLICY_NOTICE, Machine, derive_colocate
from tidal.colocate.wire import wire_colocate, with_resume
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig

CPU2 = Machine(cores=(0, 1))
GPU16 = Machine(cores=tuple(range(16)), has_gpu=True)


def configs(**orch: object) -> tuple[TrainConfig, InferConfig, OrchConfig]:
    return TrainConfig(model="m"), InferConfig(model="m"), OrchConfig.model_validate(orch)


def test_two_cpu_cores_with_overlap_vllm_on_core_0_trainer_on_core_1_with_worker_merges():
    co = derive_colocate(*configs(max_async_level=1), CPU2)
    p = co.placement
    assert (p.device, p.vllm_cores, p.trainer_cores) == ("cpu", (0,), (1,))
    assert co.train.cpu_affinity == [1] and co.orch.max_async_level == 1
    assert dict(p.infer_env) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert p.notices == (CPU_NO_LORA_NOTICE, "CPU only: vLLM on cores 0, trainer on cores [1]")
    # a LoRA policy reaches vLLM as its factors, merged in its worker (bench/WEIGHT_SYNC.md): no merged copy written
    assert co.orch.weight_broadcast.reload == "factors" and not co.train.broadcast_merged and co.infer.weight_reload
    assert not co.infer.enable_lora  # no adapter reaches vLLM: it serves (and vLLM-CPU compiles) the plain model


def test_vllm_runs_without_lora_on_cpu_exactly_when_no_adapter_reaches_it():
    from tidal.inference.backends.vllm.server import vllm_argv

    infer = InferConfig(model="tidal:tiny-reverse")
    co = derive_colocate(TrainConfig(model="tidal:tiny-reverse"), infer, OrchConfig(), CPU2)
    assert co.orch.weight_broadcast.reload == "factors" and not co.infer.enable_lora
    assert "--enable-lora" not in vllm_argv(co.infer) and infer.enable_lora  # the user's config is untouched
    explicit = InferConfig(model="tidal:tiny-reverse", enable_lora=True)  # infer.yaml sets it: kept
    co = derive_colocate(TrainConfig(model="tidal:tiny-reverse"), explicit, OrchConfig(), CPU2)
    assert co.infer.enable_lora and "--enable-lora" in vllm_argv(co.infer)
    assert CPU_NO_LORA_NOTICE not in co.placement.notices
    nccl = OrchConfig.model_validate({"weight_broadcast": {"type": "nccl"}})
    assert not derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), nccl, CPU2).infer.enable_lora
    lora = OrchConfig.model_validate({"weight_broadcast": {"reload": "lora"}})  # adapters loaded into vLLM
    tiny = "tidal:tiny-reverse"
    co = derive_colocate(TrainConfig(model=tiny), InferConfig(model=tiny), lora, CPU2)
    assert co.infer.enable_lora and CPU_NO_LORA_NOTICE not in co.placement.notices
    assert "--enable-lora" in vllm_argv(co.infer)
    # on a GPU the adapters are served as they are (reload auto -> lora)
    assert derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(), GPU16).infer.enable_lora
    # ... and where none reaches vLLM (merged reloads, nccl pushes) it runs without LoRA on a GPU too (issue 33)
    merged = OrchConfig.model_validate({"weight_broadcast": {"reload": "merged"}})
    for orch in (merged, nccl):
        co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), orch, GPU16)
        assert not co.infer.enable_lora and NO_LORA_NOTICE in co.placement.notices
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", enable_lora=True), merged, GPU16)
    assert co.infer.enable_lora  # infer.yaml sets it: kept


def test_vllm_lora_targets_follow_the_trainers():
    """infer lora_target_modules follows train's (vLLM's LoRA layers = the trainer's targets); two different
    explicit values are refused."""
    named = TrainConfig(model="m", lora_target_modules=["q_proj", "v_proj"])
    lora = OrchConfig.model_validate({"weight_broadcast": {"reload": "lora"}})
    co = derive_colocate(named, InferConfig(model="m"), lora, GPU16)
    assert co.infer.lora_target_modules == ["q_proj", "v_proj"]
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", lora_target_modules=["o_proj"]), lora, GPU16)
    assert co.infer.lora_target_modules == ["o_proj"] and co.train.lora_target_modules == ["o_proj"]
    with pytest.raises(ConfigError, match="lora_target_modules"):
        derive_colocate(named, InferConfig(model="m", lora_target_modules=["o_proj"]), lora, GPU16)


def test_vllm_engine_stats_are_off_on_cpu_unless_the_user_keeps_them():
    from tidal.inference.backends.vllm.server import vllm_argv

    co = derive_colocate(TrainConfig(model="tidal:tiny-reverse"), InferConfig(model="tidal:tiny-reverse"),
                         OrchConfig(), CPU2)
    assert co.infer.log_stats is False and "--disable-log-stats" in vllm_argv(co.infer)
    kept = derive_colocate(TrainConfig(model="tidal:tiny-reverse"),
                           InferConfig(model="tidal:tiny-reverse", log_stats=True), OrchConfig(), CPU2)
    assert kept.infer.log_stats is True and "--disable-log-stats" not in vllm_argv(kept.infer)
    gpu = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(), GPU16)
    assert gpu.infer.log_stats is None
    assert "--disable-log-stats" not in vllm_argv(InferConfig(model="tidal:tiny-reverse"))  # grpo-infer alone


def test_in_flight_on_cpu_samples_whole_groups_one_batch_at_a_time_unless_the_user_says_otherwise():
    """Where `tidal grpo` co-locates on CPU, `in_flight_split: null` is false and `in_flight_groups: null` one batch's
    worth (n requests per group and a second batch's sequences cost the trainer's core), left to the orchestrator
    (split, two batches) on a GPU; explicit values are kept; gated untouched."""
    tiny, flight = "tidal:tiny-reverse", OrchConfig(async_mode="in_flight")
    co = derive_colocate(TrainConfig(model=tiny), InferConfig(model=tiny), flight, CPU2)
    need = flight.batch_size // flight.rollouts_per_example
    assert (co.orch.in_flight_split, co.orch.in_flight_groups) == (False, need)
    kept = derive_colocate(TrainConfig(model=tiny), InferConfig(model=tiny),
                           OrchConfig(async_mode="in_flight", in_flight_split=True, in_flight_groups=5), CPU2)
    assert (kept.orch.in_flight_split, kept.orch.in_flight_groups) == (True, 5)
    gpu = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), flight, GPU16).orch
    assert (gpu.in_flight_split, gpu.in_flight_groups) == (None, None)
    gated = derive_colocate(TrainConfig(model=tiny), InferConfig(model=tiny), OrchConfig(), CPU2).orch
    assert (gated.in_flight_split, gated.in_flight_groups) == (None, None)


def test_odd_core_count_gives_vllm_the_smaller_half():
    co = derive_colocate(*configs(max_async_level=2), Machine(cores=(0, 1, 2, 3, 4)))
    assert co.placement.vllm_cores == (0, 1) and co.train.cpu_affinity == [2, 3, 4]
    assert co.placement.infer_env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"


def test_one_core_is_not_split():
    co = derive_colocate(*configs(), Machine(cores=(3,)))
    assert co.placement.vllm_cores is None and co.train.cpu_affinity is None and not co.placement.infer_env
    assert co.orch.weight_broadcast.reload == "factors"  # still a CPU-only machine


def test_gpu_machine_leaves_cores_and_reload_alone():
    co = derive_colocate(*configs(), GPU16)
    p = co.placement
    others = tuple(n for n in p.notices if not n.startswith("GPU: base weights"))  # tests/unit/test_shared_weights.py
    assert (p.device, p.vllm_cores, p.trainer_cores, dict(p.infer_env), others) == ("cuda", None, None, {}, ())
    assert co.train.cpu_affinity is None
    assert co.orch.weight_broadcast.reload == "auto" and not co.train.broadcast_merged and not co.infer.weight_reload


def test_train_device_cuda_counts_as_a_gpu_machine():
    _, infer, orch = configs()
    co = derive_colocate(TrainConfig(model="m", device="cuda"), infer, orch, Machine(cores=tuple(range(8))))
    assert co.placement.device == "cuda" and co.placement.vllm_cores is None
    assert co.orch.weight_broadcast.reload == "auto"


def test_user_cpu_affinity_is_kept_and_vllm_left_unbound():
    _, infer, orch = configs()
    co = derive_colocate(TrainConfig(model="m", cpu_affinity=[0]), infer, orch, Machine(cores=(0, 1, 2, 3)))
    assert co.train.cpu_affinity == [0] and co.placement.trainer_cores == (0,)
    assert co.placement.vllm_cores is None and not co.placement.infer_env
    assert co.placement.notices == (ON_POLICY_NOTICE, CPU_NO_LORA_NOTICE)


def test_user_vllm_binding_in_the_environment_means_no_split():
    co = derive_colocate(*configs(), Machine(cores=(0, 1, 2, 3), env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"}))
    assert co.train.cpu_affinity is None and co.placement.vllm_cores is None
    assert not co.placement.infer_env  # the child inherits the user's own variable


def test_explicit_reload_lora_is_not_turned_into_merged_on_cpu():
    co = derive_colocate(*configs(weight_broadcast={"reload": "lora"}), CPU2)
    assert co.orch.weight_broadcast.reload == "lora" and not co.train.broadcast_merged and not co.infer.weight_reload


def test_nccl_broadcast_is_copied_to_trainer_and_inference_and_skips_merged_reloads():
    wb = {"type": "nccl", "host": "10.0.0.1", "port": 29999, "timeout": 60}
    co = derive_colocate(*configs(weight_broadcast=wb, client={"api_key_var": "MY_KEY"}, max_async_level=1), CPU2)
    t = co.train.weight_broadcast
    assert (t.type, t.host, t.port, t.timeout, t.api_key_var) == ("nccl", "10.0.0.1", 29999, 60, "MY_KEY")
    assert t.base_url == co.orch.client.base_url == ["http://127.0.0.1:8000/v1"]
    assert co.infer.weight_broadcast_type == "nccl"
    assert co.orch.weight_broadcast.reload == "auto" and not co.train.broadcast_merged
    assert co.placement.vllm_cores == (0,)  # the core split does not depend on the broadcast


def test_zmq_rollout_transport_is_copied_to_the_trainer():
    co = derive_colocate(*configs(rollout_transport={"type": "zmq", "host": "127.0.0.2", "port": 6000}), GPU16)
    assert (co.train.transport_type, co.train.transport_host, co.train.transport_port) == ("zmq", "127.0.0.2", 6000)
    plain = derive_colocate(*configs(), GPU16)
    assert plain.train.transport_type == "filesystem"


def test_one_run_directory_and_max_steps_for_both():
    co = derive_colocate(*configs(output_dir="runs/a/", max_steps=7), GPU16)
    assert co.orch.output_dir == co.train.output_dir == "runs/a" and co.placement.run_dir == Path("runs/a")
    assert co.train.max_steps == 7
    co = derive_colocate(*configs(max_steps=7), GPU16, output_dir="/tmp/x")
    assert co.orch.output_dir == co.train.output_dir == "/tmp/x"
    _, infer, orch = configs(max_steps=7)
    assert derive_colocate(TrainConfig(model="m", max_steps=3), infer, orch, GPU16).train.max_steps == 3
    assert derive_colocate(*configs(), GPU16).train.max_steps == -1


@pytest.mark.parametrize(("host", "url"), [(None, "http://127.0.0.1:8123"), ("0.0.0.0", "http://127.0.0.1:8123"),
                                           ("::", "http://127.0.0.1:8123"), ("localhost", "http://localhost:8123")])
def test_clients_reach_the_server_on_loopback_for_a_wildcard_bind(host, url):
    train, _, orch = configs()
    co = derive_colocate(train, InferConfig(model="m", host=host, port=8123), orch, GPU16)
    assert co.orch.client.base_url == [f"{url}/v1"] and co.placement.base_url == f"{url}/v1"
    assert co.placement.health_url == f"{url}/health"
    assert (co.placement.host, co.placement.port) == (host or "127.0.0.1", 8123)


def test_resume_sets_newest_checkpoint_on_both_unless_a_step_is_named():
    co = derive_colocate(*configs(), GPU16, resume=True)
    assert co.train.ckpt.resume_step == co.orch.ckpt.resume_step == -1 and co.placement.resuming
    assert not derive_colocate(*configs(), GPU16).placement.resuming
    _, infer, orch = configs(ckpt={"resume_step": 5})
    co = derive_colocate(TrainConfig(model="m", ckpt={"resume_step": 5}), infer, orch, GPU16, resume=True)
    assert co.train.ckpt.resume_step == co.orch.ckpt.resume_step == 5


def test_resume_step_on_only_one_side_is_a_config_error():
    with pytest.raises(ConfigError, match="set for only one of train.yaml and orch.yaml"):
        derive_colocate(*configs(ckpt={"resume_step": 2}), GPU16)


@pytest.mark.parametrize(("key", "value"), [("lora_rank", 8), ("lora_alpha", 8.0)])
def test_orch_lora_shape_different_from_the_trainers_is_a_config_error(key, value):
    with pytest.raises(ConfigError, match=f"orch model.{key} is {value} but train {key}"):
        derive_colocate(*configs(model={key: value}), GPU16)
    derive_colocate(*configs(model={"lora_rank": 16, "lora_alpha": 32.0}), GPU16)  # equal: accepted


def test_user_configs_are_left_untouched_and_share_nothing_with_the_result():
    train, infer, orch = configs(max_steps=7, weight_broadcast={"type": "nccl"}, rollout_transport={"type": "zmq"})
    train = train.model_copy(update={"lora_target_modules": ["q_proj"]})
    before = [c.model_dump() for c in (train, infer, orch)]
    for machine in (CPU2, Machine(cores=(0, 1, 2, 3)), GPU16):
        for resume in (False, True):
            co = derive_colocate(train, infer, orch, machine, output_dir="/tmp/elsewhere", resume=resume)
            co.orch.client.base_url.append("http://other:1/v1")  # mutating the result must not reach the input
            co.train.lora_target_modules.append("lm_head")
            co.infer.extra_args.append("--x")
            co.orch.env[0].args["x"] = 1
    co = derive_colocate(*(c.model_copy() for c in (train, infer, orch)), CPU2)  # merged reload + cores path too
    assert co.train.cpu_affinity == [0, 1] and orch.max_async_level == 1 and co.orch.max_async_level == 0
    assert [c.model_dump() for c in (train, infer, orch)] == before
    assert train.cpu_affinity is None and orch.output_dir == "outputs/run_default"


def test_wire_colocate_is_the_machine_independent_part():
    wired = wire_colocate(*configs(max_steps=7), output_dir="/tmp/w")
    co = derive_colocate(*configs(max_steps=7), GPU16, output_dir="/tmp/w")
    assert wired[1].max_lora_rank is None and co.infer.max_lora_rank == co.train.lora_rank == 16  # adapters on GPU
    assert wired[1].dtype == "auto" and co.infer.dtype == "bfloat16"  # the trainer's precision on a GPU
    graphs = ["--max-cudagraph-capture-size", "128"]  # vLLM's CUDA graphs up to the run's sequences
    wired = (wired[0], wired[1].model_copy(update={"max_lora_rank": 16, "dtype": "bfloat16", "extra_args": graphs}),
             wired[2])
    assert [c.model_dump() for c in wired] == [c.model_dump() for c in (co.train, co.infer, co.orch)]
    assert wired[0].cpu_affinity is None and wired[2].weight_broadcast.reload == "auto"  # no placement


def test_with_resume_returns_a_copy():
    orch = OrchConfig()
    resumed = with_resume(orch, True)
    assert resumed.ckpt.resume_step == -1 and orch.ckpt.resume_step is None
    same = with_resume(orch, False)
    assert same.ckpt.resume_step is None and same is not orch and same.ckpt is not orch.ckpt


def test_machine_detect_reads_cores_gpu_and_only_the_relevant_variables(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2}, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1-2")
    monkeypatch.setenv("TIDAL_UNRELATED", "x")
    m = Machine.detect()
    assert m.cores == (1, 2, 3) and dict(m.env) == {"VLLM_CPU_OMP_THREADS_BIND": "1-2"}
    assert m.has_gpu == Path("/dev/nvidiactl").exists()
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in Machine.detect().env


def test_launcher_child_gets_the_extra_environment_and_the_parent_does_not(tmp_path):
    from tidal.colocate.supervise import Child

    child = Child("x", [sys.executable, "-c", "import os; print(os.environ['TIDAL_TEST_VAR'], os.environ['PATH'])"],
                  tmp_path / "x.log", echo=False, env={"TIDAL_TEST_VAR": "bound"})
    assert child.proc.wait(timeout=30) == 0
    assert child.tail() == f"bound {os.environ['PATH']}" and "TIDAL_TEST_VAR" not in os.environ


def test_colocate_module_imports_no_torch_or_vllm():
    code = ("import sys, tidal.colocate.derive; bad = {'torch', 'vllm', 'transformers'} & set(sys.modules); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_train_sequence_len_follows_a_longer_orch_seq_len_unless_set():
    train, infer, orch = TrainConfig(model="m"), InferConfig(model="m"), OrchConfig.model_validate({"seq_len": 2048})
    assert train.sequence_len == 1024  # the defaults that used to crash the trainer mid-run
    assert derive_colocate(train, infer, orch, GPU16).train.sequence_len == 2048
    short = TrainConfig(model="m", sequence_len=512)
    with pytest.raises(ConfigError, match=r"train sequence_len \(512\).*orch seq_len \(2048\)"):
        derive_colocate(short, infer, orch, GPU16)
    longer = TrainConfig(model="m", sequence_len=4096)
    assert derive_colocate(longer, infer, orch, GPU16).train.sequence_len == 4096  # longer rows are fine
    with pytest.raises(ConfigError, match=r"infer max_model_len \(1024\).*orch seq_len \(2048\)"):
        derive_colocate(train, InferConfig(model="m", max_model_len=1024), orch, GPU16)


def test_one_checkpoint_interval_for_the_run():
    train, infer, _ = configs()
    orch = OrchConfig.model_validate({"ckpt": {"interval": 1}})
    co = derive_colocate(train, infer, orch, GPU16)
    assert co.train.ckpt.interval == 1 == co.orch.ckpt.interval and train.ckpt.interval is None
    only_train = TrainConfig(model="m", ckpt={"interval": 3})
    assert derive_colocate(only_train, infer, OrchConfig(), GPU16).orch.ckpt.interval == 3
    with pytest.raises(ConfigError, match=r"train ckpt.interval \(3\) and orch ckpt.interval \(1\)"):
        derive_colocate(only_train, infer, orch, GPU16)


def test_served_adapters_need_lora_and_a_large_enough_rank_on_vllm():
    train = TrainConfig(model="m", lora_rank=32)
    orch = OrchConfig()
    assert derive_colocate(train, InferConfig(model="m"), orch, GPU16).infer.max_lora_rank == 32
    with pytest.raises(ConfigError, match=r"infer max_lora_rank \(16\) is below train lora_rank \(32\)"):
        derive_colocate(train, InferConfig(model="m", max_lora_rank=16), orch, GPU16)
    with pytest.raises(ConfigError, match="infer enable_lora is false"):
        derive_colocate(train, InferConfig(model="m", enable_lora=False), orch, GPU16)
    # CPU co-location merges the factors in vLLM's worker: no adapter reaches vLLM, its LoRA settings do not matter
    co = derive_colocate(train, InferConfig(model="m", max_lora_rank=16), orch, CPU2)
    assert co.orch.weight_broadcast.reload == "factors" and co.infer.max_lora_rank == 16
    nccl = OrchConfig.model_validate({"weight_broadcast": {"type": "nccl"}})
    assert derive_colocate(train, InferConfig(model="m", enable_lora=False), nccl, GPU16).infer.enable_lora is False


def test_the_three_files_must_name_one_model():
    orch = OrchConfig()
    assert orch.model.name is None
    co = derive_colocate(TrainConfig(model="a"), InferConfig(model="a"), orch, GPU16)
    assert co.orch.model.name == "a"  # unset: the name vLLM serves the model under
    with pytest.raises(ConfigError, match=r"train model \(b\) and infer model \(a\) differ.*--model"):
        derive_colocate(TrainConfig(model="b"), InferConfig(model="a"), orch, GPU16)
    named = OrchConfig.model_validate({"model": {"name": "tidal:tiny-reverse"}})
    with pytest.raises(ConfigError, match=r"orch model.name \(tidal:tiny-reverse\) differs from infer model \(a\)"):
        derive_colocate(TrainConfig(model="a"), InferConfig(model="a"), named, GPU16)


def test_one_model_flag_sets_all_three_files(tmp_path):
    """`tidal grpo --model X` with the bundled example: every component gets X (here a copy of the bundled
    model in a local directory)."""
    import shutil

    from tidal.models.sources import resolve_model

    model = tmp_path / "my-model"
    shutil.copytree(resolve_model("tidal:tiny-reverse"), model)
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--model", str(model),
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"model: {model}") == 2 and f"name: {model}" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--train.model", str(model)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "train model" in r.stderr and "--model" in r.stderr


@pytest.mark.parametrize("machine", [CPU2, GPU16])
def test_explicit_reload_merged_gets_merged_files_and_a_reloadable_vllm(machine):
    co = derive_colocate(*configs(weight_broadcast={"reload": "merged"}), machine)
    assert co.orch.weight_broadcast.reload == "merged" and co.train.broadcast_merged and co.infer.weight_reload


def test_cpu_default_is_on_policy_with_every_core_for_each_phase():
    """The phases take turns (max_async_level 0): a split would leave one core idle in each phase."""
    for cores in ((0, 1), (0, 1, 2, 3)):
        co = derive_colocate(*configs(), Machine(cores=cores))
        p = co.placement
        assert (co.orch.max_async_level, co.train.max_async_level) == (0, 0)
        assert p.vllm_cores == p.trainer_cores == cores and co.train.cpu_affinity == list(cores)
        assert dict(p.infer_env) == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
        assert p.notices[0] == ON_POLICY_NOTICE and "never at once" in p.notices[-1]


def test_user_lag_or_in_flight_keeps_overlap_and_the_split_and_gpu_keeps_lag_1():
    for orch in ({"max_async_level": 1}, {"max_async_level": 2}, {"async_mode": "in_flight"}):
        co = derive_colocate(*configs(**orch), CPU2)
        assert co.orch.max_async_level == orch.get("max_async_level", 1)
        assert ON_POLICY_NOTICE not in co.placement.notices
        assert (co.placement.vllm_cores, co.placement.trainer_cores) == ((0,), (1,))
    explicit = derive_colocate(*configs(max_async_level=0), CPU2)  # set by the user: the same time-sharing
    assert explicit.placement.vllm_cores == explicit.placement.trainer_cores == (0, 1)
    assert ON_POLICY_NOTICE not in explicit.placement.notices
    gpu = derive_colocate(*configs(), GPU16)
    assert gpu.orch.max_async_level == 1 and gpu.placement.vllm_cores is None
