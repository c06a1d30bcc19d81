"""The warm pool (`tidal serve`): one vLLM server kept loaded between `tidal grpo` runs of the same base model on
this machine, so that the next run's first step needs no vLLM start-up (20-70 s on a 2-core CPU, bench/STARTUP.md).

- `serve(co)` is the `tidal serve` process: it derives the infer config exactly as `tidal grpo` would for the same
  three files on this machine (`tidal.colocate.start.derive`: model, dtype, max_model_len, enable_lora, weight_reload,
  core binding), starts `tidal grpo-infer` on it as a `tidal.procs.Child` (its own process group; a reaper kills vLLM's
  engine processes if `tidal serve` is killed outright), scores a fixed probe (`tidal.transport.probe.probe_ids`)
  through the fresh server (the base model: a just-started vLLM can serve nothing else), and writes the pool's
  state (`PoolState`, `<tidal cache>/pool/state.json`, temp + rename) once it answers. It runs in the foreground until
  SIGTERM / Ctrl-C (`tidal serve --stop` sends it) and then stops vLLM's whole group and removes the state. The pool is
  not a child of any run: killing a run never touches it, and only its own stop command ends it.
- `attach(co)` is `tidal grpo`'s side (`tidal.colocate.start.start`): with a pool running, the run's derived infer
  config and vLLM environment must equal the pool's, key for key (`differences`; another base model is refused with
  both names, any other key with both values: exit 2, never a run on the wrong server). Then it takes the attach lock
  (`attach.lock`, an flock held for the whole run and released by the kernel however the run ends: one run at a time),
  resets the server to the base weights (`reset`: unload every LoRA adapter; with `weight_reload`, reload the base
  checkpoint in place, which also drops the prefix cache) and checks that it serves the base: the probe scored again
  must match the fresh server's within the float tolerance of `tidal.orchestrator.identity.check_served` (the policy
  identity check's function; `PolicyMismatch` -> exit 4; orch `weight_broadcast.policy_check: false` skips it). The
  run then starts its orchestrator and trainer at once and watches the pool's server like its own (a pool that dies
  ends the run; it is not restarted by the run).

On a CPU placement the pool also keeps the trainer's base model loaded (`tidal.colocate.warm_trainer`, started
here beside vLLM; `tidal serve --no-trainer` keeps vLLM only): an attached run's trainer is forked from it, after
`trainer_differences` found nothing that differs (the train keys that decide the base, one rank, the same tidal
checkout). Refused in a pool: SGLang, the nccl weight push, shared base weights (the trainer would hold tensors of a
server it does not own).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from tidal import procs
from tidal.colocate.derive import Colocated
from tidal.config import ConfigError
from tidal.models.sources.gguf import cache_root
from tidal.paths import write_atomic
from tidal.procs.reaper import group_alive, pid_alive, start_reaper, wait_group_gone

STATE_FILE = "state.json"
LOCK_FILE = "attach.lock"
LOG_FILE = "infer.log"
STOP_WAIT_S = procs.STOP_TIMEOUT_S + 15.0
"""How long `tidal serve --stop` waits for the pool to stop vLLM and exit before it kills what is left."""


def pool_dir() -> Path:
    """Where the pool keeps its state, lock, config and vLLM's log: `<tidal cache>/pool` (TIDAL_CACHE moves it)."""
    return cache_root() / "pool"


@dataclass
class PoolState:
    """What a running pool serves (`state.json`), written once its server answers."""

    pid: int
    """The `tidal serve` process (SIGTERM stops the pool)."""
    infer_pid: int
    """Its `tidal grpo-infer` child: vLLM's API server, leader of the process group vLLM's engine runs in."""
    model: str
    """The base model served (infer `model`)."""
    infer: dict[str, Any]
    """The derived infer config the server was started with (JSON)."""
    infer_env: dict[str, str]
    """The variables tidal added to its environment (the placement's core binding)."""
    health_urls: list[str]
    base_urls: list[str]
    base_dir: str
    """The base checkpoint's directory (`resolve_model`), reloaded by `reset`."""
    probe_ids: list[int]
    probe_base: list[float]
    """The fresh server's untempered logprobs of `probe_ids` (the base model as this server computes it)."""
    dtype: str
    """The dtype vLLM serves in (the identity check's tolerance)."""
    ready_s: float
    """Seconds from the pool's start until its server answered."""
    trainer: dict[str, Any] | None = None
    """The kept trainer (`tidal.colocate.warm_trainer`'s `trainer.json`: pid, socket, the train keys its base was
    loaded for, the base's SHA-256); None when the pool keeps none (`trainer_off` says why)."""
    trainer_off: str | None = None
    """Why the pool keeps no trainer (a GPU: a CUDA process cannot fork)."""
    code: str = ""
    """The tidal package the pool runs (a run of another checkout is refused: the kept trainer runs the pool's code)."""

    def write(self, directory: Path) -> None:
        write_atomic(directory / STATE_FILE, json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, directory: Path) -> PoolState | None:
        """The state of a pool whose `tidal serve` process is alive; None when there is none (no file, or a
        pool killed outright: its file is stale)."""
        try:
            state = cls(**json.loads((directory / STATE_FILE).read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return None
        return state if pid_alive(state.pid) else None


def refusal(co: Colocated) -> str | None:
    """Why the pool cannot serve runs of `co` (module docs), or None."""
    if co.infer.backend != "vllm":
        return f"infer backend {co.infer.backend}: the warm pool keeps vLLM only; set infer backend: vllm"
    if co.infer.weight_broadcast_type == "nccl":
        return ("orch weight_broadcast.type nccl: the warm pool cannot yet reset a pushed server to the base "
                "weights; use weight_broadcast.type: filesystem")
    if co.infer.export_base_weights:
        return "train share_base_weights: the trainer would hold the pool's tensors; set train share_base_weights false"
    return None


def differences(state: PoolState, co: Colocated) -> list[str]:
    """Each key where this run's derived server differs from the pool's (`infer KEY: pool X, run Y`)."""
    run = co.infer.model_dump(mode="json")
    out = [f"infer {k}: pool {state.infer.get(k)!r}, this run {run.get(k)!r}"
           for k in sorted(set(run) | set(state.infer)) if run.get(k) != state.infer.get(k)]
    env = dict(co.placement.infer_env)
    out += [f"vLLM environment {k}: pool {state.infer_env.get(k)!r}, this run {env.get(k)!r}"
            for k in sorted(set(env) | set(state.infer_env)) if env.get(k) != state.infer_env.get(k)]
    return out


def tidal_code() -> str:
    """The directory of the tidal package this process runs."""
    return str(Path(__file__).resolve().parents[1])


def trainer_differences(state: PoolState, co: Colocated) -> list[str]:
    """Each reason the pool's kept trainer cannot train this run (`train KEY: pool X, run Y`, the base's keys
    `tidal.config.train.BASE_MODEL_KEYS`; several trainer ranks; another tidal checkout); [] without a kept trainer."""
    if state.trainer is None:
        return []
    from tidal.config.train import base_model_key

    kept, run = state.trainer.get("key", {}), base_model_key(co.train)
    out = [f"train {k}: pool {kept.get(k)!r}, this run {run.get(k)!r}" for k in run if kept.get(k) != run.get(k)]
    if co.train.gpus > 1:
        out.append(f"train gpus: the pool's kept trainer is one process, this run asks for {co.train.gpus}")
    if state.code != tidal_code():
        out.append(f"tidal code: the pool runs {state.code or 'an older tidal'}, this run {tidal_code()}")
    return out


def check_matches(state: PoolState, co: Colocated) -> None:
    """`ConfigError` (exit 2) unless the pool serves exactly what this run would start (module docs)."""
    where = f"the warm pool (`tidal serve`, pid {state.pid}, {pool_dir() / STATE_FILE})"
    stop = "stop it (`tidal serve --stop`)"
    if state.model != co.infer.model:
        raise ConfigError(f"{where} serves model {state.model}, but this run trains {co.infer.model}: a run never "
                          f"samples from another base model; {stop}, or start the pool for {co.infer.model} "
                          f"(`tidal serve --model {co.infer.model}`)")
    if (why := refusal(co)) is not None:
        raise ConfigError(f"{where} is running, but this run cannot use it: {why}; or {stop}")
    diff = differences(state, co)
    if diff:
        raise ConfigError(f"{where} serves {state.model} with other settings than this run derives: "
                          f"{'; '.join(diff)}; start the pool with the run's config files and overrides, or {stop}")
    diff = trainer_differences(state, co)
    if diff:
        raise ConfigError(f"{where} keeps the trainer's base model loaded for other settings than this run's: "
                          f"{'; '.join(diff)}; start the pool with the run's config files and overrides, or {stop}")


class PoolError(RuntimeError):
    """The pool's server did not take its reset (it does not answer, or refused a request): the run stops (exit 1)."""


class Attached:
    """A run attached to the pool: holds the attach lock until `release` (or the process's end)."""

    def __init__(self, state: PoolState, lock: IO[str]) -> None:
        self.state, self._lock = state, lock
        self.log_path = pool_dir() / LOG_FILE

    def release(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()


def take_lock(directory: Path) -> IO[str]:
    """The attach lock, or `ConfigError` naming the run that holds it."""
    lock = (directory / LOCK_FILE).open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(f"another run (pid {holder}) is attached to the warm pool ({directory}); one run at a "
                          f"time: wait for it to end") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def attach(co: Colocated) -> Attached | None:
    """Attach this run to a running pool (module docs): None when no pool runs; `ConfigError` when it does not
    match or another run holds it; `PolicyMismatch` when the reset did not bring back the base model."""
    directory = pool_dir()
    state = PoolState.read(directory)
    if state is None:
        return None
    check_matches(state, co)
    lock = take_lock(directory)
    from tidal.inference.protocol import InferenceError

    try:
        t0 = time.monotonic()
        asyncio.run(reset(state, co))
    except InferenceError as exc:
        lock.close()
        raise PoolError(f"the warm pool's vLLM at {state.base_urls[0]} (pid {state.infer_pid}) did not take its reset "
                        f"to the base weights: {exc}; its log: {directory / LOG_FILE}; stop it (`tidal serve "
                        f"--stop`) and start it again, or run without it") from None
    except BaseException:
        lock.close()
        raise
    print(f"[tidal] attached to the warm pool (tidal serve, pid {state.pid}): vLLM for {state.model} at "
          f"{state.base_urls[0]}, reset to the base weights in {time.monotonic() - t0:.1f} s (log: "
          f"{directory / LOG_FILE})", flush=True)
    return Attached(state, lock)


async def reset(state: PoolState, co: Colocated) -> None:
    """Bring the pool's server(s) back to the base model: unload every adapter, reload the base checkpoint in place
    (with `weight_reload`: a merged policy of the last run is in the weights), then check the probe."""
    import httpx

    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.inference.protocol import InferenceError, server_root
    from tidal.orchestrator.identity import check_served
    from tidal.transport.probe import ProbeRecord

    client = VllmClient(co.orch.client.model_copy(update={"base_url": list(state.base_urls)}))
    try:
        if co.infer.enable_lora:
            for url in client.urls:
                try:
                    served = (await client.http.get(f"{url}/models", timeout=30.0)).json().get("data", [])
                except (httpx.HTTPError, ValueError) as exc:
                    raise InferenceError(f"GET {url}/models failed: {exc!r}") from exc
                for name in [m["id"] for m in served if m["id"] != state.model]:
                    await client._post(f"{server_root(url)}/v1/unload_lora_adapter", {"lora_name": name})
        if co.infer.weight_reload:
            await client.reload_weights(state.base_dir)  # and drops the prefix cache
        if co.orch.weight_broadcast.policy_check:
            base = ProbeRecord(step=0, ids=state.probe_ids, new=state.probe_base, dtype=state.dtype,
                               base=state.probe_base)
            await check_served(lambda ids: client.prompt_logprobs(state.model, ids), base, what="the warm pool",
                               path=state.base_dir, off="orch weight_broadcast.policy_check: false",
                               times=len(client.urls))
    finally:
        await client.close()


async def score_probe(co: Colocated) -> tuple[list[int], list[float]]:
    """The probe's ids (`probe_ids` over the tokenizer's and the model's vocabulary) and the fresh server's
    logprobs of them."""
    from transformers import AutoTokenizer

    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.models.config import model_config, text_config
    from tidal.models.sources import resolve_model
    from tidal.transport.probe import probe_ids, probe_length

    path = resolve_model(co.infer.model)
    rows = int(text_config(model_config(co.infer.model)).get("vocab_size") or 0)
    tokens = len(AutoTokenizer.from_pretrained(path, trust_remote_code=co.infer.trust_remote_code))
    ids = probe_ids(min(n for n in (rows, tokens) if n), probe_length(co.infer.max_model_len))
    client = VllmClient(co.orch.client)
    try:
        return ids, await client.prompt_logprobs(co.infer.model, ids)
    finally:
        await client.close()


def check_servable(co: Colocated, directory: Path) -> None:
    """`ConfigError` unless a pool for `co` can start here: none runs already, nothing in `co` is refused in a pool,
    and vLLM's bind and ports pass `tidal grpo`'s checks (`tidal.colocate.start.check_startable`)."""
    from tidal.inference.backends.bind import InsecureBindError, check_bind_secure

    running = PoolState.read(directory)
    if running is not None:
        raise ConfigError(f"a warm pool already runs (pid {running.pid}, model {running.model}); stop it first "
                          f"(`tidal serve --stop`)")
    if (why := refusal(co)) is not None:
        raise ConfigError(why)
    try:
        check_bind_secure(co.infer)
        for port in range(co.placement.port, co.placement.port + co.infer.dp):
            procs.check_port_free(co.placement.host, port)
    except (procs.PortInUseError, InsecureBindError) as exc:
        raise ConfigError(str(exc)) from None


def start_kept_trainer(co: Colocated, directory: Path, keep: bool = True) -> tuple[procs.Child | None, str | None]:
    """The pool's kept trainer (`tidal.colocate.warm_trainer`) started on `directory/train.yaml`, or None and why
    the pool keeps none (`tidal serve --no-trainer`: `keep` False; a GPU placement; several trainer ranks)."""
    from tidal.colocate.warm_trainer import LOG_FILE as TRAINER_LOG
    from tidal.colocate.warm_trainer import STATE_FILE as TRAINER_STATE

    if not keep:
        return None, "started with --no-trainer: vLLM only"
    if co.placement.device != "cpu":
        return None, f"placement {co.placement.device}: a process holding CUDA cannot fork"
    if co.train.gpus > 1:
        return None, f"train gpus {co.train.gpus}: the kept trainer is one process"
    (directory / TRAINER_STATE).unlink(missing_ok=True)
    child = procs.Child("trainer", [sys.executable, "-m", "tidal.colocate.warm_trainer", str(directory / "train.yaml"),
                                    str(directory)], log_path=directory / TRAINER_LOG)
    print(f"[tidal] warm pool: loading the trainer's base model to keep (log: {directory / TRAINER_LOG})", flush=True)
    return child, None


def wait_kept_trainer(child: procs.Child, directory: Path, timeout_s: float) -> dict[str, Any]:
    """The kept trainer's `trainer.json` once it listens; `procs.NotHealthy` when it exits or time runs out."""
    from tidal.colocate.warm_trainer import STATE_FILE as TRAINER_STATE

    path, start = directory / TRAINER_STATE, time.monotonic()
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            state: dict[str, Any] = json.loads(path.read_text())
            if state.get("pid") == child.pid:
                return state
        if child.poll() is not None or time.monotonic() - start > timeout_s:
            raise procs.NotHealthy([str(path)], time.monotonic() - start, child.poll(), child.tail(5))
        time.sleep(0.2)


def _raise_on_term(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(co: Colocated, start_timeout_s: float = 600.0, keep_trainer: bool = True) -> int:
    """`tidal serve`: start the pool's server for `co` (and, with `keep_trainer`, its kept trainer) and keep them
    until SIGTERM / Ctrl-C (module docs); returns the exit code (0 stopped, 1 one of them died)."""
    import yaml

    from tidal.inference.precision import trainer_dtype
    from tidal.models.sources import resolve_model

    directory = pool_dir()
    check_servable(co, directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STATE_FILE).unlink(missing_ok=True)  # a stale one (a pool killed outright)
    write_atomic(directory / "infer.yaml", yaml.safe_dump(co.infer.model_dump(mode="json"), sort_keys=False))
    write_atomic(directory / "train.yaml", yaml.safe_dump(co.train.model_dump(mode="json"), sort_keys=False))
    if os.getpgrp() != os.getpid():  # its own process group (started with `&` from a script: not the script's)
        with contextlib.suppress(OSError):
            os.setsid()
    start_reaper()  # `tidal serve` killed outright: vLLM's engine processes go too
    previous = {sig: signal.signal(sig, _raise_on_term) for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    child = procs.Child("infer", [sys.executable, "-m", "tidal.cli", "grpo-infer", str(directory / "infer.yaml")],
                        log_path=directory / LOG_FILE, env=co.placement.infer_env)
    print(f"[tidal] warm pool: starting vLLM for {co.infer.model} (log: {directory / LOG_FILE})", flush=True)
    kept, kept_off = start_kept_trainer(co, directory, keep_trainer)
    children = [child, *([kept] if kept is not None else [])]
    try:
        procs.wait_healthy(list(co.placement.health_urls), child, start_timeout_s)
        trainer = wait_kept_trainer(kept, directory, start_timeout_s) if kept is not None else None
        ids, lps = asyncio.run(score_probe(co))
        dtype = co.infer.dtype if co.infer.dtype != "auto" else trainer_dtype("auto", co.placement.device)
        PoolState(pid=os.getpid(), infer_pid=child.proc.pid, model=co.infer.model,
                  infer=co.infer.model_dump(mode="json"), infer_env=dict(co.placement.infer_env),
                  health_urls=list(co.placement.health_urls), base_urls=list(co.placement.base_urls),
                  base_dir=resolve_model(co.infer.model), probe_ids=ids, probe_base=lps, dtype=dtype,
                  ready_s=time.monotonic() - t0, trainer=trainer, trainer_off=kept_off,
                  code=tidal_code()).write(directory)
        kept_line = "and the trainer's base model kept loaded" if trainer else f"no trainer kept ({kept_off})"
        print(f"[tidal] warm pool ready after {time.monotonic() - t0:.1f} s: vLLM serves {co.infer.model} at "
              f"{co.placement.base_url}, {kept_line}; `tidal grpo` runs of this model attach to it; stop: tidal "
              f"serve --stop", flush=True)
        while (dead := next((c for c in children if c.poll() is not None), None)) is None:
            time.sleep(0.5)
        print(f"[tidal] warm pool: {dead.name} exited with code {dead.poll()}; last lines of {dead.log_path}:\n"
              f"{dead.tail(15)}", file=sys.stderr, flush=True)
        return 1
    except procs.NotHealthy as exc:
        dead = next((c for c in children if c.poll() is not None), child)
        print(f"[tidal] warm pool: {dead.name} did not start ({exc}); last lines of {dead.log_path}:\n"
              f"{dead.tail(15)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("[tidal] warm pool: stopping vLLM", flush=True)
        return 0
    finally:
        state = PoolState.read(directory)
        if state is not None and state.pid == os.getpid():
            (directory / STATE_FILE).unlink(missing_ok=True)
        procs.stop(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop() -> int:
    """`tidal serve --stop`: SIGTERM the pool, wait until it and vLLM's whole group are gone (SIGKILL what is left
    after `STOP_WAIT_S`); 0 when nothing of it runs any more (also when none was running), 1 otherwise."""
    state = PoolState.read(pool_dir())
    if state is None:
        print("[tidal] no warm pool is running", flush=True)
        return 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while pid_alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(state.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGKILL)  # its reaper then ends what it started
    groups = [state.infer_pid, *([int(state.trainer["pid"])] if state.trainer else [])]
    for group in groups:  # vLLM's own group (the API server leads it); the kept trainer's (its forks run in it)
        if group_alive(group):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
    gone = all(wait_group_gone(group, 10.0) for group in groups) and not pid_alive(state.pid)
    (pool_dir() / STATE_FILE).unlink(missing_ok=True)
    print(f"[tidal] warm pool (pid {state.pid}, {state.model}) {'stopped' if gone else 'NOT fully stopped'}",
          flush=True)
    return 0 if gone else 1


def status() -> int:
    """`tidal serve --status`: the running pool's state as JSON (exit 0), or a line saying none runs (exit 1)."""
    state = PoolState.read(pool_dir())
    if state is None:
        print("[tidal] no warm pool is running", flush=True)
        return 1
    view = {k: v for k, v in asdict(state).items() if k not in ("probe_ids", "probe_base")}
    if state.trainer is not None:  # its current record (forks, checks of the kept base)
        with contextlib.suppress(OSError, ValueError):
            view["trainer"] = json.loads(Path(state.trainer["socket"]).with_name("trainer.json").read_text())
    print(json.dumps(view, indent=1), flush=True)
    return 0
