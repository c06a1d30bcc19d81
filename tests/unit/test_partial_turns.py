"""Partial rollouts (orch `partial_rollouts: abort_resume`, issue 52) in multi-turn and tool rollouts, without a
server: each model turn is stopped at a policy switch and continued under the new policy (`partial.PartialTurns`
through the real `rollout.multi_turn_group` / `toolloop.tool_group` loops), and must give the tokens, mask and text
of the same rollout sampled without a switch; every model token keeps the version that sampled it, and environment
/ tool tokens take the version of the model token before them (`rollout.fill_versions`).

The server is a fake that streams a scripted turn token by token and honours, as vLLM does, a stop between two
tokens, the request's own stop strings (after its `min_tokens`) and the client's `until` test; it switches the
policy right after chosen tokens were sent, so the switch lands exactly where the test says (the one thing a real
server cannot be made to show). The real-vLLM checks are in tests/integration/test_partial_rollouts.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from tidal.config.orch import SamplingSection
from tidal.envs.base import Example
from tidal.inference.protocol import Completion
from tidal.orchestrator.partial import PartialTurns, Switch, partial_turn, stop_across
from tidal.orchestrator.rollout import fill_versions, multi_turn_group

EOS = 0


class Policy:
    """`PolicyTracker`'s lease surface (LoRA: a new adapter name per policy)."""

    def __init__(self) -> None:
        self.step, self.model, self.base_model, self.merged = 1, "a-1", "base", False

    def lease(self):
        return self.model, self.step

    def release(self, model):
        pass


class Streamer:
    """One rollout's (n = 1) scripted server: turn k writes `turns[k]` (token ids; the last, EOS, ends it), a token's
    text being `text_of(id)` (EOS: none in a streamed text, as vLLM shows it; kept by `detokenize`, as vLLM's
    /detokenize does). After the token (turn, index) of `switch_after` is sent, the policy changes (what the stream's
    follower does once a new adapter is loaded)."""

    def __init__(self, turns: list[list[int]], text_of, switch: Switch | None = None,
                 switch_after: frozenset[tuple[int, int]] = frozenset()) -> None:
        self.turns, self.text_of = [list(t) for t in turns], text_of
        self.switch, self.switch_after = switch, switch_after
        self.k, self.done, self.requests = -1, 0, 0

    def _turn(self, prompt_ids: list[int]) -> list[int]:
        cur = self.turns[self.k] if self.k >= 0 else []
        if not (0 < self.done < len(cur) and prompt_ids[len(prompt_ids) - self.done:] == cur[:self.done]):
            self.k, self.done = self.k + 1, 0  # not a continuation of the turn in progress: the next turn
        return self.turns[self.k]

    async def sample_stream(self, model, prompt_ids, max_tokens, temperature, stop, seed=None, extra=None,
                            until=None):
        extra, self.requests = extra or {}, self.requests + 1
        cur = self._turn(prompt_ids)
        ids: list[int] = []
        text, after = "", 0

        def out(reason: str) -> Completion:
            if reason == "stop":
                self.turns[self.k] = cur[:self.done]  # the turn ended here
            return Completion(ids, [-0.5] * len(ids), text, reason, [self.text_of(t) or "<eos>" for t in ids])

        while len(ids) < max_tokens and self.done < len(cur):
            await asyncio.sleep(0)
            if stop.is_set():
                return out("interrupted")
            tok = cur[self.done]
            self.done += 1
            ids.append(tok)
            text += self.text_of(tok) if tok != EOS else ""
            if (self.k, self.done - 1) in self.switch_after:
                policy = self.switch.policy
                policy.step += 1
                policy.model = f"a-{policy.step}"
                self.switch.after_load()
            if len(ids) <= extra.get("min_tokens", 0):
                after = len(text)  # vLLM matches stop strings that end past the first min_tokens tokens' text
            elif any(text.find(s, max(0, after - len(s) + 1)) >= 0 for s in extra.get("stop") or []):
                return out("stop")
            if tok == EOS:
                return out("stop")
            if until is not None and until(text, len(ids)):
                return out("stop")
        return out("stop" if self.done == len(cur) else "length")

    async def sample(self, model, prompt_ids, n, max_tokens, temperature, seed=None, extra=None):
        assert n == 1
        return [await self.sample_stream(model, prompt_ids, max_tokens, temperature, asyncio.Event(), seed, extra)]

    async def detokenize(self, model, ids):
        return "".join(self.text_of(t) if t != EOS else "<eos>" for t in ids)

    async def tokenize_text(self, model, text):
        return [ord(c) for c in text]


def chars(s: str) -> list[int]:
    return [ord(c) for c in s]


def char_of(t: int) -> str:
    return "" if t == EOS else chr(t)


class TwoTurns:
    """A multi-turn environment: turns end at EOS or "END"; it answers the first turn once."""

    id, stop, max_turns, REPLY = "two-turns", ("END",), 2, " [ok] "

    def respond(self, example, transcript):
        return None if self.REPLY in transcript else self.REPLY


@pytest.mark.parametrize(("script", "min_tokens"), [("abcdefghENDxyz", 0), ("ENDabcdeENDxyz", 5)])
def test_a_stop_string_split_by_the_switch_ends_the_continued_turn_where_it_would_have(script, min_tokens):
    """"EN" before the switch, "D" after: vLLM would not see "END" in the continued request's own text; the turn
    must still end at "D", as uninterrupted, with its text cut there (include_stop_str_in_output); an "END" within
    the first `min_tokens` tokens does not count, for the turn or for its text."""
    script = [chars(script) + [EOS]]
    extra = {"stop": ["END"], "include_stop_str_in_output": True, "min_tokens": min_tokens}

    async def go(switch_after):
        policy = Policy()
        switch = Switch("abort_resume", policy, merged=False)
        server = Streamer(script, char_of, switch, switch_after)
        return await partial_turn(switch, server, [1, 2], 64, 0.0, 5, extra), server.requests

    (whole, one), (cont, two) = asyncio.run(go(frozenset())), asyncio.run(go(frozenset({(0, 9)})))
    assert (one, two) == (1, 2), "the switch must stop the first request"
    want = script[0][:11]
    assert whole.token_ids == cont.token_ids == want
    assert cont.finish_reason == whole.finish_reason == "stop" and cont.text == whole.text == "".join(map(chr, want))
    assert cont.versions == [1] * 10 + [2]


def test_stop_across_counts_only_stop_strings_that_end_in_the_new_text_past_min_tokens():
    assert stop_across("abc", ["END"], 0) is None  # no tail a stop string could continue
    assert stop_across("xyz", ["E"], 0) is None  # a one-character stop string cannot span two requests
    until = stop_across("abEN", ["END"], 0)
    assert until is not None and until("D", 1) and not until("X", 1)
    late = stop_across("abEN", ["END"], 2)  # min_tokens 2 left: "D" as the first new token does not count
    assert late is not None and not late("D", 1) and not late("Dq", 2) and not late("DqE", 3) and late("DqEND", 4)


def test_fill_versions():
    assert fill_versions([None, None]) is None
    assert fill_versions([None, 3, 3, None, None, 4, None]) == [3, 3, 3, 3, 3, 4, 4]
    rng = random.Random(random.SystemRandom().randrange(2**31))
    vs = sorted(rng.randrange(9) for _ in range(30))
    holes = [v if rng.random() < 0.6 or i == 0 else None for i, v in enumerate(vs)]
    got = fill_versions(holes)
    assert got is not None and got == sorted(got) and all(h is None or h == g for h, g in zip(holes, got, strict=True))


def test_a_multi_turn_rollout_continued_across_switches_is_the_uninterrupted_one():
    """Switches inside both turns (the first one inside its stop string): the same tokens, mask and text as the
    rollout without a switch; the model's tokens carry 1 -> 2 in turn 1 and 2 -> 3 in turn 2, the environment's
    reply the version of the token before it."""
    turns = [chars("abcdefghENDxyz") + [EOS], chars("more text") + [EOS]]
    env, sampling = TwoTurns(), SamplingSection(max_tokens=100)

    async def go(switch_after):
        policy = Policy()
        switch = Switch("abort_resume", policy, merged=False)
        server = Streamer(turns, char_of, switch, switch_after)
        how = PartialTurns(switch, server, 0.0) if switch_after else None
        comps = await multi_turn_group(server, "a-1", [1, 2], 1, sampling, 200, 5, 0.0, env,  # type: ignore[arg-type]
                                       Example(prompt="x"), how)
        return comps[0], switch

    (whole, _), (cont, switch) = asyncio.run(go(frozenset())), asyncio.run(go(frozenset({(0, 9), (1, 4)})))
    first, reply = chars("abcdefghEND"), chars(TwoTurns.REPLY)
    assert whole.token_ids == cont.token_ids == first + reply + chars("more text") + [EOS]
    assert whole.mask == cont.mask == [1] * 11 + [0] * len(reply) + [1] * 10
    assert cont.text == whole.text == "abcdefghEND" + TwoTurns.REPLY + "more text"
    assert cont.finish_reason == whole.finish_reason == "stop" and whole.versions is None
    assert cont.versions == [1] * 10 + [2] + [2] * len(reply) + [2] * 5 + [3] * 5
    assert switch.counts["partial/resumed_requests"] == 2


def test_a_tool_rollout_continued_across_switches_masks_its_tool_tokens(tmp_path):
    """The tool loop (`tool_group`, Hermes calls, the template's tool turn spliced in) with switches inside the
    call turn and the answer turn: it completes with the uninterrupted rollout's tokens, the tool result is masked
    (loss mask 0, logprob 0) and takes the version of the call turn's last token."""
    from tests.e2e.tool_env import ReverseTool, tool_model
    from tidal.orchestrator.toolloop import tool_group
    from tidal.trainer.model.load import load_tokenizer

    tok = load_tokenizer(str(tool_model(tmp_path / "m")))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    env = ReverseTool()
    ex = Example(prompt=[{"role": "user", "content": "abc"}], answer="cba", info={"text": "abc"})
    call, answer = tok.encode(env.reference_completion(ex), add_special_tokens=False), tok.encode(
        "it is cba", add_special_tokens=False)

    def text_of(t: int) -> str:
        return "" if t == eos else tok.decode([t])

    class ToolStreamer(Streamer):
        async def tokenize_chat(self, model, messages, tools=None, add_generation_prompt=True):
            return list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                                add_generation_prompt=add_generation_prompt))

    async def go(switch_after):
        policy = Policy()
        switch = Switch("abort_resume", policy, merged=False)
        server = ToolStreamer([call + [eos], answer + [eos]], text_of, switch, switch_after)
        prompt = await server.tokenize_chat("m", ex.prompt, env.tooling.schemas)
        how = PartialTurns(switch, server, 0.0) if switch_after else None
        comps = await tool_group(server, "m", prompt, 1, SamplingSection(max_tokens=300), 1024, 5,  # type: ignore[arg-type]
                                 0.0, env, ex, how)
        return comps[0]

    whole, cont = asyncio.run(go(frozenset())), asyncio.run(go(frozenset({(0, 3), (1, 1)})))
    assert cont.token_ids == whole.token_ids and cont.mask == whole.mask and cont.finish_reason == "stop"
    assert cont.messages == whole.messages and cont.messages[1] == pytest.approx(
        {"role": "tool", "name": "reverse", "content": "cba", "tool_call_id": "c00000000"})
    n_call, n_tool = len(call) + 1, len(cont.token_ids) - len(call) - 1 - len(answer) - 1
    assert cont.mask == [1] * n_call + [0] * n_tool + [1] * (len(answer) + 1) and n_tool > 0
    assert cont.logprobs[n_call:n_call + n_tool] == [0.0] * n_tool
    assert cont.versions == [1] * 4 + [2] * (n_call - 4) + [2] * n_tool + [2] * 2 + [3] * (len(answer) - 1)
    assert whole.versions is None
