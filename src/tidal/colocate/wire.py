"""Co-locate wiring (`tidal grpo`): the three user configs connected to each other, machine-independent (what
`tidal grpo --dry-run` prints before the placement; `tidal.colocate.derive` places the result on the machine).

`wire_colocate(train, infer, orch)` returns NEW configs (the user's are never modified):
`--resume` sets `ckpt.resume_step: -1` (it must end up set for both train and orch, or neither); orch
`model.lora_rank` / `model.lora_alpha`, when set, must equal train's; one run directory (`--output-dir`, else orch
`output_dir`) for both; train `max_steps: -1` takes orch `max_steps` (so LR schedules know the run's length); orch
`client.base_url` lists the inference servers (infer `dp` of them, ports `port`, `port + 1`, ...: `client_urls`);
orch `rollout_transport: zmq` sets the trainer's `transport_*`; orch `weight_broadcast: nccl` sets train
`weight_broadcast` and infer `weight_broadcast_type`; the lengths agree (train `sequence_len` unset follows orch
`seq_len`; a shorter explicit one, or an infer `max_model_len` below `seq_len`, is refused); one checkpoint interval
(a component without `ckpt.interval` follows the other's; two different ones are refused); one model (train
`model` = infer `model`, orch `model.name` unset follows it; `tidal grpo --model X` sets all three); one way to
build it (`rope_scaling`, `trust_remote_code`, `lora_target_modules`, `chat_template`: a file that does not set one
follows the other's; two different values are refused). Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig, TrainWeightBroadcast

C = TypeVar("C", TrainConfig, OrchConfig)


def with_resume(cfg: C, resume: bool) -> C:
    """A copy of `cfg` with `--resume` applied: `ckpt.resume_step: -1` unless the config names a step."""
    if not resume or cfg.ckpt.resume_step is not None:
        return cfg.model_copy(deep=True)
    return cfg.model_copy(deep=True, update={"ckpt": cfg.ckpt.model_copy(update={"resume_step": -1})})


def check_consistent(train: TrainConfig, orch: OrchConfig) -> None:
    """Raise `ConfigError` when train and orch disagree on resuming or on the LoRA shape."""
    if (train.ckpt.resume_step is None) != (orch.ckpt.resume_step is None):
        raise ConfigError("ckpt.resume_step is set for only one of train.yaml and orch.yaml; resume both "
                          "(--resume) or neither")
    for key in ("lora_rank", "lora_alpha"):
        want, have = getattr(orch.model, key), getattr(train, key)
        if want is not None and float(want) != float(have):
            raise ConfigError(f"orch model.{key} is {want} but train {key} is {have}; set them equal (or drop "
                              f"model.{key} from orch.yaml)")


def couple_lengths(train: TrainConfig, infer: InferConfig, orch: OrchConfig) -> dict[str, Any]:
    """Train updates that make the sequence lengths agree: the trainer packs rows of `sequence_len` tokens and
    must fit every sample of `seq_len` tokens (unset: it follows orch `seq_len`); vLLM's `max_model_len`, when
    set, must hold `seq_len` too. Raises `ConfigError` naming both keys when explicit values cannot work."""
    t: dict[str, Any] = {}
    if orch.seq_len > train.sequence_len:
        if "sequence_len" in train.model_fields_set:
            raise ConfigError(f"train sequence_len ({train.sequence_len}) is shorter than orch seq_len "
                              f"({orch.seq_len}): the trainer could not pack the longest samples; raise train "
                              f"sequence_len to at least {orch.seq_len} or lower orch seq_len")
        t["sequence_len"] = orch.seq_len
    if infer.max_model_len is not None and infer.max_model_len < orch.seq_len:
        raise ConfigError(f"infer max_model_len ({infer.max_model_len}) is shorter than orch seq_len "
                          f"({orch.seq_len}): vLLM would refuse the longest requests; raise infer max_model_len or "
                          f"lower orch seq_len")
    return t


def couple_models(train: TrainConfig, infer: InferConfig, orch: OrchConfig) -> dict[str, Any]:
    """Orch updates that make the three files name one model: the trainer trains what vLLM serves, and orch
    `model.name` (unset: infer `model`) is the name vLLM serves it under. `--model X` sets all three."""
    if train.model != infer.model:
        raise ConfigError(f"train model ({train.model}) and infer model ({infer.model}) differ: the trainer must "
                          f"train the model vLLM serves; set both, or pass --model once for all three files")
    if orch.model.name is None:
        return {"model": orch.model.model_copy(update={"name": infer.model})}
    if orch.model.name != infer.model:
        raise ConfigError(f"orch model.name ({orch.model.name}) differs from infer model ({infer.model}), the name "
                          f"vLLM serves it under; set it to the same value, or pass --model once for all three files")
    return {}


def couple_checkpoints(train: TrainConfig, orch: OrchConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(train, orch) updates that give the run one checkpoint interval: a component without `ckpt.interval`
    follows the other's (so `--resume` finds both checkpoints); two different explicit intervals are refused."""
    ti, oi = train.ckpt.interval, orch.ckpt.interval
    if ti == oi:
        return {}, {}
    if ti is not None and oi is not None:
        raise ConfigError(f"train ckpt.interval ({ti}) and orch ckpt.interval ({oi}) differ: a resumed run needs "
                          f"both checkpoints of the same step; give both the same value (e.g. --train.ckpt.interval "
                          f"{oi} --orch.ckpt.interval {oi}), or set it in one file only")
    if ti is None:
        return {"ckpt": train.ckpt.model_copy(update={"interval": oi})}, {}
    return {}, {"ckpt": orch.ckpt.model_copy(update={"interval": ti})}


MODEL_BUILD_KEYS = ("trust_remote_code", "rope_scaling", "lora_target_modules", "chat_template")
"""Keys both train.yaml and infer.yaml have that decide how the model is built (and which modules carry LoRA
layers: vLLM's must be the trainer's adapter targets; which chat template renders prompts: vLLM's for the rollouts,
the trainer's for SFT and the exports); they must agree."""


def couple_model_code(train: TrainConfig, infer: InferConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(train, infer) updates that build the model the same way on both sides (`MODEL_BUILD_KEYS`): the trainer
    follows infer's value when train.yaml does not set the key (and infer follows train's when only train.yaml
    sets it), so its logprobs are those of the model vLLM serves; two different explicit values are refused."""
    t: dict[str, Any] = {}
    i: dict[str, Any] = {}
    for key in MODEL_BUILD_KEYS:
        tv, iv = getattr(train, key), getattr(infer, key)
        if tv == iv:
            continue
        if key in train.model_fields_set and key in infer.model_fields_set:
            raise ConfigError(f"train {key} ({tv}) and infer {key} ({iv}) differ: the trainer must build the model "
                              f"vLLM serves (and vLLM the trainer's LoRA targets); give both the same value, or set "
                              f"it in one file only")
        if key in train.model_fields_set:
            i[key] = tv
        else:
            t[key] = iv
    return t, i


def client_url(infer: InferConfig, index: int = 0) -> str:
    """The URL clients on this machine reach inference server `index` at (loopback for a wildcard bind)."""
    host = infer.host or "127.0.0.1"
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{infer.port + index}/v1"


def client_urls(infer: InferConfig) -> list[str]:
    """The URLs of all infer `dp` servers (ports `port`, `port + 1`, ...), as orch `client.base_url`."""
    return [client_url(infer, i) for i in range(infer.dp)]


def wire_colocate(train: TrainConfig, infer: InferConfig, orch: OrchConfig, output_dir: str | Path | None = None,
                  resume: bool = False) -> tuple[TrainConfig, InferConfig, OrchConfig]:
    """New train, infer and orch configs connected to each other (the machine-independent derivations)."""
    train, orch = with_resume(train, resume), with_resume(orch, resume)
    check_consistent(train, orch)
    run_dir = str(Path(output_dir or orch.output_dir))
    client = orch.client.model_copy(update={"base_url": client_urls(infer), "backend": infer.backend})
    orch = orch.model_copy(update={"output_dir": run_dir, "client": client})
    t: dict[str, Any] = {"output_dir": run_dir, **couple_lengths(train, infer, orch)}
    i: dict[str, Any] = {}
    t_ckpt, o_ckpt = couple_checkpoints(train, orch)
    t |= t_ckpt
    t_code, i_code = couple_model_code(train, infer)
    t, i = t | t_code, i | i_code
    orch = orch.model_copy(update=o_ckpt | couple_models(train, infer, orch))
    if train.max_steps == -1 and orch.max_steps:
        t["max_steps"] = orch.max_steps  # lets linear/cosine LR schedules know the run's length
    if orch.rollout_transport.type == "zmq":  # the trainer asks the orchestrator's batch server
        rt = orch.rollout_transport
        t.update(transport_type="zmq", transport_host=rt.host, transport_port=rt.port)
    if orch.weight_broadcast.type == "nccl":  # the trainer pushes into this server
        wb = orch.weight_broadcast
        t["weight_broadcast"] = TrainWeightBroadcast(type="nccl", host=wb.host, port=wb.port, timeout=wb.timeout,
                                                     base_url=list(client.base_url), api_key_var=client.api_key_var,
                                                     backend=infer.backend)
        i["weight_broadcast_type"] = "nccl"
    return train.model_copy(update=t), infer.model_copy(deep=True, update=i), orch


def point_at_servers(train: TrainConfig, infer: InferConfig, orch: OrchConfig) -> tuple[TrainConfig, OrchConfig]:
    """(train, orch) whose server lists (orch `client.base_url`, train nccl `weight_broadcast.base_url`) name all
    of `infer`'s dp servers (after the placement changed dp)."""
    urls = client_urls(infer)
    orch = orch.model_copy(update={"client": orch.client.model_copy(update={"base_url": urls})})
    if train.weight_broadcast.type == "nccl":
        train = train.model_copy(update={"weight_broadcast": train.weight_broadcast.model_copy(
            update={"base_url": list(urls)})})
    return train, orch
