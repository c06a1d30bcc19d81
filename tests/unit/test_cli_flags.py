"""Every flag in every `tidal COMMAND --help` has its effect (issue 41), checked the cheapest honest way: the
`--dry-run` output, the run directory a command writes, the arguments its component is started with (the component
itself replaced by a recorder, so no vLLM, orchestrator loop or trainer starts), or an exit-2 error naming the
flag's value. `test_every_flag_in_the_help_has_a_check` parses the help text: a new command or flag without an
entry in `CHECKS` fails it. `tidal sft` really trains the bundled tiny model for one step (a few seconds)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidal import cli
from tidal.cli import main
from tidal.models.sources import resolve_model
from tidal.paths import STABLE, report_path, rollouts_dir

TINY = str(resolve_model("tidal:tiny-reverse"))
"""The bundled model's directory: a valid `--model` value that differs from every bundled config's."""


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def commands(capsys: pytest.CaptureFixture[str]) -> list[str]:
    usage = re.search(r"\{([a-z,-]+)\}", help_text(capsys))
    assert usage is not None
    return usage.group(1).split(",")


def flags(text: str) -> set[str]:
    """Long options and positionals of one command's help text (`-h` aside)."""
    out: set[str] = set()
    section = ""
    for line in text.splitlines():
        if line and not line.startswith(" "):
            section = line
        elif section.startswith("positional") and re.match(r"^  \S", line):
            out.add(line.split()[0])
        elif section.startswith("options") and re.match(r"^  -", line):
            out |= {f for f in re.findall(r"--[a-z][a-z-]*", line.split("  ")[1]) if f != "--help"}
    return out


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def sections(out: str) -> dict[str, Any]:
    """`tidal grpo --dry-run`'s printed configs by name."""
    parts = re.split(r"^# --- (\w+)[^\n]*\n", out, flags=re.M)
    return {name: yaml.safe_load(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def bundled(component: str, tmp_path: Path, **changes: Any) -> str:
    """A copy of the bundled `component`.yaml with `changes` (the file a positional / --FILE flag names)."""
    data = yaml.safe_load(cli.example_path(component).read_text()) | changes
    path = tmp_path / f"my-{component}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def no_reaper(monkeypatch: pytest.MonkeyPatch) -> None:
    import tidal.procs.reaper

    monkeypatch.setattr(tidal.procs.reaper, "start_reaper", lambda pid=None: None)


# --- tidal grpo ------------------------------------------------------------------------------------------------

def test_grpo_files(capsys, tmp_path):
    code, out, _ = run(capsys, "grpo", "--dry-run", "--train", bundled("train", tmp_path, learning_rate=0.00123),
                       "--infer", bundled("infer", tmp_path, port=8123),
                       "--orch", bundled("orch", tmp_path, max_steps=7))
    got = sections(out)
    assert code == 0 and got["train"]["learning_rate"] == 0.00123 and got["infer"]["port"] == 8123
    assert got["orch"]["max_steps"] == 7


def test_grpo_dry_run_starts_nothing(capsys, monkeypatch):
    from tidal.colocate import start

    monkeypatch.setattr(start, "start", lambda co, **kw: pytest.fail("--dry-run started the run"))
    code, out, _ = run(capsys, "grpo", "--dry-run")
    assert code == 0 and set(sections(out)) == {"train", "infer", "orch"}


def test_grpo_dry_run_prints_the_configs_the_run_uses(capsys, monkeypatch, tmp_path):
    """Issue 66: `--dry-run` printed the wired configs before this machine's derivation (on CPU orch/train
    max_async_level 1 and infer enable_lora true, while the run used 0 and false). It prints what the run's
    `configs/` holds: the derived configs, equal to those `tidal grpo` starts with."""
    from tidal.colocate.start import dump

    got = sections(run(capsys, "grpo", "--dry-run", "--output-dir", str(tmp_path / "run"))[1])
    co = started_grpo(capsys, monkeypatch, tmp_path)["co"]
    for name in ("train", "infer", "orch"):
        assert got[name] == yaml.safe_load(dump(getattr(co, name))), name
    if co.placement.device == "cpu":  # this machine's derivation: on-policy, merged reloads without LoRA layers
        assert got["orch"]["max_async_level"] == got["train"]["max_async_level"] == 0
        assert got["infer"]["enable_lora"] is False


def test_grpo_resume_output_dir_and_model(capsys, tmp_path):
    got = sections(run(capsys, "grpo", "--dry-run", "--resume", "--output-dir", str(tmp_path / "r"),
                       "--model", TINY)[1])
    assert got["train"]["ckpt"]["resume_step"] == got["orch"]["ckpt"]["resume_step"] == -1
    assert got["train"]["output_dir"] == got["orch"]["output_dir"] == str(tmp_path / "r")
    assert got["train"]["model"] == got["infer"]["model"] == got["orch"]["model"]["name"] == TINY
    plain = sections(run(capsys, "grpo", "--dry-run")[1])
    assert plain["train"]["ckpt"]["resume_step"] is None and plain["train"]["model"] == "tidal:tiny-reverse"


def started_grpo(capsys, monkeypatch, tmp_path, *argv: str) -> dict[str, Any]:
    """The arguments `tidal grpo` starts its run with (the launcher replaced by a recorder)."""
    from tidal.colocate import start

    seen: dict[str, Any] = {}
    monkeypatch.setattr(start, "start", lambda co, **kw: seen.update(kw, co=co) or 0)
    assert run(capsys, "grpo", "--output-dir", str(tmp_path / "run"), *argv)[0] == 0
    return seen


def test_grpo_infer_restarts_and_startup(capsys, monkeypatch, tmp_path):
    default = started_grpo(capsys, monkeypatch, tmp_path)
    assert default["infer_restarts"] == 3 and default["startup"] == "auto"
    assert default["co"].placement.run_dir == tmp_path / "run"
    given = started_grpo(capsys, monkeypatch, tmp_path, "--infer-restarts", "0", "--startup", "sequential")
    assert given["infer_restarts"] == 0 and given["startup"] == "sequential"
    with pytest.raises(SystemExit) as exc:
        main(["grpo", "--infer-restarts", "-1"])
    assert exc.value.code == 2 and "-1 is negative" in capsys.readouterr().err


def test_grpo_infer_restarts_with_shared_base_weights_is_refused(capsys, monkeypatch, tmp_path):
    """On a GPU `share_base_weights` makes tidal grpo restart vLLM 0 times: an explicit --infer-restarts N would be
    ignored, so it exits 2 (the derived run is made to share weights here: this machine has no GPU)."""
    import dataclasses

    from tidal.colocate import start

    real = start.derive
    monkeypatch.setattr(start, "derive", lambda *a, **kw: dataclasses.replace(
        real(*a, **kw), train=real(*a, **kw).train.model_copy(update={"share_base_weights": True})))
    monkeypatch.setattr("tidal.colocate.preflight.check_run", lambda *a, **kw: None)
    monkeypatch.setattr(start, "start", lambda co, **kw: pytest.fail("started"))
    code, _, err = run(capsys, "grpo", "--output-dir", str(tmp_path), "--infer-restarts", "2")
    assert code == 2 and "--infer-restarts 2: with train share_base_weights" in err


# --- tidal grpo-infer ------------------------------------------------------------------------------------------

def test_grpo_infer(capsys, monkeypatch, tmp_path):
    import tidal.inference.backends.launch as launch

    monkeypatch.setattr(launch, "serve", lambda cfg: pytest.fail("--dry-run started vLLM"))
    code, out, _ = run(capsys, "grpo-infer", bundled("infer", tmp_path, port=8123), "--dry-run", "--model", TINY)
    got = yaml.safe_load(out)
    assert code == 0 and got["port"] == 8123 and got["model"] == TINY
    served: list[Any] = []
    monkeypatch.setattr(launch, "serve", lambda cfg: served.append(cfg) or 0)
    assert run(capsys, "grpo-infer", "--model", TINY)[0] == 0 and served[0].model == TINY


# --- tidal grpo-orch -------------------------------------------------------------------------------------------

def test_grpo_orch_dry_run(capsys, tmp_path):
    code, out, _ = run(capsys, "grpo-orch", bundled("orch", tmp_path, batch_size=32), "--dry-run", "--resume",
                       "--output-dir", str(tmp_path / "r"), "--model", TINY)
    got = yaml.safe_load(out)
    assert code == 0 and got["batch_size"] == 32 and got["ckpt"]["resume_step"] == -1
    assert got["output_dir"] == str(tmp_path / "r") and got["model"]["name"] == TINY


def test_grpo_orch_runs_in_the_output_dir(capsys, monkeypatch, tmp_path, no_reaper):
    from tidal.orchestrator import loop

    seen: list[Any] = []

    async def fake_run(cfg, run_dir, *a):
        seen.append((cfg, run_dir))

    monkeypatch.setattr(loop, "run", fake_run)
    assert run(capsys, "grpo-orch", "--output-dir", str(tmp_path / "r"), "--resume")[0] == 0
    cfg, run_dir = seen[0]
    assert run_dir == tmp_path / "r" and cfg.ckpt.resume_step == -1
    (rollouts_dir(tmp_path / "r")).mkdir(parents=True)
    (rollouts_dir(tmp_path / "r") / "step_1.safetensors").write_bytes(b"")
    code, _, err = run(capsys, "grpo-orch", "--output-dir", str(tmp_path / "r"))  # a run there, no --resume
    assert code == 2 and f"output_dir {tmp_path / 'r'} already holds a run" in err


# --- tidal grpo-train ------------------------------------------------------------------------------------------

def test_grpo_train_dry_run(capsys, tmp_path):
    code, out, _ = run(capsys, "grpo-train", bundled("train", tmp_path, learning_rate=0.00123), "--dry-run",
                       "--resume", "--output-dir", str(tmp_path / "r"), "--model", TINY)
    got = yaml.safe_load(out)
    assert code == 0 and got["learning_rate"] == 0.00123 and got["ckpt"]["resume_step"] == -1
    assert got["output_dir"] == str(tmp_path / "r") and got["model"] == TINY


def test_grpo_train_output_dir_and_start_gate(capsys, monkeypatch, tmp_path):
    from tidal.trainer import grpo

    seen: list[Any] = []
    monkeypatch.setattr(grpo, "run", lambda cfg, run_dir, ranks: seen.append((cfg, run_dir)) or 1)
    gate = tmp_path / "gate"
    code, _, _ = run(capsys, "grpo-train", "--output-dir", str(tmp_path / "r"), "--start-gate", str(gate),
                     "--train.batch_timeout_s", "0.1")
    assert code == 1 and not seen  # the gate never opened: the trainer never built its model
    gate.write_text("")
    assert run(capsys, "grpo-train", "--output-dir", str(tmp_path / "r"), "--start-gate", str(gate))[0] == 0
    cfg, run_dir = seen[0]
    assert run_dir == tmp_path / "r" and rollouts_dir(run_dir).is_dir() and cfg.output_dir == str(tmp_path / "r")


def test_grpo_train_exits_export_failed_when_the_gguf_step_fails(capsys, monkeypatch, tmp_path, caplog):
    """A run that trained to its end but whose GGUF step failed (`GGUFExportError`, raised by `grpo.finish` after the
    report) exits `procs.EXPORT_FAILED` (3), with the export's one error line; any other failure stays 1."""
    from tidal.procs import EXPORT_FAILED
    from tidal.trainer import grpo
    from tidal.trainer.publish.export import GGUFExportError

    def fails(cfg, run_dir, ranks):
        raise GGUFExportError(f"GGUF export failed (OSError: disk full); write it later with: tidal export {run_dir}")

    monkeypatch.setattr(grpo, "run", fails)
    code, out, err = run(capsys, "grpo-train", "--output-dir", str(tmp_path / "r"))
    assert code == EXPORT_FAILED == 3 and f"tidal export {tmp_path / 'r'}" in out + err + caplog.text


# --- tidal sft -------------------------------------------------------------------------------------------------

def test_sft_bundled_config_dry_run(capsys, tmp_path):
    """The README's `tidal sft` with the bundled train.yaml (max_steps -1): 100 steps, not an error."""
    code, out, _ = run(capsys, "sft", "--dry-run")
    assert code == 0 and out.startswith("# tidal sft: 100 steps, the result in outputs/reverse-text/sft\n")
    code, out, _ = run(capsys, "sft", bundled("train", tmp_path, max_steps=7), "--dry-run", "--model", TINY,
                       "--output-dir", str(tmp_path / "x"))
    assert code == 0 and out.startswith(f"# tidal sft: 7 steps, the result in {tmp_path / 'x' / 'sft'}\n")
    assert yaml.safe_load(out)["model"] == TINY
    assert run(capsys, "sft", "--dry-run", "--sft.max_steps", "3")[1].startswith("# tidal sft: 3 steps")


def test_sft_output_dir_is_where_the_result_goes(capsys, tmp_path, monkeypatch):
    """`tidal sft --output-dir X` saves to X/sft (it used to save under the current directory)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code, _, _ = run(capsys, "sft", "--output-dir", str(tmp_path / "x"), "--sft.max_steps", "1",
                     "--sft.examples_per_step", "2", "--train.sequence_len", "256")
    assert code == 0 and (tmp_path / "x" / "sft" / STABLE).is_file()
    assert (tmp_path / "x" / "sft" / "adapter_config.json").is_file() and not any(cwd.iterdir())


def test_sft_refusals_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "sft", "--output-dir", str(tmp_path), "--sft.save_to", str(tmp_path / "s"))
    assert code == 2 and f"--output-dir {tmp_path}: tidal sft writes nothing but its result" in err
    code, _, err = run(capsys, "sft", "--output-dir", str(tmp_path), "--sft.env", "no-such-env")
    assert code == 2 and "sft.env" in err and "unknown environment id 'no-such-env'" in err


# --- tidal env-server ------------------------------------------------------------------------------------------

def test_env_server(capsys, monkeypatch):
    import tidal.envs.remote as remote

    seen: list[Any] = []
    monkeypatch.setattr(remote, "serve", lambda env, host, port: seen.append((env, host, port)))
    assert run(capsys, "env-server", "reverse-text", "--args", json.dumps({"min_len": 5, "max_len": 6}),
               "--host", "localhost", "--port", "8123")[0] == 0
    env, host, port = seen[0]
    assert (env.id, env.min_len, env.max_len, host, port) == ("reverse-text", 5, 6, "localhost", 8123)
    code, _, err = run(capsys, "env-server", "reverse-text", "--args", '{"nope": 1}')
    assert code == 2 and "bad args" in err


def test_env_server_on_a_taken_port_exits_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tidal.cli", "env-server", "reverse-text", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--port {port}" in r.stderr and "in use" in r.stderr


# --- tidal report ----------------------------------------------------------------------------------------------

def test_report(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert run(capsys, "report", str(run_dir))[0] == 2  # no metrics.jsonl
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n"
                                                   for s in (1, 2)))
    code, out, _ = run(capsys, "report", str(run_dir))
    assert code == 0 and out.strip() == str(report_path(run_dir)) and report_path(run_dir).is_file()
    report_path(run_dir).unlink()
    code, out, _ = run(capsys, "report", str(run_dir), "--out", str(tmp_path / "r.html"))
    assert code == 0 and (tmp_path / "r.html").is_file() and not report_path(run_dir).exists()


# --- tidal serve-tinker ----------------------------------------------------------------------------------------

TINKER = {"--model": ("model", TINY), "--host": ("host", "localhost"), "--port": ("port", 8123),
          "--api-key": ("api_key", "tml-k"), "--output-dir": ("output_dir", Path("/tmp/t")),
          "--device": ("device", "cpu"), "--vllm-port": ("vllm_port", 8124), "--max-lora-rank": ("max_lora_rank", 8),
          "--enforce-eager": ("enforce_eager", True), "--no-policy-check": ("policy_check", False)}


@pytest.mark.parametrize("flag", sorted(TINKER))
def test_serve_tinker(flag, capsys, monkeypatch):
    """Each flag sets its `TinkerServeConfig` key (what `tidal.tinker.serve.run` starts from; the server's own
    tests follow those keys: test_tinker_cli.py, tests/integration/test_tinker_server.py)."""
    import tidal.tinker.serve as serve
    from tidal.tinker.config import TinkerServeConfig

    seen: list[Any] = []
    monkeypatch.setattr(serve, "run", lambda cfg: seen.append(cfg) or 0)
    key, value = TINKER[flag]
    argv = [flag] if isinstance(value, bool) else [flag, str(value)]
    assert run(capsys, "serve-tinker", *argv)[0] == 0
    assert getattr(seen[0], key) == value != getattr(TinkerServeConfig(), key)


# --- tidal serve (the warm pool) ---------------------------------------------------------------------------------

def test_serve_flags(capsys, tmp_path, monkeypatch):
    """`--dry-run` prints the infer config the pool would serve, derived from `--train/--infer/--orch/--model` as
    `tidal grpo` derives it; `--status` / `--stop` act on the running pool (none here) and take nothing else."""
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))
    code, out, _ = run(capsys, "serve", "--dry-run")
    base = yaml.safe_load(out)
    assert code == 0 and base["model"] == "tidal:tiny-reverse"
    assert yaml.safe_load(run(capsys, "serve", "--dry-run", "--model", TINY)[1])["model"] == TINY
    files = {"infer": {"max_model_len": 1024}, "orch": {"weight_broadcast": {"type": "nccl"}},
             "train": {"trust_remote_code": True}}
    changed = {"infer": ("max_model_len", 1024), "orch": ("weight_broadcast_type", "nccl"),
               "train": ("trust_remote_code", True)}
    for name, body in files.items():  # the bundled example's file with one key changed
        full = yaml.safe_load(cli.example_path(name).read_text()) | body
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(full))
        got = yaml.safe_load(run(capsys, "serve", "--dry-run", f"--{name}", str(tmp_path / f"{name}.yaml"))[1])
        key, value = changed[name]
        assert got[key] != base[key] and (value is None or got[key] == value), (name, got[key], base[key])
    assert run(capsys, "serve", "--status")[0] == 1  # none runs
    code, out, _ = run(capsys, "serve", "--stop")
    assert code == 0 and "no warm pool is running" in out
    assert run(capsys, "serve", "--stop", "--dry-run")[0] == 2


def test_serve_no_trainer_and_grpo_train_warm_trainer(capsys, tmp_path, monkeypatch):
    """`tidal serve --no-trainer` starts the pool without its kept trainer (`keep_trainer` False; default True);
    `tidal grpo-train --warm-trainer SOCKET` relays to the pool's kept trainer (`run_forked` on that socket, the
    run's config and directory) and takes no `--start-gate`."""
    from tidal.colocate import pool, warm_trainer

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))
    seen: list[bool] = []
    monkeypatch.setattr(pool, "serve", lambda co, keep_trainer=True: seen.append(keep_trainer) or 0)
    assert run(capsys, "serve", "--no-trainer")[0] == 0 and run(capsys, "serve")[0] == 0
    assert seen == [False, True]
    relayed: list[tuple[Any, ...]] = []
    monkeypatch.setattr(warm_trainer, "run_forked", lambda sock, cfg, run_dir: relayed.append(
        (sock, cfg.learning_rate, run_dir)) or 7)
    code, _, _ = run(capsys, "grpo-train", "--warm-trainer", str(tmp_path / "s.sock"), "--output-dir",
                     str(tmp_path / "r"), "--train.learning_rate", "0.0042")
    assert code == 7 and relayed == [(tmp_path / "s.sock", 0.0042, tmp_path / "r")]
    code, _, err = run(capsys, "grpo-train", "--warm-trainer", str(tmp_path / "s.sock"), "--output-dir",
                       str(tmp_path / "r"), "--start-gate", str(tmp_path / "g"))
    assert code == 2 and "--warm-trainer" in err and len(relayed) == 1


# --- tidal eval --------------------------------------------------------------------------------------------------

EVAL = {"--model": ("model", TINY), "--adapter": ("adapters", ["runs/a"]), "--no-base": ("base", False),
        "--num-examples": ("num_examples", 7), "--seed": ("seed", 3), "--no-greedy": ("greedy", False),
        "--samples": ("samples", 4), "--temperature": ("temperature", 0.7), "--max-tokens": ("max_tokens", 33),
        "--max-model-len": ("max_model_len", 300), "--address": ("address", "http://127.0.0.1:9"),
        "--serve": ("serve", "lora"), "--port": ("port", 8125), "--dtype": ("dtype", "bfloat16"),
        "--show-samples": ("show_samples", 5), "--out": ("out", "x.json"), "--no-policy-check": ("policy_check", False),
        "--resume": ("resume", True),
        "--chat-template": ("chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")}
"""flag -> (EvalConfig key, a value other than its default); `eval_argv` adds what gives it effect (`--samples` for
`--temperature`, `--no-greedy` and `--seed`, which seeds the sampled completions; `--temperature` alone is refused,
issue 66)."""


def eval_argv(flag: str) -> list[str]:
    key, value = EVAL[flag]
    argv = [flag] if isinstance(value, bool) else [flag, value[0] if isinstance(value, list) else str(value)]
    return [*argv, *(["--samples", "2"] if flag in ("--no-greedy", "--temperature", "--seed") else []),
            *(["--adapter", "runs/b"] if flag == "--no-base" else [])]


@pytest.mark.parametrize("flag", sorted(EVAL))
def test_eval_flag_sets_its_key(flag, capsys, monkeypatch):
    """Each flag sets its `EvalConfig` key in what `tidal eval` scores with (`evaluate` recorded, nothing starts)."""
    import tidal.evaluate.report as report
    import tidal.evaluate.run as run_mod
    from tidal.config.evaluate import EvalConfig

    seen: list[Any] = []
    monkeypatch.setattr(run_mod, "evaluate", lambda cfg, progress=True: seen.append((cfg, progress)) or "r")
    monkeypatch.setattr(report, "write_json", lambda result, path: None)
    monkeypatch.setattr(report, "print_report", lambda result, path: None)
    assert run(capsys, "eval", "--env", "addition", *eval_argv(flag))[0] == 0
    key, value = EVAL[flag]
    assert getattr(seen[0][0], key) == value != getattr(EvalConfig(), key) and seen[0][1] is True


def test_eval_env_flags_config_file_quiet_and_dry_run(capsys, monkeypatch, tmp_path):
    import tidal.evaluate.report as report
    import tidal.evaluate.run as run_mod

    seen: list[Any] = []
    monkeypatch.setattr(run_mod, "evaluate", lambda cfg, progress=True: seen.append((cfg, progress)) or "r")
    monkeypatch.setattr(report, "write_json", lambda result, path: None)
    monkeypatch.setattr(report, "print_report", lambda result, path: None)
    cfg_file = tmp_path / "eval.yaml"
    cfg_file.write_text("samples: 3\nenv: {id: addition}\n")
    assert run(capsys, "eval", str(cfg_file), "--quiet", "--env-args", "{eval_size: 8}", "--env-address",
               "http://127.0.0.1:9", "--chat-template-kwargs", "{enable_thinking: false}")[0] == 0
    cfg, progress = seen[0]
    assert cfg.samples == 3 and cfg.env.args == {"eval_size": 8} and cfg.env.address == "http://127.0.0.1:9"
    assert cfg.chat_template_kwargs == {"enable_thinking": False} and progress is False
    monkeypatch.setattr(run_mod, "evaluate", lambda *a, **k: pytest.fail("--dry-run started an evaluation"))
    code, out, _ = run(capsys, "eval", "--env", "{id: addition, args: {eval_size: 8}}", "--dry-run")
    assert code == 0 and "1 rows, 8 examples: checked, nothing started" in out


# --- tidal export ------------------------------------------------------------------------------------------------

def test_export_base_names_the_adapters_base_model(capsys, tmp_path):
    """`--base` replaces an adapter's `base_model_name_or_path` (here one that does not exist: exit 2 without it);
    SOURCE, --gguf and --out: tests/unit/test_gguf_export.py::test_tidal_export_refuses_bad_input_with_exit_2."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.unit.test_gguf_export import tiny_llama

    base = tmp_path / "base"
    tiny_llama(base)  # a byte-level BPE model the GGUF export takes (the bundled one's tokenizer is not)
    adapter = tmp_path / "adapter"
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), LoraConfig(r=2, target_modules=["q_proj"]))
    peft.save_pretrained(str(adapter))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/no/such/model"}))
    code, _, err = run(capsys, "export", str(adapter), "--gguf", "f32", "--out", str(tmp_path / "a.gguf"))
    assert code == 2 and "/no/such/model" in err and "--base" in err
    code, _, err = run(capsys, "export", str(adapter), "--gguf", "f32", "--out", str(tmp_path / "a.gguf"),
                       "--base", str(base))
    assert code == 0 and (tmp_path / "a.gguf").is_file(), err


# --- the table ---------------------------------------------------------------------------------------------------

GRPO_RUN = test_grpo_resume_output_dir_and_model
ORCH_RUN = test_grpo_orch_runs_in_the_output_dir
TRAIN_RUN = test_grpo_train_output_dir_and_start_gate
CHECKS: dict[str, dict[str, Any]] = {
    "grpo": {"--train": test_grpo_files, "--infer": test_grpo_files, "--orch": test_grpo_files,
             "--dry-run": test_grpo_dry_run_starts_nothing, "--resume": GRPO_RUN, "--output-dir": GRPO_RUN,
             "--model": GRPO_RUN, "--infer-restarts": test_grpo_infer_restarts_and_startup,
             "--startup": test_grpo_infer_restarts_and_startup},
    "grpo-infer": {"config": test_grpo_infer, "--dry-run": test_grpo_infer, "--model": test_grpo_infer},
    "grpo-orch": {"config": test_grpo_orch_dry_run, "--dry-run": test_grpo_orch_dry_run, "--resume": ORCH_RUN,
                  "--output-dir": ORCH_RUN, "--model": test_grpo_orch_dry_run},
    "grpo-train": {"config": test_grpo_train_dry_run, "--dry-run": test_grpo_train_dry_run,
                   "--resume": test_grpo_train_dry_run, "--output-dir": TRAIN_RUN,
                   "--model": test_grpo_train_dry_run, "--start-gate": TRAIN_RUN,
                   "--warm-trainer": test_serve_no_trainer_and_grpo_train_warm_trainer},
    "sft": {"config": test_sft_bundled_config_dry_run, "--dry-run": test_sft_bundled_config_dry_run,
            "--output-dir": test_sft_output_dir_is_where_the_result_goes, "--model": test_sft_bundled_config_dry_run},
    "env-server": {"env_id": test_env_server, "--args": test_env_server, "--host": test_env_server,
                   "--port": test_env_server},
    "report": {"RUN_DIR": test_report, "--out": test_report},
    "serve-tinker": {flag: test_serve_tinker for flag in TINKER},
    "serve": {**dict.fromkeys(("--train", "--infer", "--orch", "--model", "--stop", "--status", "--dry-run"),
                              test_serve_flags), "--no-trainer": test_serve_no_trainer_and_grpo_train_warm_trainer},
    "eval": {**{flag: test_eval_flag_sets_its_key for flag in EVAL},
             **{flag: test_eval_env_flags_config_file_quiet_and_dry_run for flag in (
                 "config", "--env", "--env-args", "--env-address", "--chat-template-kwargs", "--quiet", "--dry-run")}},
    "export": dict.fromkeys(("SOURCE", "--gguf", "--out", "--base"), test_export_base_names_the_adapters_base_model),
}
"""command -> flag in its --help -> the test that checks the flag's effect."""


def test_every_flag_in_the_help_has_a_check(capsys):
    names = commands(capsys)
    assert sorted(names) == sorted(CHECKS), "a command without an entry in CHECKS (or one that is gone)"
    for name in names:
        assert flags(help_text(capsys, name)) == set(CHECKS[name]), f"tidal {name}: flags and CHECKS differ"


def test_dotted_overrides_need_a_known_component(capsys):
    """Not in --help, but flags too: `--COMPONENT.KEY VALUE` for the components a command runs."""
    code, _, err = run(capsys, "grpo-orch", "--dry-run", "--train.learning_rate", "1")
    assert code == 2 and "override --train.learning_rate: this command takes overrides for orch" in err
