"""Environment failures vs model failures (`tidal.orchestrator.outage`): rollouts that failed on the environment's
side stay out of their group's baseline (float64 loop references), carry no loss in the batch, groups left with
fewer than 2 judged rollouts are dropped and counted, the outage rule (`env_outage.fraction`) and the wait
(backoff, one warning naming the environment, `env_outage.timeout_s`), a reward function's `ServiceUnavailable`,
and a real `tidal env-server` that goes away (ServiceUnavailable, not a score)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import free_port
from tidal.config.orch import AdvantageSection, EnvOutageSection, OrchConfig
from tidal.envs.remote import RemoteEnvironment
from tidal.inference.protocol import Completion
from tidal.orchestrator.advantage import compute_advantages, group_advantages
from tidal.orchestrator.assemble import assemble
from tidal.orchestrator.filters import Filters
from tidal.orchestrator.groups import Collected, StepSample
from tidal.orchestrator.outage import EnvFailures, EnvOutage, Outage, judged, keeps_group, probe
from tidal.orchestrator.scoring import Scorer
from tidal.rewards import ServiceUnavailable


def reference(rewards, ok, g, scale, lengths=None):
    """Float64 loop: each group's baseline and std over its judged rollouts only; 0 for the others."""
    allr = [float(r) for r, j in zip(rewards, ok, strict=True) if j]
    batch_std = statistics.stdev(allr)
    out = []
    for k in range(len(rewards) // g):
        idx = [i for i in range(k * g, (k + 1) * g) if ok[i]]
        grp = [float(rewards[i]) for i in idx]
        if lengths is None:
            base = sum(grp) / len(grp)
        else:
            base = sum(float(rewards[i]) * int(lengths[i]) for i in idx) / sum(int(lengths[i]) for i in idx)
        div = {"none": 1.0, "group": statistics.stdev(grp) + 1e-4, "batch": batch_std + 1e-4}[scale]
        out += [(float(rewards[i]) - base) / div if ok[i] else 0.0 for i in range(k * g, (k + 1) * g)]
    return out


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
@pytest.mark.parametrize("weighted", [False, True])
def test_unjudged_rollouts_stay_out_of_the_baseline(scale, weighted):
    rng = np.random.default_rng()
    g, n = 5, 6
    rewards = rng.random(g * n)
    ok = rng.random(g * n) > 0.3
    for k in range(n):  # every group keeps at least 2 judged rollouts (the others are dropped before)
        ok[k * g:k * g + 2] = True
    rewards[~ok] = np.where(rng.random(int((~ok).sum())) > 0.5, np.nan, 0.0)  # NaN rows or reward_default
    lengths = rng.integers(1, 50, g * n)
    adv = group_advantages(rewards, g, scale, lengths, weighted, judged=ok)
    want = reference(rewards, ok, g, scale, lengths if weighted else None)
    assert np.allclose(adv, want, rtol=1e-12, atol=1e-12)
    assert np.all(adv[~ok] == 0)
    clean = np.where(ok, rewards, 0.0)
    assert np.array_equal(group_advantages(clean, g, scale, lengths, weighted, judged=np.ones(g * n, bool)),
                          group_advantages(clean, g, scale, lengths, weighted)), "all judged: the plain formula"


def test_process_and_custom_advantages_leave_unjudged_rollouts_out():
    ok = np.array([True, True, False, True])
    lens = np.array([3, 3, 3, 3])
    steps = [[(0, 1.0), (2, 0.0)], [(2, 1.0)], [(1, 100.0)], [(2, 0.0)]]
    adv = compute_advantages(AdvantageSection(type="process"), 4, np.zeros(4), lens, steps, None, ok)
    pooled = [1.0, 0.0, 1.0, 0.0]  # the unjudged rollout's step reward (100) is not pooled
    mean, std = sum(pooled) / 4, statistics.stdev(pooled) + 1e-4
    assert np.allclose(adv[0], [(1 - mean) / std + (0 - mean) / std] + [(0 - mean) / std] * 2, atol=1e-12)
    assert not adv[2].any()

    seen = {}

    def fn(rewards, lengths, group_size):
        seen["r"] = rewards.copy()
        return rewards * 10

    section = AdvantageSection(type="custom", import_path="x:y")
    adv = compute_advantages(section, 4, np.array([1.0, 0.0, np.nan, 0.5]), lens, None, fn, ok)
    assert seen["r"].tolist() == [1.0, 0.0, 0.5, 0.5], "an unjudged rollout shows its group's judged mean"
    assert [a[0] for a in adv] == [10.0, 0.0, 0.0, 5.0]


def comp(error=None, n=3) -> Completion:
    return Completion([1] * n, [-0.5] * n, "x", "stop", env_error=error)


def test_groups_with_fewer_than_two_judged_rollouts_are_dropped_and_counted():
    tally = EnvFailures()
    assert tally.add([comp(), comp(), comp("down"), comp("down")])
    assert not tally.add([comp(), comp("OpenEnv environment at http://h:1: refused"), comp("x"), comp("y")])
    assert tally.add([comp()] * 4)
    assert (tally.rollouts, tally.failed, tally.dropped_groups, tally.kept_groups) == (12, 5, 1, 2)
    assert tally.first == "down"
    assert keeps_group(np.array([True])) and not keeps_group(np.array([False]))  # rollouts_per_example 1
    assert judged([comp(), comp("e")]).tolist() == [True, False]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_outage_classification_follows_env_outage_fraction(fraction):
    tally = EnvFailures()
    tally.add([comp()] * 8)
    tally.add([comp()] * 4 + [comp("down")] * 4)  # 4 of 16 failed: 0.25
    assert tally.is_outage(fraction) == (fraction <= 0.25)
    tally.add([comp("down")] * 16)  # 20 of 32: 0.625
    assert tally.is_outage(fraction) == (fraction <= 0.625)
    assert not EnvFailures().is_outage(0.01), "no failure, no outage"
    none_kept = EnvFailures()
    none_kept.add([comp(), comp("down"), comp("down"), comp("down")])  # 0.75 failed, but no group left
    assert none_kept.is_outage(0.9)


class Down:
    """An environment whose server does not come back (`unavailable` names it), or comes back after `back` probes."""

    id = "far"

    def __init__(self, back: int | None = None) -> None:
        self.back, self.probes = back, 0

    def unavailable(self):
        self.probes += 1
        if self.back is not None and self.probes >= self.back:
            return None
        return "environment 'far' at http://127.0.0.1:9: ConnectError: refused"


def test_probe_asks_every_environment_of_a_mix():
    class Mix:
        envs = {"near": Down(back=1), "far": Down()}

    assert "environment 'far'" in probe(Mix()) and probe(Down(back=1)) is None


def fake_time():
    now = [0.0]

    async def sleep(s: float) -> None:
        now[0] += s

    return sleep, (lambda: now[0]), now


def test_outage_backs_off_until_the_environment_answers(caplog):
    sleep, clock, now = fake_time()
    env = Down(back=3)
    outage = Outage(EnvOutageSection(timeout_s=100), env, sleep, clock)
    with caplog.at_level(logging.WARNING, "tidal.orch"):
        asyncio.run(outage.wait("step 3: 16 of 16 rollouts failed (OpenEnv environment at http://h:1: refused)"))
        asyncio.run(outage.wait("step 3: again"))  # the step failed again: the same outage, said once
    assert now[0] == 1 + 2 + 4 + 8 and outage.waits == 4 and env.probes == 4
    assert caplog.text.count("environment outage:") == 1 and "OpenEnv environment at http://h:1" in caplog.text
    outage.clear()
    assert outage.since is None and "outage over after 15 s" in caplog.text


def yielding_time():
    """A fake clock whose sleep lets the other tasks run (as a real sleep does)."""
    now, slept = [0.0], []

    async def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s
        for _ in range(5):
            await asyncio.sleep(0)

    return sleep, (lambda: now[0]), slept


def test_waiters_share_one_outage_and_its_backoff():
    sleep, clock, slept = yielding_time()
    env = Down(back=3)
    outage = Outage(EnvOutageSection(timeout_s=100), env, sleep, clock)

    async def go():
        await asyncio.gather(*(outage.wait(f"a group of batch 4: group {i} failed") for i in range(5)))
        assert outage.waiting == 0

    asyncio.run(go())
    assert slept == [1, 2, 4] and env.probes == 3 and outage.waits == 3, "backoff per outage, not per waiter"


def test_a_clear_while_groups_wait_releases_them_all():
    """The race of issue 50: a group that finished cleanly clears the outage while others sleep in `wait`."""
    sleep, clock, slept = yielding_time()
    env = Down()  # never answers: only the clear ends the wait
    outage = Outage(EnvOutageSection(timeout_s=100), env, sleep, clock)

    async def go():
        async def finisher():
            while not slept:
                await asyncio.sleep(0)
            outage.clear()

        waiters = [outage.wait(f"group {i}") for i in range(4)]
        await asyncio.gather(*waiters, finisher())
        assert outage.since is None and outage.waiting == 0
        env.back = env.probes + 2
        await asyncio.gather(outage.wait("a new outage"), outage.wait("again"))

    asyncio.run(go())
    assert slept == [1, 1, 2], "the new outage starts its backoff afresh"
    assert env.probes == 2, "no probe after the clear"


@pytest.mark.parametrize("timeout_s", [10.0, 45.0])
def test_outage_stops_the_run_after_env_outage_timeout_s_naming_the_environment(timeout_s):
    sleep, clock, now = fake_time()
    outage = Outage(EnvOutageSection(timeout_s=timeout_s), Down(), sleep, clock)
    with pytest.raises(EnvOutage, match=r"env_outage.timeout_s .*environment 'far' at http://127.0.0.1:9"):
        asyncio.run(outage.wait("step 6: 8 of 8 rollouts failed"))
    assert now[0] == timeout_s, "backoff capped at the deadline"


def judge_down(completions, **kw):
    raise ServiceUnavailable("LLM judge at http://judge:8000", "ConnectError: refused")


def judge_crash(completions, **kw):
    raise ValueError("a bug")


def test_a_reward_function_reporting_its_service_unavailable_leaves_the_rollouts_unjudged():
    cfg = OrchConfig.model_validate({"reward_default": -1.0, "reward_funcs": [
        {"import_path": "tests.unit.test_env_outage:judge_down"},
        {"import_path": "tests.unit.test_env_outage:judge_crash"}]})
    from tidal.envs import make_env

    env = make_env("reverse-text")
    scorer = Scorer(env, cfg)
    ex = env.sample(random.Random(0))
    comps = [comp(), comp(), comp()]
    scores = scorer.score(ex, comps, 1)
    assert np.isnan(scores).all(), "not judged: NaN rows, no reward_default"
    assert all(c.env_error.startswith("judge_down: LLM judge at http://judge:8000 is unavailable") for c in comps)
    errors = scorer.take_error_counts()
    assert errors["reward/judge_down/errors"] == 0 and errors["reward/judge_crash/errors"] == 0
    # a bug in a reward function stays a failed reward (reward_default), not an environment failure
    cfg = OrchConfig.model_validate({"reward_default": -1.0, "reward_funcs": [
        {"import_path": "tests.unit.test_env_outage:judge_crash"}]})
    scorer = Scorer(env, cfg)
    comps = [comp(), comp("OpenEnv environment at http://h:1: refused")]
    scores = scorer.score(ex, comps, 1)
    assert scores[0, 1] == -1.0 and math.isnan(scores[1, 1]) and comps[0].env_error is None
    assert scorer.take_error_counts()["reward/judge_crash/errors"] == 1, "the unjudged rollout is not counted"


def test_unjudged_rollouts_carry_no_loss_in_the_batch_and_no_reward_metric():
    cfg = OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "env_reward_weight": 0.0,
                                     "reward_funcs": [{"import_path": "tests.unit.test_env_outage:length_reward"}]})
    from tidal.envs import make_env

    env = make_env("reverse-text")
    scorer = Scorer(env, cfg)
    got = Collected()
    for i in range(2):
        ex = env.sample(random.Random(i))
        group = [comp(n=k + 1) for k in range(4)]
        group[3 - i].env_error = "environment 'far' at http://h:1: HTTP 503"
        got.add(ex, [7, 8], group, scorer.score(ex, group, 1))
        got.env.add(group)
    done = assemble(1, StepSample(got, 0.0, 1.0), cfg, scorer, Filters([], None), None)
    b = done.batch
    weights = [int(b.loss_mask[s].sum()) for s in b.samples()]
    assert weights == [1, 2, 3, 0, 1, 2, 0, 4], "an unjudged rollout has no loss-bearing token"
    assert b.advantages[b.samples()[3]].tolist() == [0.0] * 6
    assert b.metrics["env/failed"] == 2 and b.metrics["env/dropped_groups"] == 0
    assert b.metrics["reward/mean"] == pytest.approx(np.mean([1, 2, 3, 1, 2, 4])), "judged rollouts only"
    assert b.advantages[b.samples()[0]][2:].tolist() == [1 - 2], "baseline over the judged: mean(1, 2, 3) = 2"


def length_reward(completions, completion_ids, **kw):
    return [float(len(ids)) for ids in completion_ids]


def test_a_remote_environment_that_goes_away_is_unavailable_not_a_score():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "env-server", "reverse-text", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        remote = RemoteEnvironment(f"http://127.0.0.1:{port}", timeout_s=5, connect_timeout_s=60)
        ex = remote.sample(random.Random(1))
        assert remote.unavailable() is None and remote.reward(ex, "x") >= 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    with pytest.raises(ServiceUnavailable, match=rf"environment 'reverse-text' at http://127.0.0.1:{port}"):
        remote.sample(random.Random(2))
    with pytest.raises(ServiceUnavailable, match="POST /reward"):
        remote.reward(ex, "x")
    assert f"environment 'reverse-text' at http://127.0.0.1:{port}: ConnectError" in remote.unavailable()
    with pytest.raises(RuntimeError, match="no route"):  # a refusal (4xx) is not an outage
        proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "env-server", "reverse-text", "--port",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            RemoteEnvironment(f"http://127.0.0.1:{port}", connect_timeout_s=60)._post("/nope", {})
        finally:
            proc.terminate()
            proc.wait(timeout=10)

