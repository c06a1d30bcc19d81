"""bench/agent_overhead.py compares like with like: given a sampler whose tokens depend only on the prompt ids and the
seed (as vLLM's seeded sampling does, batch effects aside), the tool loop and the endpoint running the user's
program (a real `openai`-SDK program over HTTP) hold the same multi-turn conversations, row for row, token for token;
and the report quotes no ratio when rows differ."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from tidal.inference.protocol import Completion

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))


class SeededClient:
    """An inference client whose completion of `prompt_ids` under `seed` is a function of both: a Hermes `add` call
    with numbers drawn from them (about two turns in three) or an answer; a request for `n` completions seeds its
    children `seed + j`, as vLLM does. Chats are rendered by the tokenizer's chat template (what vLLM's /tokenize
    does)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")

    async def tokenize_chat(self, model: str, messages: list[dict[str, Any]], tools: Any = None,
                            add_generation_prompt: bool = True) -> list[int]:
        return list(self.tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                                 add_generation_prompt=add_generation_prompt))

    async def tokenize_prompt(self, model: str, prompt: Any, tools: Any = None) -> list[int]:
        return await self.tokenize_chat(model, prompt, tools)

    async def sample(self, model: str, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                     seed: int | None = None, extra: Any = None) -> list[Completion]:
        assert seed is not None
        await asyncio.sleep(0.001)
        return [self.completion(prompt_ids, seed + j, max_tokens) for j in range(n)]

    def completion(self, prompt_ids: list[int], seed: int, max_tokens: int) -> Completion:
        rng = random.Random(hashlib.sha256(f"{prompt_ids}|{seed}".encode()).hexdigest())
        if rng.random() < 0.67:
            a, b = rng.randint(1, 99), rng.randint(1, 9)
            # now and then a call as small models write them: another tool name, an extra or a missing argument
            # (the program runs its `add` on them all; its twin must answer the same)
            name, extra = rng.choice([("add", ""), ("add", ""), ("plus", ""), ("add", ', "c": 1')])
            args = f'"a": {a}, "b": {b}{extra}' if rng.random() < 0.8 else f'"a": {a}'
            text = f'<tool_call>{{"name": "{name}", "arguments": {{{args}}}}}</tool_call>'
        else:
            text = f"It is {rng.randint(1, 999)}."
        ids = [*self.tok.encode(text, add_special_tokens=False), self.eos][:max_tokens]
        pieces = [self.tok.decode([t]) for t in ids]
        return Completion(ids, [-0.5] * len(ids), "".join(pieces), "stop" if ids[-1] == self.eos else "length",
                          pieces)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.e2e.tool_env import tool_model

    return AutoTokenizer.from_pretrained(tool_model(tmp_path_factory.mktemp("m") / "model"))


@pytest.mark.parametrize("name", ["calc", "addition"])
def test_the_endpoint_and_the_tool_loop_hold_the_same_conversations(tok, tmp_path, name):
    """`calc`: the program's prompt describes its tool; `addition`: tidal writes the tool into the system message and
    its results as a user turn (`tool_prompt: system`), the twin the same way."""
    import agent_overhead
    from agent_workloads import workload

    from tidal.config.orch import SamplingSection

    wl = workload(name, "m", tmp_path, True)
    envs = wl.envs()
    args = argparse.Namespace(generations=4, seq_len=4096, temperature=1.0)  # the tool block: ~900 tokens here
    sampling = SamplingSection(max_tokens=None, seed=5)
    task = wl.build_task()
    examples = [task.sample(random.Random(i)) for i in range(2)]
    client = SeededClient(tok)

    async def go() -> list[dict[str, Any]]:
        try:
            return [await agent_overhead.one_step(side, envs[side], client, "m", examples, [5, 100008], args,
                                                  sampling, None)
                    for side in ("toolloop", "endpoint-fn", "endpoint-fn-shared")]
        finally:
            await envs["endpoint-fn"].server.stop()
            await envs["endpoint-fn-shared"].server.stop()

    done = asyncio.run(go())
    loop, fn, shared = done
    assert fn["failures"] == shared["failures"] == 0
    assert shared["rows"] == fn["rows"], "the shared-client program holds the same conversations"
    assert loop["calls"] == fn["calls"] > 1.5, "multi-turn: tool rounds before the answer"
    assert loop["with_tool_round"] == fn["with_tool_round"] >= 4
    assert loop["rows"] == fn["rows"] and loop["masks"] == fn["masks"]
    fn["rows"][3] = [*fn["rows"][3], 7]  # one token more in one rollout
    agent_overhead.compare(done)
    assert [d["equal_rows"] for d in done] == [8, 7, 8] and fn["first_unequal"] == 3
    u = fn["unequal"]  # where it leaves the tool loop's row: at the added token, after identical logprobs
    assert len(u) == 1 and u[0]["row"] == 3 and u[0]["position"] == u[0]["lengths"][0] == u[0]["lengths"][1] - 1
    assert u[0]["tokens"] == [[], [7]] and u[0]["max_logprob_gap_before"] == 0.0 and shared["unequal"] == []


def test_the_report_quotes_no_ratio_when_rows_differ():
    from agent_overhead_report import report

    def side(name: str, seconds: float, equal: int) -> dict[str, Any]:
        return {"side": name, "seconds": seconds, "equal_rows": equal, "load": 1.0, "own_cpu_s": 0.1,
                "children_cpu_s": 0.0, "vllm_cpu_s": 1.0, "sampled_tokens": 100, "calls": 2.5, "tool_messages": 1.5,
                "with_tool_round": 8, "reward": 0.5}

    args = argparse.Namespace(workload="calc", shots=True, prompts=2, generations=4, temperature=1.0, seed=0,
                              seq_len=512, sides=["toolloop", "endpoint-fn"], train_step_s=0.0, allow_unequal=False)
    result = {"model": "m", "written": "now", "machine": "2 CPUs",
              "rounds": [[side("toolloop", 10.0, 8), side("endpoint-fn", 10.3, 8)],
                         [side("endpoint-fn", 10.2, 8), side("toolloop", 10.0, 8)]]}
    text = report(args, result, [])
    assert "1.020 / 1.025 / 1.030" in text and "16/16" in text and "within the 5% goal" in text
    result["rounds"][1][0]["equal_rows"] = 7
    text = report(args, result, [])
    assert "15/16" in text and "No ratio quoted" in text and "1.025" not in text
    args.allow_unequal = True
    assert "Flagged" in report(args, result, [])


def test_the_report_gives_per_training_step_ratios_with_the_rounds_trainer_step():
    """`--trainer`: a side's step = its rollout phase + the round's trainer step (the same rows, the same work): per
    round (side + train) / (tool loop + train), then min / median / max, judged against the 5% goal."""
    from agent_overhead_report import report, step_ratios

    def side(name: str, seconds: float, train: float) -> dict[str, Any]:
        return {"side": name, "seconds": seconds, "equal_rows": 8, "load": 1.0, "own_cpu_s": 0.1,
                "children_cpu_s": 0.0, "vllm_cpu_s": 1.0, "sampled_tokens": 100, "calls": 2.0, "tool_messages": 1.0,
                "with_tool_round": 8, "reward": 0.5, "train_s": train, "groups_with_signal": 2, "groups": 2,
                "train_tokens": 900, "mismatch_kl": 1e-11, "loss": 0.0}

    rounds = [[side("toolloop", 10.0, 30.0), side("endpoint-fn", 12.0, 30.0)],
              [side("endpoint-fn", 14.0, 20.0), side("toolloop", 10.0, 20.0)],
              [side("toolloop", 10.0, 10.0), side("endpoint-fn", 11.0, 10.0)]]
    assert step_ratios(rounds, "endpoint-fn") == pytest.approx([42 / 40, 34 / 30, 21 / 20])
    args = argparse.Namespace(workload="addition", shots=True, prompts=2, generations=4, temperature=1.0, seed=0,
                              seq_len=512, sides=["toolloop", "endpoint-fn"], train_step_s=0.0, allow_unequal=False,
                              trainer="train.yaml")
    text = report(args, {"model": "m", "written": "now", "machine": "2 CPUs", "rounds": rounds}, [])
    assert "1.050 / 1.050 / 1.133" in text and "median ratio 1.050 per training step: within the 5% goal" in text
    assert "trainer step 30.00" in text  # the per-round line
    rounds[2][1]["seconds"] = 13.0  # the median moves to round 3's 23/20
    text = report(args, {"model": "m", "written": "now", "machine": "2 CPUs", "rounds": rounds}, [])
    assert "median ratio 1.133 per training step: over the 5% goal" in text
