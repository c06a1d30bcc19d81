"""`tidal eval --resume` (`tidal.evaluate.partial`): the rows of an unfinished invocation's partial report are kept
when their target and the settings are unchanged; with every row kept the report is written and no server starts;
the refusals (no partial report, other settings, an unreadable file) exit 2 before anything starts. The rows written
as they finish by a real invocation that dies: tests/integration/test_eval_command.py (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import MODEL
from tests.unit.test_eval_cli import adapter_of
from tidal.config.evaluate import EvalConfig
from tidal.evaluate import partial
from tidal.evaluate.run import Row
from tidal.evaluate.targets import Target
from tidal.monitor.eval_metrics import summarize

N = 6


def eval_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidal.cli", "eval", *args], capture_output=True, text=True,
                          timeout=300)


def scored_row(target: Target, rng: np.random.Generator) -> Row:
    """A row as score_row leaves it: greedy metrics of random 0/1 rewards, with the target's fingerprint."""
    rewards = rng.integers(0, 2, (N, 1)).astype(float).tolist()
    metrics = summarize(rewards, [[5]] * N, [[False]] * N)
    return Row(target.label, None if target.adapter is None else str(target.adapter), greedy=metrics,
               rewards={"greedy": rewards}, seconds=float(rng.uniform(1, 9)), fingerprint=partial.fingerprint(target))


@pytest.fixture
def setup(tmp_path):
    from tidal.models.sources import resolve_model

    adapter = adapter_of(Path(resolve_model(MODEL)), tmp_path / "adapter")
    args = ["--model", MODEL, "--env", "reverse-text", "--num-examples", str(N), "--max-tokens", "8",
            "--adapter", str(adapter), "--out", str(tmp_path / "eval.json"), "--quiet"]
    cfg = EvalConfig(model=MODEL, env={"id": "reverse-text"}, num_examples=N, max_tokens=8, adapters=[str(adapter)],
                     out=str(tmp_path / "eval.json"))
    targets = [Target("base", None), Target(str(adapter), adapter.resolve())]
    return adapter, args, cfg, targets


def test_every_row_kept_writes_the_report_and_starts_no_server(tmp_path, setup):
    _, args, cfg, targets = setup
    rng = np.random.default_rng()
    rows = [scored_row(t, rng) for t in targets]
    partial.save(tmp_path / "eval.json", cfg, "merged", [asdict(r) for r in rows])
    done = eval_cli(*args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert [r["greedy"] for r in report["rows"]] == [r.greedy for r in rows]
    assert [r["seconds"] for r in report["rows"]] == [r.seconds for r in rows]  # kept, not scored again
    assert report["serve"] == "merged" and report["vllm_ready_s"] == 0
    assert not (tmp_path / "eval.json.partial").exists()  # removed once the report is written
    assert not (tmp_path / "eval-vllm.log").exists()  # no server was started


def test_resume_refusals_exit_2_before_anything_starts(tmp_path, setup):
    _, args, cfg, targets = setup
    none = eval_cli(*args, "--resume")
    assert none.returncode == 2 and "no partial report" in none.stderr and "nothing to resume" in none.stderr
    rows = [asdict(scored_row(t, np.random.default_rng())) for t in targets]
    partial.save(tmp_path / "eval.json", cfg.model_copy(update={"max_tokens": 16}), "merged", rows)
    other = eval_cli(*args, "--resume")
    assert other.returncode == 2, other.stderr[-2000:]
    assert "other settings (max_tokens: 16 then, 8 now)" in other.stderr
    (tmp_path / "eval.json.partial").write_text("{not json")
    broken = eval_cli(*args, "--resume")
    assert broken.returncode == 2 and "is not a partial report of tidal eval" in broken.stderr
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "eval-vllm.log").exists()


def test_an_adapter_changed_since_is_scored_again_and_unscored_keys_may_change(tmp_path, setup):
    adapter, _, cfg, targets = setup
    rng = np.random.default_rng()
    rows = [scored_row(t, rng) for t in targets]
    out = tmp_path / "eval.json"
    partial.save(out, cfg, "merged", [asdict(r) for r in rows])
    later = cfg.model_copy(update={"resume": True, "policy_check": False, "port": 8123, "base": True})
    serve, kept = partial.kept_rows(later, targets, out)
    assert serve == "merged" and set(kept) == {0, 1} and kept[1]["greedy"] == rows[1].greedy
    weights = adapter / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the same size, one bit of one weight changed: trained again
    weights.write_bytes(bytes(data))
    assert set(partial.kept_rows(later, targets, out)[1]) == {0}
    assert partial.kept_rows(cfg, targets, out) == (None, {})  # without resume: nothing kept
