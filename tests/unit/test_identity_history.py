"""`tidal grpo`'s identity check keeps the policies it checked (`IdentityCheck.EARLIER`) and places each served
policy against them too: replayed on what a real bf16 vLLM served for 15 policies of a SmolLM2 run (tests/data,
bench/PROBE-68.md), with the records the trainer published for them. The client is a stand-in that answers the
probe with the recorded logprobs of the policy it is made to serve (a sampler stuck on one policy: what an adapter
load that does nothing leaves; tests/integration/test_policy_identity.py causes that against a float32 vLLM)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tidal.orchestrator.identity import IdentityCheck
from tidal.transport.probe import PROBE_LEN_16BIT, PolicyMismatch, ProbeRecord

DATA = json.loads((Path(__file__).parents[1] / "data/probe_bf16_smollm2.json").read_text())
TRAINER = [v[:PROBE_LEN_16BIT] for v in DATA["trainer"]]
SERVED = [v[:PROBE_LEN_16BIT] for v in DATA["served"]]


class Stuck:
    """Answers the probe with what the bf16 vLLM served for policy `serving`."""

    urls = ["http://recorded"]

    def __init__(self) -> None:
        self.serving = 0

    async def prompt_logprobs(self, model: str, ids: list[int]) -> list[float]:
        assert ids == DATA["ids"][:len(ids)]
        return SERVED[self.serving][:len(ids)]


def publish(run: Path, n: int) -> Path:
    d = run / f"step_{n}"
    d.mkdir(parents=True, exist_ok=True)
    ProbeRecord(step=n, ids=DATA["ids"][:PROBE_LEN_16BIT], new=TRAINER[n], dtype="bfloat16", previous=TRAINER[n - 1],
                previous_step=n - 1, base=TRAINER[0]).write(d)
    return d


def run_until(tmp_path: Path, stuck_at: int | None) -> int | None:
    """Check policies 1..15 in turn, the client serving each one until `stuck_at` and that one after; the step the
    check stopped at (None: it never did)."""
    check, client = IdentityCheck(), Stuck()
    for n in range(1, len(TRAINER)):
        client.serving = n if stuck_at is None or n <= stuck_at else stuck_at
        try:
            asyncio.run(check.after_load(client, "m", publish(tmp_path, n), n))  # type: ignore[arg-type]
        except PolicyMismatch as e:
            if stuck_at is not None:
                assert "\n" not in str(e) and f"at step {n}" in str(e)
            return n
    assert len(check.earlier) == min(IdentityCheck.EARLIER, len(TRAINER) - 1)
    return None


def test_serving_each_policy_never_stops_the_run(tmp_path):
    assert run_until(tmp_path, None) is None


@pytest.mark.parametrize("stuck_at", [3, 6, 10])
def test_a_sampler_stuck_on_a_policy_is_caught_within_four_steps(tmp_path, stuck_at):
    caught = run_until(tmp_path, stuck_at)
    assert caught is not None and stuck_at < caught <= stuck_at + 4, caught


def test_the_policies_checked_before_are_what_catches_a_late_stuck_sampler(tmp_path, monkeypatch):
    """Stuck on policy 10: caught at the next step; the record's previous policy and base alone never catch it in
    this run (stuck on policy 9 they take 6 steps, the check 1)."""
    assert run_until(tmp_path, 10) == 11 and run_until(tmp_path / "9", 9) == 10
    monkeypatch.setattr(IdentityCheck, "EARLIER", 0)
    assert run_until(tmp_path / "none", 10) is None and run_until(tmp_path / "none9", 9) == 15


def test_a_server_shorter_than_the_probe_scores_its_first_tokens(tmp_path):
    """orch `seq_len` 50 (vLLM holds 50 tokens; the trainer published 128): the check sends the first 49 and judges
    them against the record's first 49 (logprobs are causal); a stuck sampler is still caught."""
    seen: list[int] = []

    class Short(Stuck):
        async def prompt_logprobs(self, model: str, ids: list[int]) -> list[float]:
            seen.append(len(ids))
            return await super().prompt_logprobs(model, ids)

    check, client = IdentityCheck(context=50), Short()
    for n in range(1, 4):
        client.serving = n
        asyncio.run(check.after_load(client, "m", publish(tmp_path, n), n))  # type: ignore[arg-type]
    assert seen == [49, 49, 49]
    client.serving = 3  # stuck on policy 3 from here
    with pytest.raises(PolicyMismatch, match="it serves policy 3|it serves the previous policy") as err:
        for n in range(4, len(TRAINER)):
            asyncio.run(check.after_load(client, "m", publish(tmp_path, n), n))  # type: ignore[arg-type]
    assert seen[-1] == 49 and len(seen) <= 3 + 5, (seen, str(err.value))
