"""What the agent endpoint costs: the same multi-turn conversations through the endpoint and through the in-process
tool loop, interleaved in one invocation, checked equal row for row (bench/AGENT-OVERHEAD.md).

One vLLM server (`tidal grpo-infer`) and one `VllmClient` in this process serve every side. The workload
(bench/agent_workloads.py: `calc`, SmolLM2 with a calculator agent; `reverse`, the bundled model writing tool calls)
is a plain `openai`-SDK agent program with a tool, at most 3 model turns, and its in-process twin. A "step" is the
rollout phase of one training step: `--prompts` examples x `--generations` rollouts, all groups at once, as the
orchestrator samples a batch, from drawing the prompt ids to the last rollout. Sides:
- `toolloop`: `tidal.orchestrator.toolloop.tool_group` on the twin (the program's prompt and tool);
- `endpoint-fn`: `tidal.orchestrator.agentloop.agent_group` running the program as a function (a worker thread, the
  `openai` SDK over HTTP to the endpoint);
- `endpoint-cmd`: the same program as a command (one Python process per session);
- `endpoint-fn-shared` (not by default): the program's loop with one `openai` client for all sessions
  (bench/agent_shared.py), so that its difference to `endpoint-fn` is the program's own client construction.

Like for like: every side samples at temperature 1 (`--temperature`) with the orchestrator's seeds (group i of round r
seeded `sample_seed(sampling, r, i)`, turn k of rollout i `turn_seed`: the tool loop's n-completion first request
and the endpoint's one request per call then draw with the same seeds), no per-turn cap (`sampling.max_tokens` null:
the tool loop caps a whole rollout, the endpoint each call; here both stop at `--seq-len`), so equal logits give equal
tokens. The bench compares every rollout's whole token row (prompt + completion) and mask with the tool loop's and
prints ratios only when all rows of every round are equal (`--allow-unequal` to print them anyway, flagged); float32
logits can still differ with the batch's composition. Rounds run the sides in a rotating order on the same examples
and seeds, so load on the shared machine falls on every side alike; per-round ratios give min / median / max. Also
recorded per side and step: this process's CPU seconds, its children's (the command's programs) and the vLLM
server's (its whole process tree).

Per training step (`--trainer TRAIN_YAML`): after each round's sides, one real trainer step
(bench/agent_trainstep.py: the policy built from that file as `tidal grpo` builds it, the orchestrator's
`build_batch`, `tidal.trainer.grpo.train_step`) on the tool loop's rows of the round, timed; where the rows are equal
it is every side's trainer work, so a side's step = its rollout phase + that step (the on-policy default runs them
one after the other). `--adapter DIR` merges a LoRA adapter into `--model` first (vLLM serves the merged model).

    flock /tmp/tidal-heavy.lock python bench/agent_overhead.py --workload calc --rounds 4
    flock /tmp/tidal-heavy.lock python bench/agent_overhead.py --workload calc --model SFT_DIR --adapter ADAPTER \
        --trainer examples/agent/smollm2/train.yaml --rounds 3
    python bench/agent_overhead.py --stub --workload calc   # the endpoint's own cost, no engine (agent_stub.py)
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

SIDES = ("toolloop", "endpoint-fn", "endpoint-cmd", "endpoint-fn-shared")


def cpu_of(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` and its living descendants (0 without it)."""
    import psutil

    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def tool_results(message: dict[str, Any]) -> int:
    """How many tool results `message` carries: a `tool` message one; a user turn of `<tool_response>` blocks (the
    `addition` twin's, `tool_prompt: system`) one a block."""
    if message.get("role") == "tool":
        return 1
    content = message.get("content")
    return content.count("<tool_response>") if message.get("role") == "user" and isinstance(content, str) else 0


async def one_step(side: str, env: Any, client: Any, model: str, examples: list[Any], seeds: list[int | None],
                   args: argparse.Namespace, sampling: Any, vllm_pid: int | None) -> dict[str, Any]:
    """One rollout phase of `side`: every group at once, from tokenizing the prompts (the orchestrator's
    `draw_prompts`) to the last rollout; seconds, CPU, tokens, turns, rewards and the rows."""
    from tidal.orchestrator.agentloop import agent_group
    from tidal.orchestrator.evaluation import turns
    from tidal.orchestrator.toolloop import tool_group

    exs = [env.prompted(ex) for ex in examples] if side == "toolloop" else examples
    tools = env.tooling.schemas if side == "toolloop" and env.render_tools else None
    group = tool_group if side == "toolloop" else agent_group
    t0, cpu0, v0 = time.monotonic(), os.times(), cpu_of(vllm_pid)
    prompts = await asyncio.gather(*(client.tokenize_prompt(model, ex.prompt, tools) for ex in exs))
    groups = await asyncio.gather(*(group(client, model, p, args.generations, sampling, args.seq_len, seed,
                                          args.temperature, env, ex)
                                    for p, ex, seed in zip(prompts, exs, seeds, strict=True)))
    seconds = time.monotonic() - t0
    cpu1, v1 = os.times(), cpu_of(vllm_pid)
    comps = [c for g in groups for c in g]
    rewards = [r for ex, g in zip(exs, groups, strict=True) for r in env.score_rollouts(ex, g)]
    calls = [sum(1 for m in c.messages or [] if m.get("role") == "assistant") for c in comps]
    tool_msgs = [sum(tool_results(m) for m in c.messages or []) for c in comps]
    return {"side": side, "seconds": seconds,
            "own_cpu_s": cpu1.user + cpu1.system - cpu0.user - cpu0.system,
            "children_cpu_s": cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system,
            "vllm_cpu_s": v1 - v0,
            "sampled_tokens": sum(sum(c.mask or [1] * len(c.token_ids)) for c in comps),
            "row_tokens": sum(len(c.token_ids) for c in comps),
            "turns": statistics.mean(turns(c.mask) for c in comps), "calls": statistics.mean(calls),
            "tool_messages": statistics.mean(tool_msgs),
            "with_tool_round": sum(t > 0 for t in tool_msgs), "reward": statistics.mean(rewards),
            "failures": sum(c.env_error is not None for c in comps), "load": os.getloadavg()[0],
            "_batch": (prompts, groups, rewards) if side == "toolloop" else None,
            "rows": [[*(c.prompt_ids or p), *c.token_ids] for p, g in zip(prompts, groups, strict=True) for c in g],
            "masks": [[0] * len(c.prompt_ids or p) + list(c.mask or [1] * len(c.token_ids))
                      for p, g in zip(prompts, groups, strict=True) for c in g],
            "lps": [[0.0] * len(c.prompt_ids or p) + list(c.logprobs)
                    for p, g in zip(prompts, groups, strict=True) for c in g]}


def divergence(ref: dict[str, Any], d: dict[str, Any], i: int) -> dict[str, Any]:
    """Where row `i` of side `d` leaves the tool loop's: the first differing position, the tokens there (and their
    sampled logprobs), and the largest gap between the two sides' logprobs of the same tokens before it (0 when
    both engines computed the same numbers; ~1e-6 when float32 rounding differed, e.g. with the batch's makeup)."""
    a, b, la, lb = ref["rows"][i], d["rows"][i], ref["lps"][i], d["lps"][i]
    k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    gap = max((abs(x - y) for x, y in zip(la[:k], lb[:k], strict=True)), default=0.0)
    return {"row": i, "position": k, "lengths": [len(a), len(b)], "tokens": [a[k:k + 4], b[k:k + 4]],
            "logprobs": [la[k:k + 1], lb[k:k + 1]], "max_logprob_gap_before": gap}


def compare(done: list[dict[str, Any]]) -> None:
    """Per side, `equal_rows`: how many rollouts' whole rows (prompt + completion tokens, and the loss mask) equal
    the tool loop's rollout of the same example and index; the rows themselves are dropped."""
    ref = next(d for d in done if d["side"] == "toolloop")
    for d in done:
        d["equal_rows"] = sum(a == b and ma == mb for a, b, ma, mb in zip(ref["rows"], d["rows"], ref["masks"],
                                                                           d["masks"], strict=True))
        d["first_unequal"] = next((i for i, (a, b) in enumerate(zip(ref["rows"], d["rows"], strict=True)) if a != b),
                                  None)
        d["unequal"] = [divergence(ref, d, i) for i, (a, b) in enumerate(zip(ref["rows"], d["rows"], strict=True))
                        if a != b][:4]
    for d in done:
        d.pop("rows"), d.pop("masks"), d.pop("lps"), d.pop("_batch")


def save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The json and the report of the rounds so far (after each round: a run stopped early keeps what it measured)."""
    from agent_overhead_report import report

    result.update({"args": vars(args), "argv": sys.argv[1:], "machine": f"{os.cpu_count()} CPUs",
                   "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    Path(args.json).write_text(json.dumps(result, indent=1))
    if result["rounds"]:
        Path(args.out).write_text(report(args, result, sys.argv[1:]))


def train_round(trainer: Any, done: list[dict[str, Any]], r: int) -> None:
    """`--trainer`: one trainer step on the tool loop's rows of this round (bench/agent_trainstep.py); its figures
    go into every side's record (the same rows, so the same trainer work where the rows are equal)."""
    if trainer is None:
        return
    got = trainer.step(*next(d["_batch"] for d in done if d["side"] == "toolloop"))
    print(f"agent-overhead: round {r} trainer step: {got['train_s']:.2f} s, {got['groups_with_signal']}/"
          f"{got['groups']} groups with signal, {got['train_tokens']} tokens, mismatch_kl {got['mismatch_kl']:.2e}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    got["train_load"] = os.getloadavg()[0]
    for d in done:
        d.update(got)


async def bench(args: argparse.Namespace, url: str, wl: Any, vllm_pid: int | None, trainer: Any) -> dict[str, Any]:
    from tidal.config.orch import SamplingSection
    from tidal.config.orch_sections import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.orchestrator.groups import sample_seed

    client = VllmClient(ClientSection(base_url=[url]))
    model = (await client.wait_ready())[0]
    sampling = SamplingSection(max_tokens=args.max_tokens or None, seed=args.seed, temperature=args.temperature)
    sides = {k: v for k, v in wl.envs().items() if k in args.sides}
    task = wl.build_task()
    rounds: list[list[dict[str, Any]]] = []
    try:
        for r in range(args.rounds + 1):  # round 0 warms every side up (imports, the endpoint's start, caches)
            rng = random.Random(args.seed * 1000 + r)
            examples = [task.sample(rng) for _ in range(args.prompts)]
            seeds = [sample_seed(sampling, r, i) for i in range(args.prompts)]
            order = args.sides[r % len(args.sides):] + args.sides[:r % len(args.sides)]
            done = []
            for side in order:
                done.append(await one_step(side, sides[side], client, model, examples, seeds, args, sampling,
                                           vllm_pid))
                d = done[-1]
                print(f"agent-overhead: round {r} {side}: {d['seconds']:.2f} s, {d['sampled_tokens']} sampled tokens, "
                      f"{d['calls']:.2f} calls, {d['tool_messages']:.2f} tool results a rollout, cpu "
                      f"{d['own_cpu_s']:.2f}+{d['children_cpu_s']:.2f} s, vLLM cpu {d['vllm_cpu_s']:.2f} s, "
                      f"load {d['load']:.1f}", flush=True)
            train_round(trainer, done, r)
            compare(done)
            print("agent-overhead: rows equal to the tool loop's: " + ", ".join(
                f"{d['side']} {d['equal_rows']}/{args.prompts * args.generations}" for d in done), flush=True)
            for d in done:
                for u in d["unequal"]:
                    print(f"agent-overhead: round {r} {d['side']} row {u['row']} leaves the tool loop's at position "
                          f"{u['position']} (lengths {u['lengths']}, tokens {u['tokens']}, logprobs {u['logprobs']}, "
                          f"largest logprob gap before it {u['max_logprob_gap_before']:.2e})", flush=True)
            calls = next(d["calls"] for d in done if d["side"] == "toolloop")
            if r == 0 and calls < args.min_calls:
                print(f"agent-overhead: {calls:.2f} model calls a rollout in the warm-up round, fewer than "
                      f"--min-calls {args.min_calls:g}: not the multi-turn workload asked for (exit 3)", flush=True)
                raise SystemExit(3)
            if r > 0:
                rounds.append(done)
                save(args, {"model": model, "rounds": rounds})
    finally:
        for s in sides.values():
            if hasattr(s, "server"):
                await s.server.stop()
        await client.close()
    return {"model": model, "rounds": rounds}


def main() -> None:
    from agent_overhead_report import report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["calc", "addition", "reverse"], default="calc")
    ap.add_argument("--model", default=None, help="another model than the workload's own (a local directory)")
    ap.add_argument("--shots", action=argparse.BooleanOptionalAction, default=True,
                    help="calc: one worked conversation at the head of each prompt")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES[:3]))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=0, help="orch sampling.max_tokens (0: null, module doc)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="orch sampling.seed")
    ap.add_argument("--train-step-s", type=float, default=0.0,
                    help="a trainer step's seconds added to every side (0: none; --trainer measures it instead)")
    ap.add_argument("--trainer", default=None,
                    help="a train.yaml: one real trainer step per round on the tool loop's rows (agent_trainstep.py), "
                         "timed; the report then gives the per-training-step ratios")
    ap.add_argument("--adapter", default=None, help="a LoRA adapter merged into --model first (agent_trainstep.py)")
    ap.add_argument("--min-calls", type=float, default=0.0,
                    help="stop after the warm-up round when the tool loop's rollouts make fewer model calls on average")
    ap.add_argument("--allow-unequal", action="store_true", help="print ratios even when rows differ (flagged)")
    ap.add_argument("--report-only", action="store_true", help="write --out from --json, running nothing")
    ap.add_argument("--port", type=int, default=8650)
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
        keep = {k: getattr(args, k) for k in ("train_step_s", "allow_unequal", "out")}
        args.__dict__.update(saved["args"])
        args.__dict__.update(keep)
        Path(args.out).write_text(report(args, saved, saved.get("argv", [])))
        return
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    from agent_workloads import workload

    if args.adapter:  # the policy = --model with this LoRA adapter merged in (vLLM serves it without LoRA)
        from agent_trainstep import merged

        if not args.model:
            ap.error("--adapter needs --model (the adapter's base model directory)")
        import hashlib

        tag = hashlib.sha1(str(Path(args.adapter).resolve()).encode()).hexdigest()[:8]
        args.model = merged(args.model, Path(args.adapter), work / f"merged-{tag}")
    wl = workload(args.workload, args.model, work, args.shots)
    cmd = [sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.model", wl.model, "--infer.port",
           str(args.port), "--infer.max_model_len", str(args.seq_len), "--infer.enable_lora", "false"]
    args.load_before = os.getloadavg()[0]  # the machine before this run (its command side's programs raise it)
    child = harness.start("vllm", cmd, work / "vllm.log", env=harness.child_env(REPO))
    try:
        harness.wait_ready(child, f"http://127.0.0.1:{args.port}/health", 900)
        trainer = None
        if args.trainer:  # built before the rounds (its load is no step's); torch then lives in this process
            from agent_trainstep import TrainerStep

            trainer = TrainerStep(Path(args.trainer), wl.model, args.generations)
        result = asyncio.run(bench(args, f"http://127.0.0.1:{args.port}/v1", wl, child.pid, trainer))
    finally:
        harness.stop(child)
    save(args, result)
    print(f"agent-overhead: wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
