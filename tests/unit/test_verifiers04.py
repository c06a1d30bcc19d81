"""tidal's adapter of verifiers 0.4 (`verifiers.v1` tasksets; `tidal.envs.verifiers.v1`), while the venv keeps the
classic API (< 0.4, tested beside this in test_verifiers_env.py / test_verifiers_multiturn.py).

`make setup-dev` installs 0.4 into `.venv/verifiers04` (scripts/setup_env.sh; `TIDAL_VERIFIERS04` points elsewhere).
Two taskset packages are built here and pip-installed into a temporary directory: `tidal-vf4-echo` (single-turn,
weighted `@vf.reward`s, one over `trace.is_truncated`, a `@vf.metric`, a taskset config field) and `tidal-vf4-tools`
(a per-rollout `Toolset` with its own `State` and `setup_task`, a `@vf.stop`, rewards over the tool messages). One
subprocess with verifiers 0.4 first on its path (tests/unit/vf04_probe.py) loads both through `verifiers:NAME`, scores
completions, plays tool rollouts through the session tidal's tool loop drives, and checks the refusals; the tests
read its report. No vLLM here: tests/e2e/test_verifiers04_run.py (slow) runs a 0.4 toolset through `tidal grpo`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VF04 = Path(os.environ.get("TIDAL_VERIFIERS04") or Path(sys.prefix) / "verifiers04")

ECHO = '''
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=0.75)
    async def mentioned(self, task: EchoData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.25)
    async def exact(self, task: EchoData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=-0.5)
    async def truncated(self, trace: vf.Trace) -> float:
        return float(trace.is_truncated)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class EchoConfig(vf.TasksetConfig):
    n: int = 3


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for i in range(self.config.n):
            yield EchoTask(EchoData(prompt=f"Say {7 * i + 1}", system_prompt="Answer with a number.",
                                    answer=str(7 * i + 1)))


__all__ = ["EchoTaskset"]
'''

TOOLS = '''
import verifiers.v1 as vf


class RevState(vf.State):
    calls: int = 0


class Rev(vf.Toolset[vf.ToolsetConfig, RevState]):
    async def setup_task(self, task) -> None:
        self.word = task.data.answer

    @vf.tool
    async def hint(self) -> str:
        """The answer (set up per task)."""
        return self.word

    @vf.tool
    async def reverse(self, text: str) -> str:
        """Reverse a text."""
        self.state.calls += 1
        return text[::-1]


class RevData(vf.TaskData):
    answer: str


class RevTask(vf.Task[RevData]):
    @classmethod
    def toolsets(cls, config):
        return [Rev(vf.ToolsetConfig())]

    @vf.reward
    async def solved(self, task: RevData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)

    @vf.stop
    async def asked_to_stop(self, trace: vf.Trace) -> bool:
        return any("STOP" in c.arguments for m in trace.assistant_messages for c in m.tool_calls or [])


class RevConfig(vf.TasksetConfig):
    words: list[str] = ["abc"]


class RevTaskset(vf.Taskset[RevTask, RevConfig]):
    def load(self):
        for w in self.config.words:
            yield RevTask(RevData(prompt=f"Reverse {w[::-1]} with the tool.", answer=w))


__all__ = ["RevTaskset"]
'''


def build(src: Path, name: str, code: str) -> None:
    module = name.replace("-", "_")
    (src / name / module).mkdir(parents=True)
    (src / name / module / "__init__.py").write_text(code)
    (src / name / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "0.1.0"
        [tool.setuptools]
        packages = ["{module}"]
    """))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not (VF04 / "verifiers" / "v1").is_dir():
        pytest.skip(f"verifiers 0.4 is not installed in {VF04} (make setup-dev installs it)")
    tmp = tmp_path_factory.mktemp("vf04")
    src, site = tmp / "src", tmp / "site"
    build(src, "tidal-vf4-echo", ECHO)
    build(src, "tidal-vf4-tools", TOOLS)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--no-build-isolation", "--target", str(site), str(src / "tidal-vf4-echo"),
                          str(src / "tidal-vf4-tools")], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    path = os.pathsep.join([str(site), str(VF04), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("vf04_probe.py"))], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-5000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_it_runs_verifiers_04(report):
    assert report["version"].startswith("0.4"), report["version"]


def test_single_turn_taskset_prompts_and_weighted_rewards(report):
    assert report["echo_type"] == "VerifiersV1Env" and report["echo_tooling"]
    answer = report["echo_answer"]
    assert report["echo_prompt"] == [{"role": "system", "content": "Answer with a number."},
                                     {"role": "user", "content": f"Say {answer}"}]
    assert report["echo_scores"] == [0.75, 0.0, 1.0]  # mentioned 0.75 + exact 0.25
    assert report["echo_rollout_scores"] == [1.0, 0.5], "a rollout cut at the token budget is trace.is_truncated"


def test_toolset_tools_calls_state_stop_and_scores(report):
    assert report["tool_names"] == ["rev_hint", "rev_reverse"]
    assert report["tool_params"]["properties"]["text"]["type"] == "string"
    assert report["hint"] == report["tool_answer"], "setup_task ran on the rollout's own toolset"
    assert report["good_roles"] == ["assistant", "tool", "assistant"]
    tool = report["good_tool"]
    assert tool["role"] == "tool" and tool["name"] == "rev_reverse" and tool["tool_call_id"] == report["good_call_id"]
    assert report["good_state_calls"] == 1, "the toolset's State is the rollout's"
    assert report["bad_tool"] == "q"
    assert report["capped_turns"] == 3, "agent.max_turns ends the rollout"
    assert report["stopped_roles"] == ["assistant"], "the task's @vf.stop ended the rollout"
    assert report["unknown_tool"].startswith("error: unknown tool 'nope'")
    assert report["tool_scores"] == [1.5, 0.5, 0.5]  # solved 1 + used_tool 0.5


def test_unsupported_features_are_refused_by_name(report):
    assert "'rt'" in report["refuse_runtime"] and "needs a runtime" in report["refuse_runtime"]
    assert "@vf.intercept hooks ['rewrite']" in report["refuse_intercept"]
    assert "infinite taskset" in report["refuse_infinite"]
    assert "agent settings ['harness']" in report["refuse_agent"]
    assert "bad args" in report["refuse_args"] and "bogus" in report["refuse_args"]
    assert "tidal-vf4-nothing" in report["refuse_missing"]
