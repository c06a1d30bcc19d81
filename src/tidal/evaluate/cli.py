"""`tidal eval`'s command line: flags (or an `eval.yaml` of `EvalConfig` keys, flags over it) -> `evaluate` -> the
table and the JSON report. Config mistakes exit 2 before vLLM starts.

    tidal eval --model tidal:smollm2-135m-instruct --env addition --adapter outputs/real-addition
    tidal eval --model M --adapter RUN_A --adapter RUN_B --env "{id: math, args: {...}}" --num-examples 200 \\
        --samples 8 --temperature 1.0 --out eval.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

FLAGS: dict[str, str] = {"model": "model", "adapter": "adapters", "num_examples": "num_examples", "seed": "seed",
                         "samples": "samples", "temperature": "temperature", "max_tokens": "max_tokens",
                         "max_model_len": "max_model_len", "address": "address", "serve": "serve", "port": "port",
                         "dtype": "dtype", "show_samples": "show_samples", "out": "out",
                         "chat_template": "chat_template"}
"""argparse destination -> EvalConfig key."""


def add_parser(sub: Any) -> None:
    """The `eval` subcommand's flags (docs/evaluation.md)."""
    e = sub.add_parser("eval", help="score a model and adapters on an environment (greedy accuracy, pass@k, ...)")
    e.add_argument("config", nargs="?", help="eval.yaml with EvalConfig keys (flags override it)")
    e.add_argument("--model", help="base model: tidal:NAME, a directory, a cached Hub id or a .gguf file")
    e.add_argument("--adapter", action="append", help="a PEFT adapter, run directory or checkpoint (repeatable)")
    e.add_argument("--no-base", dest="base", action="store_false", default=None, help="do not score the base model")
    e.add_argument("--env", help="an environment id, package.module:Class, or an orch env entry as YAML "
                   "(e.g. \"{id: addition, args: {eval_size: 256}}\")")
    e.add_argument("--env-args", help="the environment's args as YAML/JSON")
    e.add_argument("--env-address", help="a running `tidal env-server` serving the environment")
    e.add_argument("--num-examples", type=int, help="examples drawn with --seed (default: the fixed eval set)")
    e.add_argument("--seed", type=int)
    e.add_argument("--no-greedy", dest="greedy", action="store_false", default=None, help="no greedy completions")
    e.add_argument("--samples", type=int, help="sampled completions per example (pass@k for every k <= K)")
    e.add_argument("--temperature", type=float, help="temperature of the sampled completions (default 1.0)")
    e.add_argument("--max-tokens", type=int, help="completion tokens at most (default 256)")
    e.add_argument("--max-model-len", type=int, help="prompt + completion tokens at most (default 2048)")
    e.add_argument("--chat-template-kwargs", help="chat template keyword arguments as YAML/JSON")
    e.add_argument("--chat-template", help="chat template for chat-message prompts: a file or the Jinja template "
                   "inline (default: the model's own; a base model has none)")
    e.add_argument("--address", help="a running vLLM server's URL instead of starting one")
    e.add_argument("--serve", choices=("auto", "lora", "merged"), help="how adapters reach vLLM (default auto)")
    e.add_argument("--port", type=int, help="port of the vLLM server tidal eval starts (default: a free one)")
    e.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    e.add_argument("--show-samples", type=int, help="completions shown per row (default 3)")
    e.add_argument("--no-policy-check", dest="policy_check", action="store_false", default=None,
                   help="do not check that vLLM serves each adapter row (the policy identity check)")
    e.add_argument("--out", help="JSON report (default eval.json)")
    e.add_argument("--resume", action="store_true", default=None, help="keep the rows an unfinished run with this "
                   "--out wrote to OUT.partial (same settings, unchanged adapters); score the rest")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--dry-run", action="store_true", help="check the model, adapters, environment and examples; "
                   "start nothing")


def parse_yaml(flag: str, text: str) -> Any:
    from tidal.config.load import ConfigError

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{flag} {text!r}: not valid YAML/JSON ({exc})") from None


def eval_config(args: argparse.Namespace) -> Any:
    """The EvalConfig of `args` (the file's keys, flags over them); ConfigError naming the key."""
    from pydantic import ValidationError

    from tidal.config.evaluate import EvalConfig
    from tidal.config.load import ConfigError

    data: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"{path}: no such file")
        loaded = parse_yaml(str(path), path.read_text())
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of EvalConfig keys")
        data = loaded
    for dest, key in FLAGS.items():
        if getattr(args, dest, None) is not None:
            data[key] = getattr(args, dest)
    for dest in ("base", "greedy", "policy_check", "resume"):
        if getattr(args, dest) is not None:
            data[dest] = getattr(args, dest)
    if args.chat_template_kwargs is not None:
        data["chat_template_kwargs"] = parse_yaml("--chat-template-kwargs", args.chat_template_kwargs)
    if args.env is not None:
        env = parse_yaml("--env", args.env)
        data["env"] = env if isinstance(env, dict) else {"id": str(args.env)}
    if args.env_args is not None or args.env_address is not None:
        env = dict(data.get("env") or {"id": "reverse-text"})
        if args.env_args is not None:
            env["args"] = parse_yaml("--env-args", args.env_args)
        if args.env_address is not None:
            env["address"] = args.env_address
        data["env"] = env
    try:
        return EvalConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{args.config or 'tidal eval'}: {exc}") from None


def cmd_eval(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    """`tidal eval` (module docs): 0 when every row was scored."""
    from tidal.evaluate.report import print_report, write_json
    from tidal.evaluate.run import evaluate

    cfg = eval_config(args)
    if args.dry_run:
        from tidal.evaluate.run import prepare

        plan = prepare(cfg)
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        print(f"# {len(plan.targets)} rows, {len(plan.examples)} examples: checked, nothing started")
        return 0
    from tidal.procs import WRONG_POLICY
    from tidal.transport.probe import PolicyMismatch

    try:
        result = evaluate(cfg, progress=not args.quiet)
    except PolicyMismatch as exc:  # one line: row, path, distances (tidal.orchestrator.identity)
        print(f"tidal eval: {exc}", file=sys.stderr)
        return WRONG_POLICY
    from tidal.evaluate.partial import remove

    out = Path(cfg.out or "eval.json")
    write_json(result, out)
    remove(out)
    print_report(result, out)
    return 0
