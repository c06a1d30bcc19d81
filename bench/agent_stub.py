"""The agent endpoint's own cost, without an engine: `--prompts` x `--generations` sessions of a workload's program
(bench/agent_workloads.py) at once against a backend that answers at once (call 0 and 1: a Hermes tool call, later
calls an answer), so a session's time is the endpoint's (HTTP, JSON, session stitching) and the program's (its
interpreter and `import openai` as a command, the `openai` SDK). Also the command form's parts that are the program's
alone: `python -c pass` and `python -c "import openai"` as many times, at once, through `tidal.procs.run`; and the
function form's per-session client: `openai.OpenAI(...)` (httpx builds an SSL context for each) against one client's
`.with_options(base_url=..., api_key=...)` (which shares its HTTP client).

    python bench/agent_stub.py --workload calc --rounds 3 [--profile /tmp/agent.prof]

`--profile PATH`: cProfile of this process's event loop thread (the endpoint) over each side's measured rounds,
to PATH.SIDE.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


class StubBackend:
    """A backend that answers at once (module doc)."""

    def __init__(self, tool: str) -> None:
        self.call = ('<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>' if tool == "add" else
                     '<tool_call>{"name": "reverse", "arguments": {"text": "olleh"}}</tool_call>')

    async def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return list(range(80))

    async def suffix(self, history: list[dict[str, Any]], new: list[dict[str, Any]], stop_id: int,
                     tools: list[dict[str, Any]] | None) -> list[int]:
        return list(range(12))

    def on_policy(self, params: dict[str, Any]) -> bool:
        return True

    async def sample(self, prompt_ids: list[int], max_tokens: int, call: int, params: dict[str, Any],
                     on_text: Any = None) -> Any:
        from tidal.inference.protocol import Completion

        text = (self.call if call < 2 else "The answer is 42.") + "<|im_end|>"
        n = 24 if call < 2 else 6
        return Completion(list(range(n)), [-0.1] * n, text, "stop", [""] * (n - 1) + ["<|im_end|>"])


async def sessions(env: Any, task: Any, n: int, tool: str, rng: random.Random) -> dict[str, Any]:
    ss = [env.new_session(task.sample(rng), 4096) for _ in range(n)]
    t0, c0 = time.monotonic(), os.times()
    await asyncio.gather(*(env.run_session(s, StubBackend(tool)) for s in ss))
    c1 = os.times()
    return {"seconds": time.monotonic() - t0, "calls": sum(s.calls for s in ss),
            "cpu_s": c1.user + c1.system - c0.user - c0.system,
            "children_cpu_s": c1.children_user + c1.children_system - c0.children_user - c0.children_system,
            "failures": [s.failure for s in ss if s.failure is not None][:2]}


async def bare_programs(n: int) -> dict[str, Any]:
    """`python -c pass` and `python -c "import openai"`, `n` at once each, through `tidal.procs.run`."""
    from tidal.envs.agent.program import in_thread
    from tidal.procs import run

    out = {}
    for name, code in (("python -c pass", "pass"), ("python -c 'import openai'", "import openai")):
        t0, c0 = time.monotonic(), os.times()
        await asyncio.gather(*(in_thread(run, [sys.executable, "-c", code], 120, {}) for _ in range(n)))
        c1 = os.times()
        out[name] = {"seconds": time.monotonic() - t0,
                     "children_cpu_s": c1.children_user + c1.children_system - c0.children_user - c0.children_system}
    import openai

    base = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")
    for name, make in (("openai.OpenAI(...) in this process", lambda i: openai.OpenAI(
            base_url=f"http://127.0.0.1:9/s/{i}/v1", api_key="k")),
                       ("one client's .with_options(base_url=..., api_key=...)", lambda i: base.with_options(
                           base_url=f"http://127.0.0.1:9/s/{i}/v1", api_key="k"))):
        c0 = os.times()
        for i in range(n):
            make(i)
        c1 = os.times()
        out[name] = {"seconds": 0.0, "children_cpu_s": 0.0, "cpu_s": c1.user + c1.system - c0.user - c0.system}
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from agent_workloads import workload

    wl = workload(args.workload, "stub", Path(args.work), True)
    envs, task = wl.envs(), wl.build_task()
    tool = "add" if args.workload == "calc" else "reverse"
    out: dict[str, Any] = {}
    n = args.prompts * args.generations
    for side in args.sides:
        env, runs = envs[side], []
        prof = cProfile.Profile() if args.profile else None
        for r in range(args.rounds + 1):
            if prof is not None and r == 1:
                prof.enable()
            res = await sessions(env, task, n, tool, random.Random(r))
            if r:
                runs.append(res)
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{args.profile}.{side}")
        await env.server.stop()
        out[side] = runs
        print(f"agent-stub {side}: {statistics.mean(x['seconds'] for x in runs):.2f} s for {n} sessions, "
              f"{runs[-1]['calls']} calls, CPU {statistics.mean(x['cpu_s'] for x in runs):.2f} s here + "
              f"{statistics.mean(x['children_cpu_s'] for x in runs):.2f} s children, failures {runs[-1]['failures']}",
              flush=True)
    if "endpoint-cmd" in args.sides:
        out["bare"] = await bare_programs(n)
        for k, v in out["bare"].items():
            print(f"agent-stub {k} x {n}: {v['seconds']:.2f} s, children CPU {v['children_cpu_s']:.2f} s, CPU here "
                  f"{v.get('cpu_s', 0.0):.3f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["calc", "reverse"], default="calc")
    ap.add_argument("--sides", nargs="+", choices=["endpoint-fn", "endpoint-cmd"], default=["endpoint-fn",
                                                                                            "endpoint-cmd"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--work", default="/tmp/tidal-bench-agent-overhead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    res = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **res}, indent=1))


if __name__ == "__main__":
    main()
