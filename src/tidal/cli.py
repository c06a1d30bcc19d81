"""Command line: `tidal grpo | grpo-infer | grpo-orch | grpo-train | sft | eval | export` (and `serve`: the warm pool,
docs/warm-pool.md; `serve-tinker`:
docs/tinker.md; `eval`: `tidal.evaluate`, docs/evaluation.md; `export`: a run's model as GGUF,
`tidal.trainer.publish.export_cmd`).

Arguments are parsed and configs validated before torch or vLLM is imported, so config mistakes fail fast
(exit code 2, with a message naming the file and key). Dotted overrides follow the config files:
`--orch.batch_size 32`, `--train.loss.kl_tau 0.1`, `--infer.port 8001` (and `--sft.X` for `tidal sft`).
Without a config file a component uses the bundled reverse-text example.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from tidal.colocate import start
from tidal.colocate.start import dump
from tidal.colocate.wire import with_resume
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig, load_config
from tidal.config.base import StrictModel
from tidal.models.arch import check_model
from tidal.models.sources import resolve_model
from tidal.paths import find_run_dir, metrics_path, rollouts_dir, sft_dir, step_files

COMPONENTS: dict[str, type[StrictModel]] = {"train": TrainConfig, "infer": InferConfig, "orch": OrchConfig}


def example_path(component: str) -> Path:
    return Path(str(resources.files("tidal") / "examples" / "reverse_text" / f"{component}.yaml"))


def extract_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate dotted overrides (`--a.b V` / `--a.b=V`) from the rest of argv, before argparse sees them."""
    rest: list[str] = []
    extra: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            extra.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                extra.append(argv[i + 1])
                i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, extra


def split_overrides(extra: list[str], allowed: set[str]) -> dict[str, dict[str, str]]:
    """`['--orch.batch_size', '32', '--train.lr=1']` -> {'orch': {'batch_size': '32'}, 'train': {'lr': '1'}}."""
    out: dict[str, dict[str, str]] = {}
    if extra and not allowed:
        raise ConfigError(f"unexpected argument '{extra[0]}'")
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}' (overrides look like --{sorted(allowed)[0]}.KEY VALUE)")
        key, _, value = arg[2:].partition("=")
        if not _:
            if i + 1 >= len(extra):
                raise ConfigError(f"override {arg} needs a value")
            value = extra[i + 1]
            i += 1
        prefix, dotted = key.split(".", 1)
        if prefix == "sft" and "train" in allowed:
            prefix, dotted = "train", f"sft.{dotted}"
        if prefix not in allowed:
            raise ConfigError(f"override --{key}: this command takes overrides for {', '.join(sorted(allowed))}")
        out.setdefault(prefix, {})[dotted] = value
        i += 1
    return out


def load(component: str, path: str | None, overrides: dict[str, dict[str, str]]) -> Any:
    file = Path(path) if path else example_path(component)
    cfg = load_config(COMPONENTS[component], file, overrides.get(component))
    if isinstance(cfg, TrainConfig | InferConfig):
        check_model(cfg.model, str(file))
    return cfg


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def resume_hint(argv: list[str]) -> str:
    """The command line that resumes this run."""
    return "tidal " + " ".join([*argv, *([] if "--resume" in argv else ["--resume"])])


def print_family_row(model: str) -> None:
    """`--dry-run`: the model family's row of the matrix (`tidal.models.families`, docs/models.md), as comments."""
    from tidal.models.config import model_config
    from tidal.models.families import describe

    config = model_config(model, missing_ok=True)
    if config:
        print("\n".join(f"# {line}" for line in describe(config).splitlines()))


def cmd_grpo(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    train, infer, orch = (load(c, getattr(args, c), ov) for c in ("train", "infer", "orch"))
    # the GPU split's calibration (one training step on the GPU) only when the run really starts
    co = start.derive(train, infer, orch, output_dir=args.output_dir, resume=args.resume, calibrate=not args.dry_run)
    from tidal.colocate.preflight import check_run

    check_run(co.train, co.infer, co.orch)  # every refusal of grpo-train / grpo-orch, before anything starts
    teacher = co.teacher
    if args.infer_restarts and co.train.share_base_weights is True and teacher is None:
        raise ConfigError(f"--infer-restarts {args.infer_restarts}: with train share_base_weights the trainer holds "
                          "vLLM's weights, so a dead vLLM is not restarted (the run stops; --resume continues it); "
                          "leave --infer-restarts out or set --train.share_base_weights false")
    if args.dry_run:  # what the run's configs/ will hold: derived for this machine (on-policy, cores, reloads)
        for name, cfg in (("train", co.train), ("infer", co.infer), ("orch", co.orch)):
            print(f"# --- {name} ---\n{dump(cfg)}")
        if teacher is not None:
            print(f"# --- teacher (served by tidal grpo at {teacher.base_url}) ---\n{dump(teacher.infer)}")
        for notice in co.placement.notices:  # what the placement on this machine changes (on-policy, cores, ...)
            print(f"# on this machine: {notice}")
        print_family_row(co.infer.model)
        return 0
    live = sys.stdout.isatty() and os.environ.get("TIDAL_PLAIN") != "1"
    restarts = 3 if args.infer_restarts is None else args.infer_restarts
    return start.start(co, live=live, resume_hint=resume_hint(sys.argv[1:]), infer_restarts=restarts,
                       startup=args.startup)


def cmd_serve(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    """`tidal serve`: the warm pool (`tidal.colocate.pool`), for the configs `tidal grpo` would derive."""
    from tidal.colocate import pool

    if args.stop or args.status:
        if ov or any(getattr(args, c) for c in ("train", "infer", "orch", "model")) or args.dry_run or \
                args.no_trainer:
            raise ConfigError(f"--{'stop' if args.stop else 'status'} takes no config files, overrides, --dry-run or "
                              "--no-trainer: it acts on the running pool")
        return pool.stop() if args.stop else pool.status()
    train, infer, orch = (load(c, getattr(args, c), ov) for c in ("train", "infer", "orch"))
    co = start.derive(train, infer, orch, calibrate=False)
    if args.dry_run:  # the server the pool would keep: what `tidal grpo` derives from the same files
        print(dump(co.infer))
        return 0
    setup_logging("serve")
    return pool.serve(co, keep_trainer=not args.no_trainer)


def cmd_infer(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    cfg = load("infer", args.config, ov)
    if args.dry_run:
        print(dump(cfg))
        return 0
    from tidal.inference.backends.bind import InsecureBindError
    from tidal.inference.backends.dp import PlacementError
    from tidal.inference.backends.launch import serve
    from tidal.procs import PortInUseError

    try:
        return serve(cfg)  # dp 1: becomes the server (does not return); dp N: supervises N servers
    except (PortInUseError, InsecureBindError, PlacementError) as exc:
        raise ConfigError(str(exc)) from None


def load_single(component: str, args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> Any:
    """Config of a one-component command with `--output-dir` and `--resume` applied; None after printing it for
    --dry-run."""
    cfg = load(component, args.config, ov)
    if getattr(args, "output_dir", None):
        cfg.output_dir = args.output_dir
    cfg = with_resume(cfg, args.resume)
    if args.dry_run:
        print(dump(cfg))
        return None
    return cfg


def cmd_orch(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    cfg = load_single("orch", args, ov)
    if cfg is None:
        return 0
    import asyncio

    from tidal.checkpoint import CheckpointError
    from tidal.inference.protocol import BackendUnsupported, InferenceError, InferenceUnreachable, NotMultimodal
    from tidal.orchestrator import loop

    run_dir = Path(cfg.output_dir)
    resuming = cfg.ckpt.resume_step is not None
    if not resuming and step_files(rollouts_dir(run_dir), ".safetensors"):
        raise ConfigError(f"output_dir {run_dir} already holds a run (rollouts/); pass --resume to continue it "
                          "(ckpt.resume_step), or use another output_dir")
    setup_logging("[orch]")
    from tidal.procs.reaper import start_reaper

    start_reaper()  # environment servers it spawns die with it, however it dies
    from tidal.envs.agent.env import AgentProgramBroken
    from tidal.procs import WRONG_POLICY
    from tidal.transport.probe import PolicyMismatch

    try:
        asyncio.run(loop.run(cfg, run_dir))
    except PolicyMismatch as exc:  # one line: step, path, distances (tidal.orchestrator.identity)
        logging.getLogger("tidal.orch").error("stopping: %s", exc)
        return WRONG_POLICY
    except (InferenceUnreachable, InferenceError, CheckpointError, TimeoutError, AgentProgramBroken) as exc:
        logging.getLogger("tidal.orch").error("stopping: %s", exc)
        return 1
    except (NotMultimodal, BackendUnsupported) as exc:  # the run cannot be served: bad input, not a failure to retry
        logging.getLogger("tidal.orch").error("stopping: %s", exc)
        return 2
    return 0


def cmd_train(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    cfg = load_single("train", args, ov)
    if cfg is None:
        return 0
    run_dir = Path(args.output_dir) if args.output_dir else find_run_dir(cfg.output_dir)
    if args.warm_trainer:  # attached to the warm pool: this process only relays (no torch import here)
        if args.start_gate or cfg.gpus > 1:
            raise ConfigError("--warm-trainer (a trainer forked from the warm pool) takes no --start-gate and runs one "
                              f"rank (train gpus is {cfg.gpus})")
        from tidal.colocate.warm_trainer import run_forked

        return run_forked(Path(args.warm_trainer), cfg, run_dir)
    from tidal.procs import malloc

    try:  # before torch is imported: the process may execute itself again with tcmalloc preloaded
        allocator = malloc.for_trainer(cfg.malloc, cfg.device, may_exec=getattr(args, "own_process", False))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(f"tidal grpo-train: {allocator}", flush=True)
    from tidal.trainer import distributed
    from tidal.trainer.command import run_trainer

    # started with vLLM by `tidal grpo` on a GPU: imports done, CUDA untouched (tidal.colocate.start_order)
    if args.start_gate:
        setup_logging("[train]")
        from tidal.colocate.start_order import wait_for_gate

        try:
            wait_for_gate(Path(args.start_gate), cfg.batch_timeout_s)
        except TimeoutError as exc:
            logging.getLogger("tidal.trainer").error("stopping: %s", exc)
            return 1
    if cfg.gpus > 1 and not distributed.under_rendezvous():  # become the agent of `gpus` ranks of this command
        setup_logging("[train]")
        from tidal.procs.reaper import start_reaper

        start_reaper()  # the ranks die with this process, however it dies
        return distributed.launch_ranks(cfg.gpus, args.argv, cfg.cpu_affinity)
    rank = distributed.env_ranks()
    setup_logging(f"[train r{rank.rank}]" if rank.sharded else "[train]")
    return run_trainer(cfg, run_dir)


def cmd_sft(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    cfg = load("train", args.config, ov)
    if args.output_dir:
        if cfg.sft.save_to:
            raise ConfigError(f"--output-dir {args.output_dir}: tidal sft writes nothing but its result, and train "
                              f"sft.save_to ({cfg.sft.save_to}) already says where; give one of them")
        cfg.output_dir = args.output_dir
    out = sft_dir(Path(cfg.output_dir), cfg.sft.save_to)
    if args.dry_run:
        print(f"# tidal sft: {cfg.sft.steps(cfg.max_steps)} steps, the result in {out}\n{dump(cfg)}")
        return 0
    from tidal.procs import malloc

    try:  # before torch is imported (train malloc, as grpo-train)
        allocator = malloc.for_trainer(cfg.malloc, cfg.device, may_exec=getattr(args, "own_process", False))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    setup_logging("[sft]")
    logging.getLogger("tidal.sft").info("%s", allocator)
    from tidal.trainer import sft

    cfg.model = resolve_model(cfg.model)
    sft.run(cfg)
    return 0


def cmd_report(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    from tidal.monitor.report import write_report

    run_dir = Path(args.run_dir)
    if not metrics_path(run_dir).is_file():
        print(f"tidal report: {run_dir} holds no metrics.jsonl; pass a run directory", file=sys.stderr)
        return 2
    print(write_report(run_dir, Path(args.out) if args.out else None))
    return 0


def cmd_env_server(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    import json

    from tidal.envs import make_env
    from tidal.envs.remote import serve

    try:
        env_args = json.loads(args.args)
        env = make_env(args.env_id, env_args)
    except ValueError as exc:
        raise ConfigError(f"env-server: {exc}") from None
    try:
        serve(env, args.host, args.port)
    except OSError as exc:  # no API key beyond loopback (PermissionError), a taken port, an unknown host
        raise ConfigError(f"--host {args.host} --port {args.port}: {exc}") from None
    return 0


def cmd_serve_tinker(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    from pydantic import ValidationError

    from tidal.tinker.config import TinkerServeConfig

    try:
        cfg = TinkerServeConfig(**{k: v for k, v in vars(args).items() if k in TinkerServeConfig.model_fields
                                   and v is not None})
    except ValidationError as exc:
        raise ConfigError(str(exc)) from None
    setup_logging("[tinker]")
    from tidal.tinker.serve import ServeError, run

    try:
        return run(cfg)
    except ServeError as exc:
        raise ConfigError(str(exc)) from None


def cmd_export(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    from tidal.trainer.publish.export_cmd import cmd_export as run  # tidal export: its own module

    return run(args, ov)


def count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; give 0 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="GRPO training with vLLM rollouts.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grpo", help="co-locate: run inference, orchestrator and trainer together")
    for c in ("train", "infer", "orch"):
        g.add_argument(f"--{c}", metavar="FILE", help=f"{c}.yaml (default: bundled reverse-text example)")
    w = sub.add_parser("serve", help="warm pool: keep vLLM loaded for the next `tidal grpo` runs of the same model "
                       "(docs/warm-pool.md)")
    for c in ("train", "infer", "orch"):
        w.add_argument(f"--{c}", metavar="FILE", help=f"{c}.yaml the runs will use (default: bundled example)")
    w.add_argument("--stop", action="store_true", help="stop the running pool (and everything it started)")
    w.add_argument("--status", action="store_true", help="print the running pool's state (exit 1: none runs)")
    w.add_argument("--no-trainer", action="store_true", help="keep vLLM only, not the trainer's base model (on CPU "
                   "the pool keeps both by default; without it each run's trainer imports torch and loads the model)")
    for name, help_ in (("grpo-infer", "start the vLLM inference server"),
                        ("grpo-orch", "run the orchestrator"), ("grpo-train", "run the trainer"),
                        ("sft", "supervised warm start on an environment's reference completions")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config", nargs="?", help="YAML config (default: bundled reverse-text example)")
    for s in sub.choices.values():
        s.add_argument("--dry-run", action="store_true", help="print the resolved configs, start nothing")
        if s.prog.split()[-1] in ("grpo", "grpo-orch", "grpo-train"):
            s.add_argument("--resume", action="store_true",
                           help="continue the run in the output directory from its newest checkpoint "
                                "(ckpt.resume_step -1)")
        if s.prog.split()[-1] not in ("grpo-infer", "serve"):
            s.add_argument("--output-dir", help="run directory for every component's output")
        s.add_argument("--model", metavar="MODEL", help="the model of every component this command runs (train "
                       "`model`, infer `model`, orch `model.name`): tidal:NAME, a local directory or a Hub id")
    g.add_argument("--infer-restarts", type=count, metavar="N",
                   help="restart the inference server up to N times if it dies (default 3)")
    g.add_argument("--startup", choices=("auto", "sequential"), default="auto",
                   help="auto: on CPU the orchestrator and trainer start with vLLM, on a GPU the trainer imports "
                        "with it and builds its model once vLLM is up; sequential: both start once vLLM answers "
                        "/health (the order before; a baseline for benchmarks)")
    sub.choices["grpo-train"].add_argument(
        "--start-gate", metavar="FILE", help="wait until FILE exists before building the model (tidal grpo sets it "
        "on a GPU: vLLM sizes its memory first)")
    sub.choices["grpo-train"].add_argument(
        "--warm-trainer", metavar="SOCKET", help="run this trainer as a fork of the warm pool's kept base (tidal grpo "
        "sets it when attached to `tidal serve`: docs/warm-pool.md)")
    e = sub.add_parser("env-server", help="serve an environment over HTTP (for orch env[].address)")
    e.add_argument("env_id", help="registered id or package.module:Class")
    e.add_argument("--args", default="{}", help="environment arguments as JSON")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=8100)
    r = sub.add_parser("report", help="write RUN_DIR/report.html: curves, samples and configs of a run")
    r.add_argument("run_dir", metavar="RUN_DIR")
    r.add_argument("--out", help="write the HTML here instead of RUN_DIR/report.html")
    from tidal.trainer.publish import export_cmd

    export_cmd.add_parser(sub)
    t = sub.add_parser("serve-tinker", help="serve the Tinker API (the tinker SDK drives tidal): docs/tinker.md")
    t.add_argument("--model", help="the base model (default tidal:tiny-reverse)")
    t.add_argument("--host", help="address to bind (default 127.0.0.1)")
    t.add_argument("--port", type=int, help="port of the Tinker API (default 8900)")
    t.add_argument("--api-key", dest="api_key", help="key clients must send, starting with tml- (default: a random "
                   "one, printed)")
    t.add_argument("--output-dir", dest="output_dir", help="checkpoints and logs (default outputs/tinker)")
    t.add_argument("--device", help="the trainer's device (default auto)")
    t.add_argument("--vllm-port", dest="vllm_port", type=int, help="port of the vLLM it starts (default: free)")
    t.add_argument("--max-lora-rank", dest="max_lora_rank", type=int, help="highest LoRA rank (default 32)")
    t.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=None,
                   help="run vLLM without torch.compile and CUDA graphs (a faster start on a GPU)")
    t.add_argument("--no-policy-check", dest="policy_check", action="store_false", default=None,
                   help="do not check that vLLM serves each sampler checkpoint (the policy identity check)")
    from tidal.evaluate.cli import add_parser as add_eval

    add_eval(sub)
    return p


def cmd_eval(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    from tidal.evaluate.cli import cmd_eval as run

    return run(args, ov)


HANDLERS = {"grpo": (cmd_grpo, {"train", "infer", "orch"}), "grpo-infer": (cmd_infer, {"infer"}),
            "grpo-orch": (cmd_orch, {"orch"}), "grpo-train": (cmd_train, {"train"}), "sft": (cmd_sft, {"train"}),
            "report": (cmd_report, set()), "env-server": (cmd_env_server, set()),
            "serve-tinker": (cmd_serve_tinker, set()), "serve": (cmd_serve, {"train", "infer", "orch"}),
            "eval": (cmd_eval, set()), "export": (cmd_export, set())}


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    rest, extra = extract_overrides(raw)
    args, unknown = build_parser().parse_known_args(rest)
    args.argv = raw  # grpo-train with several ranks starts them with the same arguments
    args.own_process = argv is None  # the process is this command (`entry`): it may execute itself again (malloc)
    extra = unknown + extra
    handler, allowed = HANDLERS[args.command]
    try:
        overrides = split_overrides(extra, allowed)
        if getattr(args, "model", None):  # one flag for the model of every component
            for component in allowed:
                overrides.setdefault(component, {})["model.name" if component == "orch" else "model"] = args.model
        return handler(args, overrides)
    except ConfigError as exc:
        print(f"tidal {args.command}: config error: {exc}", file=sys.stderr)
        return 2


FAST_EXIT = frozenset({"grpo", "grpo-train", "grpo-orch"})
"""Commands whose process ends through `tidal.procs.exit.fast_exit` (1-2 s of interpreter teardown skipped)."""


def entry() -> None:
    """The `tidal` command (and `python -m tidal.cli`): `main` on the process's arguments; the commands of
    `FAST_EXIT` then end the process without the interpreter's teardown, unless the environment sets
    `TIDAL_FAST_EXIT=0` (the interpreter's full shutdown, as before; bench/exit_tail.py's baseline)."""
    code = main()
    if len(sys.argv) > 1 and sys.argv[1] in FAST_EXIT and os.environ.get("TIDAL_FAST_EXIT", "1") != "0":
        from tidal.procs.exit import fast_exit

        fast_exit(code)
    sys.exit(code)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    entry()
