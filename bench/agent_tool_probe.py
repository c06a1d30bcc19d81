"""Will SmolLM2 call the calculator? Tool-call rate and reward of candidate prompts before any training.

One vLLM server (`tidal grpo-infer`, SmolLM2-135M-Instruct); for each candidate way of showing the `add` tool (the
tool block tidal's `tool_prompt: system` writes, the calculator program's own system prompt, a one-shot
demonstration), `--problems` addition problems (`--low`..`--high`) x `--n` samples at temperature 1 of <=
`--max-tokens` tokens, through vLLM's own chat endpoint (the model's chat template; the `system` candidates'
messages rewritten by `tidal.envs.agent.toolprompt.with_tools_in_system`, as the endpoint renders them). A sample
that calls `add` (Hermes `<tool_call>`, parsed by `tidal.envs.tools.parse_tool_calls`) gets the tool's result as the
program would send it and one more sample; reward: the addition task's (the last integer of the last answer is
A + B). Printed per candidate: call rate, calls with the right operands, reward. bench/AGENT-LEARN.md quotes it.

    flock /tmp/tidal-heavy.lock python bench/agent_tool_probe.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))
import harness  # noqa: E402 - the benches' one harness (tidal.procs)
from examples.agent.calc_agent import SYSTEM, TOOLS  # noqa: E402

from tidal.envs.agent.toolprompt import with_tools_in_system  # noqa: E402
from tidal.envs.tools import parse_tool_calls  # noqa: E402

SHOT: list[dict[str, Any]] = [{"role": "user", "content": "What is 12 + 30? Answer with a number."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {
            "name": "add", "arguments": json.dumps({"a": 12, "b": 30})}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "42"},
        {"role": "assistant", "content": "42"}]
PLAIN_SYSTEM = "You have a calculator tool `add`. Always use it to add numbers, then answer with its result."


def candidates(question: str) -> dict[str, tuple[list[dict[str, Any]], bool]]:
    """name -> (messages in API form, tools rendered by tidal's system block)."""
    q = {"role": "user", "content": question}
    return {
        "system: block only": ([q], True),
        "system: block + calc prompt": ([{"role": "system", "content": SYSTEM}, q], True),
        "system: block + plain prompt + one shot": ([{"role": "system", "content": PLAIN_SYSTEM}, *SHOT, q], True),
        "system: block + one shot": ([*SHOT, q], True),
        "program: calc prompt (last run)": ([{"role": "system", "content": SYSTEM}, q], False),
    }


def render(messages: list[dict[str, Any]], system_tools: bool) -> list[dict[str, Any]]:
    if system_tools:
        return with_tools_in_system(messages, TOOLS)
    return with_tools_in_system(messages, None)  # calls / results written as text; no tool block


def reward(text: str, answer: int) -> float:
    import re

    nums = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(nums) and int(nums[-1]) == answer)


async def chat(http: Any, url: str, model: str, messages: list[dict[str, Any]], n: int, max_tokens: int) -> list[str]:
    r = await http.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "n": n,
                                                            "temperature": 1.0, "max_tokens": max_tokens})
    r.raise_for_status()
    return [c["message"]["content"] or "" for c in r.json()["choices"]]


async def one(http: Any, url: str, model: str, a: int, b: int, name: str, msgs: list[dict[str, Any]], sys_tools: bool,
              n: int, max_tokens: int) -> list[dict[str, Any]]:
    first = await chat(http, url, model, render(msgs, sys_tools), n, max_tokens)
    out = []
    for text in first:
        body, calls = parse_tool_calls(text, "hermes")
        ok = [c for c in calls if c.error is None and c.name == "add"]
        rec: dict[str, Any] = {"called": bool(ok), "right_args": False, "reward": reward(text, a + b), "first": text}
        if ok:
            args = ok[0].arguments
            rec["right_args"] = {str(args.get("a")), str(args.get("b"))} == {str(a), str(b)}
            try:
                result = str(int(args["a"]) + int(args["b"]))
            except (KeyError, TypeError, ValueError):
                result = "error: a and b must be integers"
            turn = [*msgs, {"role": "assistant", "content": body, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "add", "arguments": json.dumps(args)}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": result}]
            second = (await chat(http, url, model, render(turn, sys_tools), 1, max_tokens))[0]
            rec["reward"], rec["second"] = reward(second, a + b), second
        out.append(rec)
    return out


async def probe(args: argparse.Namespace, url: str) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    problems = [(rng.randint(args.low, args.high), rng.randint(args.low, args.high)) for _ in range(args.problems)]
    async with httpx.AsyncClient(timeout=600) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        res: dict[str, Any] = {}
        for name, (msgs, sys_tools) in candidates("What is A + B? Answer with a number.").items():
            t0 = time.monotonic()
            jobs = []
            for a, b in problems:
                m = [*msgs[:-1], {"role": "user", "content": f"What is {a} + {b}? Answer with a number."}]
                jobs.append(one(http, url, model, a, b, name, m, sys_tools, args.n, args.max_tokens))
            recs = [r for group in await asyncio.gather(*jobs) for r in group]
            k = len(recs)
            res[name] = {"samples": k, "call_rate": sum(r["called"] for r in recs) / k,
                         "right_args": sum(r["right_args"] for r in recs) / k,
                         "reward": sum(r["reward"] for r in recs) / k, "s": time.monotonic() - t0,
                         "example": recs[0]}
            print(json.dumps({name: {k2: v for k2, v in res[name].items() if k2 != "example"}}), flush=True)
            print("   e.g.", json.dumps(recs[0])[:400], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tidal:smollm2-135m-instruct")
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--low", type=int, default=100)
    ap.add_argument("--high", type=int, default=999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8601)
    ap.add_argument("--work", default="/tmp/tidal-agent-tool-probe")
    ap.add_argument("--json", default=str(REPO / "bench" / "agent_tool_probe.json"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.model", args.model, "--infer.port",
           str(args.port), "--infer.max_model_len", "1024", "--infer.enable_lora", "false"]
    child = harness.start("vllm", cmd, work / "vllm.log", env=harness.child_env(REPO))
    try:
        harness.wait_ready(child, f"http://127.0.0.1:{args.port}/health", 900)
        import os

        load0 = os.getloadavg()[0]
        res = asyncio.run(probe(args, f"http://127.0.0.1:{args.port}"))
    finally:
        harness.stop(child)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_1min_at_start": load0,
           "args": vars(args), "candidates": res}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"agent-tool-probe: wrote {args.json}", flush=True)


if __name__ == "__main__":
    main()
