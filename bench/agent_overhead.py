"""What the agent endpoint costs: the same multi-turn conversations through the endpoint and through the in-process
tool loop, interleaved in one invocation (bench/AGENT-OVERHEAD.md).

One vLLM server (`tidal grpo-infer`, SmolLM2-135M-Instruct by default) and one `InferenceClient` in this process
serve every side. The workload is the calculator agent of examples/agent/calc_agent.py: "What is A + B?" (the
`addition` task, 3-digit operands) under the program's system prompt and `add` tool, the tool's result sent back as a
`tool` message, at most 3 model turns. A "step" is the rollout phase of one training step: `--prompts` examples x
`--generations` rollouts, all groups at once, as the orchestrator samples a batch. Sides:
- `toolloop`: `tidal.orchestrator.toolloop.tool_group` on an environment whose prompt is the program's system
  prompt + the task's question and whose `Tooling` is the same `add` (Hermes format, 2 tool rounds at most);
- `endpoint-fn`: `tidal.orchestrator.agentloop.agent_group` running the program as a function
  (`examples.agent.calc_agent:main`, in a worker thread, through the `openai` SDK and HTTP);
- `endpoint-cmd`: the same program as a command (one Python process per session: `python calc_agent.py`).
The trainer step is the same on every side (the rows have the same shape), so a rollout phase's ratio bounds the
per-step ratio from above; the report also gives the per-step ratio with a measured trainer step time
(`--train-step-s`, from bench/AGENT-LEARN.md) added to both sides.
Near-greedy sampling by default (temperature 0.001: vLLM refuses n > 1 at 0): every side then samples the same
conversations (the report checks the tokens and turns of each side). Rounds run the sides in a rotating order
(A B C, B C A, C A B, ...), each round on the same examples, so load on the shared machine falls on every side
alike; per-round ratios to the tool loop give min / median / max.

    flock /tmp/tidal-vllm.lock python bench/agent_overhead.py --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))
import harness  # noqa: E402 - the benches' one harness (tidal.procs)

MODEL = "tidal:smollm2-135m-instruct"
SIDES = ("toolloop", "endpoint-fn", "endpoint-cmd")


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    from examples.agent.calc_agent import add as program_add

    return program_add(a, b)


def envs(low: int, high: int) -> dict[str, Any]:
    """The three sides' environments (module doc)."""
    from examples.agent.calc_agent import SYSTEM

    from tidal.envs.addition import Addition
    from tidal.envs.agent.env import make_agent
    from tidal.envs.base import Example
    from tidal.envs.tools import Tooling

    class CalcTask(Addition):
        """Addition with the program's system prompt and the `add` tool (the tool loop's side)."""

        id = "calc-addition"
        tooling = Tooling([add], fmt="hermes", max_iterations=2)

        def problem(self, a: int, b: int) -> Example:
            ex = super().problem(a, b)
            return Example(prompt=[{"role": "system", "content": SYSTEM}, *ex.prompt], answer=ex.answer,
                           info=ex.info)

    task = {"id": "addition", "args": {"low": low, "high": high}}

    def build(id_: str, args: dict[str, Any]) -> Any:
        return Addition(**args)

    return {"toolloop": CalcTask(low, high),
            "endpoint-fn": make_agent({"function": "examples.agent.calc_agent:main", "task": task, "max_calls": 4,
                                       "timeout_s": 600}, build),
            "endpoint-cmd": make_agent({"command": [sys.executable, str(REPO / "examples/agent/calc_agent.py")],
                                        "task": task, "max_calls": 4, "timeout_s": 600}, build)}


async def one_step(side: str, env: Any, client: Any, model: str, examples: list[Any], prompts: list[list[int]],
                   args: argparse.Namespace, sampling: Any) -> dict[str, Any]:
    """One rollout phase of `side`: every group at once; its seconds, tokens, turns and rewards."""
    from tidal.orchestrator.agentloop import agent_group
    from tidal.orchestrator.evaluation import turns
    from tidal.orchestrator.toolloop import tool_group

    group = tool_group if side == "toolloop" else agent_group
    t0 = time.monotonic()
    cpu0 = os.times()
    groups = await asyncio.gather(*(group(client, model, p, args.generations, sampling, 512, args.seed + i,
                                          args.temperature, env, ex)
                                    for i, (p, ex) in enumerate(zip(prompts, examples, strict=True))))
    seconds = time.monotonic() - t0
    cpu1 = os.times()
    comps = [c for g in groups for c in g]
    rewards = [r for ex, g in zip(examples, groups, strict=True) for r in env.score_rollouts(ex, g)]
    return {"side": side, "seconds": seconds, "own_cpu_s": (cpu1.user + cpu1.system + cpu1.children_user +
                                                             cpu1.children_system) - (cpu0.user + cpu0.system +
                                                                                       cpu0.children_user +
                                                                                       cpu0.children_system),
            "sampled_tokens": sum(sum(c.mask or [1] * len(c.token_ids)) for c in comps),
            "row_tokens": sum(len(c.token_ids) for c in comps),
            "turns": statistics.mean(turns(c.mask) for c in comps), "reward": statistics.mean(rewards),
            "failures": sum(c.env_error is not None for c in comps), "load": os.getloadavg()[0],
            "ids": [list(c.token_ids) for c in comps]}


async def bench(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from tidal.config.orch import SamplingSection
    from tidal.config.orch_sections import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient

    client = VllmClient(ClientSection(base_url=[url]))
    model = (await client.wait_ready())[0]
    sampling = SamplingSection(max_tokens=args.max_tokens)  # the temperature goes to the groups (0: greedy)
    sides = {k: v for k, v in envs(args.low, args.high).items() if k in args.sides}
    rounds: list[list[dict[str, Any]]] = []
    for r in range(args.rounds + 1):  # round 0 warms every side up (imports, the endpoint's start, caches)
        rng = random.Random(args.seed * 1000 + r)
        examples = [sides[args.sides[0]].sample(rng) for _ in range(args.prompts)]
        order = args.sides[r % len(args.sides):] + args.sides[:r % len(args.sides)]
        done = []
        for side in order:
            env = sides[side]
            exs = examples if side != "toolloop" else [env.problem(ex.info["a"], ex.info["b"]) for ex in examples]
            tools = env.tooling.schemas if side == "toolloop" else None
            prompts = [await client.tokenize_prompt(model, ex.prompt, tools) for ex in exs]
            done.append(await one_step(side, env, client, model, exs, prompts, args, sampling))
            print(f"agent-overhead: round {r} {side}: {done[-1]['seconds']:.2f} s, {done[-1]['sampled_tokens']} "
                  f"sampled tokens, {done[-1]['turns']:.2f} turns, load {done[-1]['load']:.1f}", flush=True)
        by = {d["side"]: d for d in done}
        for d in done:  # rows equal, token for token, to the tool loop's (greedy: the same conversations)
            d["equal_rows"] = sum(a == b for a, b in zip(by["toolloop"]["ids"], d.pop("ids"), strict=True)) \
                if d is not by["toolloop"] else len(d["ids"])
        by["toolloop"].pop("ids")
        if r > 0:
            rounds.append(done)
    for s in sides.values():
        if hasattr(s, "server"):
            await s.server.stop()
    await client.close()
    return {"model": model, "rounds": rounds}


class StubBackend:
    """A backend that answers at once (`--stub`): call 0 a Hermes tool call, later calls an answer; no engine, so a
    session's time is the endpoint's own cost (HTTP, JSON, the SDK, session stitching) and the program's."""

    CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'

    async def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return list(range(80))

    async def suffix(self, history: list[dict[str, Any]], new: list[dict[str, Any]], stop_id: int,
                     tools: list[dict[str, Any]] | None) -> list[int]:
        return list(range(12))

    def on_policy(self, params: dict[str, Any]) -> bool:
        return True

    async def sample(self, prompt_ids: list[int], max_tokens: int, call: int, params: dict[str, Any]) -> Any:
        from tidal.inference.protocol import Completion

        text = (self.CALL if call == 0 else "The answer is 42.") + "<|im_end|>"
        n = 24 if call == 0 else 6
        return Completion(list(range(n)), [-0.1] * n, text, "stop", [""] * (n - 1) + ["<|im_end|>"])


async def stub(args: argparse.Namespace) -> dict[str, Any]:
    """`--stub`: per side (endpoint-fn, endpoint-cmd) the seconds and this process's CPU seconds of
    `--prompts` x `--generations` sessions at once, each 2 calls, against `StubBackend`."""
    out: dict[str, Any] = {}
    sides = envs(args.low, args.high)
    rng = random.Random(args.seed)
    for side in [s for s in args.sides if s != "toolloop"]:
        env = sides[side]
        runs = []
        for r in range(args.rounds + 1):
            sessions = [env.new_session(env.sample(rng), 512) for _ in range(args.prompts * args.generations)]
            t0, c0 = time.monotonic(), os.times()
            await asyncio.gather(*(env.run_session(s, StubBackend()) for s in sessions))
            c1 = os.times()
            if r:
                runs.append({"seconds": time.monotonic() - t0, "calls": sum(s.calls for s in sessions),
                             "cpu_s": (c1.user + c1.system - c0.user - c0.system),
                             "children_cpu_s": (c1.children_user + c1.children_system - c0.children_user
                                                - c0.children_system),
                             "failures": sum(s.failure is not None for s in sessions)})
        await env.server.stop()
        out[side] = runs
        last = runs[-1]
        print(f"agent-overhead --stub {side}: {statistics.mean(x['seconds'] for x in runs):.2f} s for "
              f"{len(sessions)} sessions, {last['calls']} calls, {last['failures']} failures", flush=True)
    return out


def same_ids(rounds: list[list[dict[str, Any]]], side: str) -> tuple[int, int]:
    """(rows whose tokens equal the tool loop's, rows) over every round."""
    same = sum(d["equal_rows"] for done in rounds for d in done if d["side"] == side)
    total = sum(d["equal_rows"] for done in rounds for d in done if d["side"] == "toolloop")
    return same, total


def ratios(rounds: list[list[dict[str, Any]]], side: str) -> list[float]:
    return [by[side]["seconds"] / by["toolloop"]["seconds"] for by in ({d["side"]: d for d in done}
                                                                      for done in rounds) if side in by]


def mean_of(rounds: list[list[dict[str, Any]]], side: str, key: str) -> float:
    return statistics.mean(d[key] for done in rounds for d in done if d["side"] == side)


def report(args: argparse.Namespace, result: dict[str, Any], machine: str) -> str:
    rounds = result["rounds"]
    loads = [d["load"] for done in rounds for d in done]
    lines = [
        "# What the agent endpoint costs: the same conversations through the endpoint and the tool loop "
        "(`bench/agent_overhead.py`)", "",
        f"Written by bench/agent_overhead.py on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine}; "
        f"shared machine, 1-min load average during the rounds {min(loads):.1f}-{max(loads):.1f} (mean "
        f"{statistics.mean(loads):.1f}): compare the ratios of this one invocation only.", "",
        f"Command: `python bench/agent_overhead.py {' '.join(sys.argv[1:])}`", "",
        f"Workload: `{result['model']}` on one vLLM server (`tidal grpo-infer`); a step's rollout phase = "
        f"{args.prompts} examples x {args.generations} rollouts at once, the calculator agent of "
        f"examples/agent/calc_agent.py (addition {args.low}..{args.high}, `add` tool, <= 3 model turns, <= "
        f"{args.max_tokens} tokens a turn), temperature {args.temperature:g}; {len(rounds)} measured rounds after "
        f"one warm-up round, the sides in rotating order.", "",
        "| side | s/step mean | s/step min-max | ratio to tool loop min / median / max | sampled tokens/step | "
        "turns/rollout | reward | rows equal to the tool loop's | this process's CPU s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side in args.sides:
        secs = [d["seconds"] for done in rounds for d in done if d["side"] == side]
        rs = ratios(rounds, side)
        same, total = same_ids(rounds, side)
        ratio = ("1" if side == "toolloop" else
                 f"{min(rs):.3f} / {statistics.median(rs):.3f} / {max(rs):.3f}")
        lines.append(f"| {side} | {statistics.mean(secs):.2f} | {min(secs):.2f}-{max(secs):.2f} | {ratio} | "
                     f"{mean_of(rounds, side, 'sampled_tokens'):.0f} | {mean_of(rounds, side, 'turns'):.2f} | "
                     f"{mean_of(rounds, side, 'reward'):.3f} | {same}/{total} | "
                     f"{mean_of(rounds, side, 'own_cpu_s'):.2f} |")
    if args.train_step_s:
        base = mean_of(rounds, "toolloop", "seconds")
        per = {side: (statistics.median(ratios(rounds, side)) * base + args.train_step_s) / (base + args.train_step_s)
               for side in args.sides if side != "toolloop"}
        lines += ["", f"Per training step, with a trainer step of {args.train_step_s:g} s added to both sides (the "
                  f"same rows, so the same trainer work; the tool loop's mean rollout phase {base:.2f} s): "
                  + "; ".join(f"{side} {r:.3f}" for side, r in per.items()) + " (median ratio x tool loop + trainer, "
                  "over tool loop + trainer)."]
    lines += ["", "Per round (seconds, in the order run):", ""]
    for i, done in enumerate(rounds, 1):
        lines.append(f"- round {i}: " + ", ".join(f"{d['side']} {d['seconds']:.2f}" for d in done))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.001,
                    help="0.001: argmax in practice (vLLM refuses n > 1 at temperature 0)")
    ap.add_argument("--low", type=int, default=100)
    ap.add_argument("--high", type=int, default=999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-step-s", type=float, default=0.0, help="a trainer step's seconds (0: no per-step row)")
    ap.add_argument("--stub", action="store_true", help="the endpoint's own cost: a backend that answers at once, "
                    "no vLLM (prints per side; writes --json with a -stub suffix)")
    ap.add_argument("--report-only", action="store_true", help="write --out from --json, running nothing")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--port", type=int, default=8560)
    ap.add_argument("--work", default="/tmp/tidal-bench-agent-overhead")
    ap.add_argument("--json", default=str(REPO / "bench" / "agent_overhead.json"))
    ap.add_argument("--out", default=str(REPO / "bench" / "AGENT-OVERHEAD.md"))
    args = ap.parse_args()
    if "toolloop" not in args.sides:
        ap.error("--sides must include toolloop (the ratios are to it)")
    args.sides = ["toolloop", *(s for s in args.sides if s != "toolloop")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.report_only:  # the report again from --json (e.g. with --train-step-s measured since)
        saved = json.loads(Path(args.json).read_text())
        train_step_s = args.train_step_s
        args.__dict__.update({k: v for k, v in saved["args"].items() if k != "train_step_s"})
        args.train_step_s, sys.argv[1:] = train_step_s, saved.get("argv", [])
        Path(args.out).write_text(report(args, saved, f"{os.cpu_count()} CPUs"))
        return
    if args.stub:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
        res = asyncio.run(stub(args))
        Path(args.json).with_name(Path(args.json).stem + "-stub.json").write_text(json.dumps(res, indent=1))
        return
    cmd = [sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.model", args.model, "--infer.port",
           str(args.port), "--infer.max_model_len", "512", "--infer.enable_lora", "false"]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    child = harness.start("vllm", cmd, work / "vllm.log", env=harness.child_env(REPO))
    try:
        harness.wait_ready(child, f"http://127.0.0.1:{args.port}/health", 900)
        result = asyncio.run(bench(args, f"http://127.0.0.1:{args.port}/v1"))
    finally:
        harness.stop(child)
    Path(args.json).write_text(json.dumps({"args": vars(args), "argv": sys.argv[1:], **result}, indent=1))
    Path(args.out).write_text(report(args, result, f"{os.cpu_count()} CPUs"))
    print(f"agent-overhead: wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
