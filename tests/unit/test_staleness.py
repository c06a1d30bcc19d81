"""Staleness and stale-group dropping (`tidal.orchestrator.staleness`), the in-flight config refusals, the
per-sample policy versions in `TrainingBatch`, and `GroupStream.take` over a fake stream (fresh random inputs)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import numpy as np
import pytest

from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.inference.protocol import Completion
from tidal.orchestrator.assemble import build_batch
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.outage import EnvFailures, Outage
from tidal.orchestrator.partial import Switch
from tidal.orchestrator.staleness import is_stale, launch_allowed, staleness, staleness_metrics
from tidal.orchestrator.stream import Group, GroupStream
from tidal.transport.batch import TrainingBatch

SEED = random.SystemRandom().randrange(2**31)


def test_staleness_matches_its_definition_on_random_inputs():
    rng = random.Random(SEED)
    for _ in range(500):
        step, start = rng.randint(1, 50), rng.randint(0, 50)
        bound = rng.randint(0, 8)
        s = staleness(step, start)
        assert s == max(0, step - 1 - start), SEED
        assert is_stale(step, start, bound) == (step - 1 - start > bound), SEED
        k, served = rng.randint(0, 4), rng.randint(0, 50)
        assert launch_allowed(step, served, k) == (served >= step - 1 - k), SEED


def test_staleness_metrics_histogram_on_random_inputs():
    rng = random.Random(SEED)
    step = rng.randint(5, 40)
    starts = [rng.randint(max(0, step - 6), step - 1) for _ in range(rng.randint(1, 64))]
    ends = [s + rng.choice([0, 0, 1]) for s in starts]
    m = staleness_metrics(step, starts, ends, dropped_samples=12, dropped_groups=3)
    ref = [step - 1 - s for s in starts]
    hist = {int(k.split("/")[1]): v for k, v in m.items() if k.split("/")[-1].isdigit()}
    assert sum(hist.values()) == len(starts) and set(hist) == set(range(max(ref) + 1)), SEED
    assert all(hist[s] == ref.count(s) for s in hist), SEED
    assert m["staleness/max"] == max(ref) and m["staleness/mean"] == pytest.approx(np.mean(ref)), SEED
    assert m["policy_switch_samples"] == sum(e != s for s, e in zip(starts, ends, strict=True)), SEED
    assert (m["dropped_stale"], m["dropped_stale_groups"]) == (12, 3)


def comp(n: int, rng: random.Random) -> Completion:
    return Completion([rng.randrange(100) for _ in range(n)], [-rng.random() for _ in range(n)], "x", "stop")


def test_batch_carries_start_and_end_versions_through_safetensors(tmp_path):
    rng = random.Random(SEED)
    cfg = OrchConfig(batch_size=6, rollouts_per_example=2, max_off_policy_steps=3, max_async_level=1, max_steps=40)
    groups = [[comp(rng.randint(1, 5), rng) for _ in range(2)] for _ in range(3)]
    versions = [(4, 4), (3, 5), (5, 5)]
    adv = [np.zeros(len(c.token_ids)) for g in groups for c in g]
    batch, metrics = build_batch(6, [[1, 2]] * 3, groups, np.zeros(6), adv, versions, cfg, dropped_stale=(4, 2))
    batch.save(tmp_path / "b.safetensors")
    back = TrainingBatch.load(tmp_path / "b.safetensors")
    assert back.policy_steps.tolist() == [4, 4, 3, 3, 5, 5] and back.policy_steps_end.tolist() == [4, 4, 5, 5, 5, 5]
    assert metrics["staleness/0"] == 2 and metrics["staleness/1"] == 2 and metrics["staleness/2"] == 2
    assert metrics["policy_switch_samples"] == 2 and metrics["dropped_stale"] == 4
    # typed on the batch, not strings in its metrics: they travel through safetensors and decide in the trainer
    assert "policy_step" not in metrics and "off_policy_level" not in metrics and "max_steps" not in metrics
    assert back.policy_step == batch.policy_step == 3 and back.off_policy_level == batch.off_policy_level == 2
    assert back.max_steps == batch.max_steps == cfg.max_steps
    np.testing.assert_array_equal(back.inference_logprobs[2:2 + len(groups[0][0].token_ids)],
                                  np.float32(groups[0][0].logprobs)), "behaviour logprobs travel unchanged"


def test_gated_batch_records_one_version():
    cfg = OrchConfig(batch_size=2, rollouts_per_example=2)
    rng = random.Random(SEED)
    g = [comp(3, rng), comp(2, rng)]
    batch, m = build_batch(3, [[1]], [g], np.zeros(2), [np.zeros(3), np.zeros(2)], 2, cfg)
    assert batch.policy_steps.tolist() == [2, 2] == batch.policy_steps_end.tolist()
    assert m["staleness/0"] == 2 and m["dropped_stale"] == 0 and m["policy_switch_samples"] == 0


class FakeScorer:
    weights = np.ones(1)


def fake_stream(cfg: OrchConfig, groups: list[Group]) -> GroupStream:
    s = GroupStream.__new__(GroupStream)
    s.cfg, s.scorer, s.buffer, s.teacher = cfg, FakeScorer(), Buffer(cfg.buffer, cfg.dynamic_sampling), None
    s.need, s.filling, s.error, s.counts, s.gate_wait_s = cfg.batch_size // cfg.rollouts_per_example, 1, None, {}, 0.0
    s.in_flight_keys, s.changed, s.dropped = {}, asyncio.Event(), (0, 0)
    s.env_tally, s.outage, s._outage_waits = EnvFailures(), Outage(cfg.env_outage, None), 0
    s.partial = Switch("off", None, merged=False)  # partial rollouts off (tidal.orchestrator.partial)
    from collections import deque
    s.ready = deque(groups)
    return s


def test_take_drops_whole_stale_groups_and_keeps_fresh_ones_on_random_inputs():
    rng = random.Random(SEED)
    step, bound = rng.randint(3, 20), rng.randint(0, 2)
    cfg = OrchConfig(batch_size=8, rollouts_per_example=2, max_off_policy_steps=bound, max_async_level=0)
    groups = []
    while sum(not is_stale(step, g.version[0], bound) for g in groups) < 4:
        v = rng.randint(max(0, step - 6), step - 1)
        groups.append(Group(Example(prompt=f"p{len(groups)}"), [1], [comp(2, rng), comp(3, rng)],
                            np.array([[rng.random()], [rng.random()]]), [], (v, v + rng.randint(0, 1))))
    stream = fake_stream(cfg, groups)

    got = asyncio.run(stream.take(step, {}))
    fresh = [g for g in groups if not is_stale(step, g.version[0], bound)]
    stale = [g for g in groups if is_stale(step, g.version[0], bound)]
    assert got.collected.versions == [g.version for g in fresh], SEED
    assert got.dropped_stale == (2 * len(stale), len(stale)), SEED
    assert stream.filling == step + 1


def test_in_flight_refuses_eval_and_temp_scheduler_and_stray_key(tmp_path):
    with pytest.raises(ValueError, match="eval is not supported with async_mode: in_flight"):
        OrchConfig(async_mode="in_flight", eval={"env": [{"id": "reverse-text"}]})
    with pytest.raises(ValueError, match="sampling.temp_scheduler"):
        OrchConfig(async_mode="in_flight", max_steps=3,
                   sampling={"temp_scheduler": {"type": "linear", "start_temperature": 1.0,
                                                                     "end_temperature": 0.5}})
    with pytest.raises(ValueError, match="teacher.base_url .* is one of client.base_url"):
        OrchConfig(async_mode="in_flight", client={"base_url": ["http://h:8000/v1"]},
                   teacher={"base_url": "http://h:8000/v1/", "model": "m"})
    OrchConfig(async_mode="in_flight", client={"base_url": ["http://h:8000/v1"]},
               teacher={"base_url": "http://t:8001/v1", "model": "m"})  # a teacher on its own server is fine
    with pytest.raises(ValueError, match="in_flight_groups .* needs async_mode: in_flight"):
        OrchConfig(in_flight_groups=4)
    for split in (True, False):
        with pytest.raises(ValueError, match=f"in_flight_split \\({str(split).lower()}\\) needs async_mode: in_flight"):
            OrchConfig(in_flight_split=split)
    # the command line exits 2 and names the key
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-orch", "--output-dir", str(tmp_path),
                          "--orch.async_mode", "in_flight", "--orch.eval", "{env: [{id: reverse-text}]}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "async_mode: in_flight" in out.stdout + out.stderr


def test_finished_groups_too_stale_for_the_filling_batch_are_dropped_at_once():
    rng = random.Random(SEED)
    step, bound = rng.randint(4, 20), rng.randint(0, 2)
    cfg = OrchConfig(batch_size=4, rollouts_per_example=2, max_off_policy_steps=bound, max_async_level=0)
    versions = [rng.randint(max(0, step - 6), step - 1) for _ in range(rng.randint(1, 10))]
    groups = [Group(Example(prompt=f"q{i}"), [1], [comp(2, rng)] * 2, np.zeros((2, 1)), [], (v, v))
              for i, v in enumerate(versions)]
    stream = fake_stream(cfg, groups)
    stream.filling = step
    stream._drop_stale()
    stale = sum(is_stale(step, v, bound) for v in versions)
    assert [g.version[0] for g in stream.ready] == [v for v in versions if not is_stale(step, v, bound)], SEED
    assert stream.dropped == (2 * stale, stale), SEED


def test_a_replaced_adapter_is_unloaded_only_when_its_last_request_returns(tmp_path):
    """LoRA in flight: policy 2 loads while requests on policy 1's adapter run; that adapter stays loaded until
    they are released, then it is unloaded (fake servers)."""
    import httpx

    from tests.unit.test_infer_dp import FakeServers, publish
    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.orchestrator.policy import PolicyTracker

    fake = FakeServers()

    async def go() -> None:
        client = VllmClient(ClientSection(base_url=["http://127.0.0.1:8000/v1"]))
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(fake))
        tracker = PolicyTracker(client, "m", tmp_path, "default")
        try:
            publish(tmp_path, 1)
            await tracker.ensure(1, timeout_s=5)
            leases = [tracker.lease() for _ in range(random.Random(SEED).randint(1, 4))]
            assert set(leases) == {("default-step-1", 1)}
            publish(tmp_path, 2)
            await tracker.ensure(2, timeout_s=5)
            assert tracker.lease() == ("default-step-2", 2) and tracker.end_version(1) == 1  # LoRA: start == end
            tracker.release("default-step-2")
            unloads = [p for _, p in fake.log if p == "/v1/unload_lora_adapter"]
            assert not unloads, "requests still use policy 1's adapter"
            for name, _ in leases:
                tracker.release(name)
            await tracker.drain_unloads()
            assert [p for _, p in fake.log if p == "/v1/unload_lora_adapter"] == ["/v1/unload_lora_adapter"]
            assert not tracker.retired and not tracker.users
        finally:
            await client.close()

    asyncio.run(go())


def test_merged_reload_during_a_request_records_start_and_end_versions(tmp_path):
    """Merged reloads swap the weights under running requests: one leased under policy 1 that returns after
    policy 2 was loaded records (1, 2); one started after it records (2, 2) (fake servers)."""
    import httpx

    from tests.unit.test_infer_dp import FakeServers, publish
    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.orchestrator.policy import PolicyTracker

    async def go() -> None:
        client = VllmClient(ClientSection(base_url=["http://127.0.0.1:8000/v1"]))
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(FakeServers()))
        tracker = PolicyTracker(client, "m", tmp_path, "default", merged=True)
        try:
            publish(tmp_path, 1)
            await tracker.ensure(1, timeout_s=5)
            model, start = tracker.lease()
            assert (model, start) == ("m", 1) and tracker.end_version(start) == 1
            publish(tmp_path, 2)
            await tracker.ensure(2, timeout_s=5)
            assert tracker.end_version(start) == 2
            tracker.release(model)
            later = tracker.lease()
            assert later == ("m", 2) and tracker.end_version(later[1]) == 2
        finally:
            await client.close()

    asyncio.run(go())
