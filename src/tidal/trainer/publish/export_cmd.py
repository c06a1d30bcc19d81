"""`tidal export SOURCE [--gguf TYPE] [--base MODEL] [--out FILE]`: a trained model as one GGUF file after the fact,
e.g. when a run's GGUF step failed (its error line names this command), for a run trained without `export.gguf`, or
for another type (`tidal export RUN_DIR --gguf q4_0`).

SOURCE is a run directory (its `final/merged`, `final/model` or `final/adapter`, the first that is complete), a PEFT
adapter directory (`adapter_config.json`; merged into its base: `base_model_name_or_path`, or `--base MODEL`), or a
Hugging Face model directory (e.g. `final/merged`). The file goes to `RUN_DIR/final/gguf/model-TYPE.gguf` for a run
directory (files of other types there are kept; one of the same type is replaced), else to `--out`. A run's
`configs/train.yaml` `rope_scaling`, when set, is applied as in training. Exit codes: 0 written; 2 bad input, named
(nothing written); 1 the writing failed (nothing half-written: a temporary name and a rename). Weights are read with
safetensors' torch reader (any dtype, bfloat16 included); PEFT is imported only to merge an adapter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tidal.config.load import ConfigError
from tidal.paths import configs_dir, final_dir

STABLE = "STABLE"


def add_parser(sub: Any) -> None:
    """The `export` subcommand of `tidal` (cli.py calls this with its subparsers)."""
    from tidal.trainer.publish.gguf_out import TYPES

    e = sub.add_parser("export", help="write a run's trained model (or an adapter / model directory) as a GGUF "
                       "file for llama.cpp, Ollama, LM Studio")
    e.add_argument("source", metavar="SOURCE", help="run directory, PEFT adapter directory or HF model directory")
    e.add_argument("--gguf", default="f16", metavar="TYPE",
                   help=f"the file's type: {', '.join(TYPES)} (default f16; train export.gguf documents each)")
    e.add_argument("--base", metavar="MODEL", help="base model of an adapter (default: its base_model_name_or_path)")
    e.add_argument("--out", metavar="FILE", help="output file (default for a run directory: "
                   "RUN_DIR/final/gguf/model-TYPE.gguf; required otherwise)")


def find_source(source: Path) -> tuple[Path, bool]:
    """(directory holding the model, is it an adapter) for SOURCE; ConfigError naming what was looked for."""
    if not source.is_dir():
        raise ConfigError(f"tidal export {source}: no such directory; give a run directory, a PEFT adapter "
                          "directory or a Hugging Face model directory")
    if (source / "final").is_dir():
        for what in ("merged", "model", "adapter"):
            d = final_dir(source, what)
            if (d / STABLE).is_file():
                return d, what == "adapter"
        raise ConfigError(f"tidal export {source}: its final/ holds no complete merged, model or adapter directory "
                          "(each is complete with its STABLE marker); the run did not finish")
    if (source / "adapter_config.json").is_file():
        return source, True
    if (source / "config.json").is_file():
        return source, False
    raise ConfigError(f"tidal export {source}: neither a run directory (final/), a PEFT adapter "
                      "(adapter_config.json) nor a Hugging Face model directory (config.json)")


def adapter_base(adapter: Path, base: str | None) -> Path:
    """The base model directory of `adapter` (`--base`, else its adapter_config.json's)."""
    import json

    from tidal.models.sources import resolve_model

    name = base or json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not name:
        raise ConfigError(f"tidal export {adapter}: the adapter names no base model; pass --base MODEL")
    try:
        d = Path(resolve_model(str(name)))
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"tidal export {adapter}: its base model {name} cannot be found ({exc}); pass --base "
                          "MODEL") from None
    if not (d / "config.json").is_file():
        raise ConfigError(f"tidal export {adapter}: its base model {name} is no model directory (no config.json); "
                          "pass --base MODEL")
    return d


def merged_weights(model_dir: Path, adapter: bool, base: str | None) -> tuple[dict[str, Any], Path]:
    """(checkpoint name -> tensor, the directory whose config and tokenizer go into the file)."""
    from tidal.trainer.publish.broadcast import checkpoint_keys

    if not adapter:  # torch's reader: safetensors.numpy cannot read bfloat16 (every GPU run's final/merged)
        from safetensors.torch import load_file

        weights: dict[str, Any] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        return weights, model_dir
    base_dir = adapter_base(model_dir, base)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tidal.trainer.publish.broadcast import merged_state_dict

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft = PeftModel.from_pretrained(model, str(model_dir))
    return merged_state_dict(peft, checkpoint_keys(base_dir)), base_dir


def run_rope_scaling(run_dir: Path) -> dict[str, Any] | None:
    """train `rope_scaling` of the run in `run_dir` (its resolved `configs/train.yaml`), if it has one."""
    path = configs_dir(run_dir) / "train.yaml"
    if not path.is_file():
        return None
    import yaml

    value = (yaml.safe_load(path.read_text()) or {}).get("rope_scaling")
    return value if isinstance(value, dict) else None


def cmd_export(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> int:
    """`tidal export`: module docstring."""
    from tidal.trainer.publish.gguf_out import TYPES, check_gguf_export, write_gguf

    if args.gguf not in TYPES:
        raise ConfigError(f"--gguf {args.gguf}: not a type tidal writes; valid: {', '.join(TYPES)}")
    source = Path(args.source)
    model_dir, adapter = find_source(source)
    is_run = model_dir != source
    if args.base and not adapter:
        raise ConfigError(f"tidal export {source}: --base names the base model a PEFT adapter is merged into, but "
                          f"{model_dir} is a full model (no adapter_config.json); drop --base")
    if not is_run and not args.out:
        raise ConfigError(f"tidal export {source}: not a run directory, so say where the file goes: --out FILE")
    rope = run_rope_scaling(source) if is_run else None
    import json

    config_dir = adapter_base(model_dir, args.base) if adapter else model_dir
    check_gguf_export(json.loads((config_dir / "config.json").read_text()), config_dir, f"tidal export {source}",
                      rope)
    try:
        weights, config_dir = merged_weights(model_dir, adapter, args.base)
        if args.out:
            out = write_gguf(weights.items(), config_dir, Path(args.out), args.gguf, rope)
        else:
            from tidal.trainer.publish.export import write_final_gguf

            out = write_final_gguf(weights, config_dir, source, args.gguf, rope)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        print(f"tidal export: writing the GGUF failed ({type(exc).__name__}: {exc}); nothing was written",
              file=sys.stderr)
        return 1
    print(out)
    return 0
