"""tidal.tinker.trainer on the bundled model: target logprobs equal the model's own, packing into rows changes
nothing, the optimizer step is AdamW with the SDK's parameters (float64 reference), LoRA layer groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import MODEL
from tidal.tinker.trainer import AdamStep, LoraSpec, TrainerError, TrainerHost, lora_targets
from tidal.tinker.wire import Datum, FwdBwdRequest


@pytest.fixture(scope="module")
def host() -> TrainerHost:
    return TrainerHost(MODEL, torch.device("cpu"), micro_batch_tokens=16)


def make_data(seed: int, k: int | None = None) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (5, 11, 3, 17):
        tokens = rng.integers(3, 128, n).tolist()
        shape = (n,) if k is None else (n, k)
        data.append(Datum(tokens, {"target_tokens": rng.integers(0, 128, shape),
                                   "weights": rng.integers(0, 2, shape).astype(np.float32)}))
    return data


def request(model_id: str, data: list[Datum], forward_only: bool = False, loss_fn: str = "cross_entropy"):
    return FwdBwdRequest(model_id, 1, loss_fn, {}, forward_only, data)


def reference_logprobs(host: TrainerHost, d: Datum) -> np.ndarray:
    with torch.no_grad():
        logits = host.peft(input_ids=torch.tensor([d.tokens])).logits[0].double()  # (N, V), one sequence alone
    lp = torch.log_softmax(logits, -1)
    t = torch.from_numpy(d.inputs["target_tokens"])
    return lp.gather(-1, t.view(len(d.tokens), -1)).view(t.shape).numpy()


@pytest.mark.parametrize("k", [None, 3])
def test_target_logprobs_equal_the_models(host, k):
    if "lp" not in host.adapters:
        host.create("lp", LoraSpec(rank=4, seed=1))
    data = make_data(0, k)
    outs, metrics = host.forward_backward(request("lp", data, forward_only=True))
    total = 0.0
    for d, out in zip(data, outs, strict=True):
        want = reference_logprobs(host, d)
        np.testing.assert_allclose(out["logprobs"], want, atol=2e-5)
        total += -(want * d.inputs["weights"]).sum()
    assert metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert all(p.grad is None for p in host.adapters["lp"].params.values())  # forward: no gradient


def grads(host: TrainerHost, name: str) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in host.adapters[name].params.items() if p.grad is not None}


def test_packing_into_rows_changes_nothing(host):
    host.create("pack", LoraSpec(rank=4, seed=2))
    with torch.no_grad():  # B != 0, so the gradients reach A as well
        for k, p in host.adapters["pack"].params.items():
            if "lora_B" in k:
                p.normal_(0, 0.05)
    data = make_data(1)
    host.micro_batch_tokens = 16  # 4 rows
    _, m_small = host.forward_backward(request("pack", data))
    g_small = grads(host, "pack")
    host.optim_step("pack", AdamStep(learning_rate=0.0))  # resets the gradients
    host.micro_batch_tokens = 10_000  # one row
    _, m_one = host.forward_backward(request("pack", data))
    g_one = grads(host, "pack")
    assert m_small["loss:sum"] == pytest.approx(m_one["loss:sum"], rel=1e-5)
    assert set(g_small) == set(g_one) and len(g_one) > 0
    for key in g_one:  # float32 sums in another order: tolerance relative to the tensor's scale
        torch.testing.assert_close(g_small[key], g_one[key], rtol=1e-4, atol=1e-4 * float(g_one[key].abs().max()))


def test_optim_step_is_adamw_with_the_sdk_parameters(host):
    host.create("adam", LoraSpec(rank=4, seed=3))
    host.forward_backward(request("adam", make_data(2)))
    params = host.adapters["adam"].params
    before = {k: p.detach().double().clone() for k, p in params.items()}
    g = {k: p.grad.double().clone() for k, p in params.items()}
    step = AdamStep(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.05)
    metrics = host.optim_step("adam", step)
    norm = torch.sqrt(sum((x ** 2).sum() for x in g.values()))
    assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-5)
    assert float(norm) > step.grad_clip_norm  # the clip is exercised
    scale = min(1.0, step.grad_clip_norm / (float(norm) + 1e-6))  # torch's clip_grad_norm_
    for k, p in params.items():
        gk = g[k] * scale
        m_hat = (1 - step.beta1) * gk / (1 - step.beta1)  # first step: bias-corrected moments
        v_hat = (1 - step.beta2) * gk ** 2 / (1 - step.beta2)
        want = before[k] * (1 - step.learning_rate * step.weight_decay) - step.learning_rate * m_hat / (
            v_hat.sqrt() + step.eps)
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-7)
        assert p.grad is None


def test_lora_layer_groups(host):
    groups = host.groups  # of the base model, before any adapter was added
    assert groups["attn"] == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert groups["mlp"] == {"gate_proj", "up_proj", "down_proj"}
    assert groups["unembed"] == {"lm_head"}
    assert lora_targets(groups, LoraSpec(8, train_mlp=False, train_unembed=False), True) == [
        "k_proj", "o_proj", "q_proj", "v_proj"]
    assert "lm_head" in lora_targets(groups, LoraSpec(8), True)
    with pytest.raises(TrainerError, match="train_unembed=False"):
        lora_targets(groups, LoraSpec(8), unembed_ok=False)
    with pytest.raises(TrainerError, match="at least one"):
        lora_targets(groups, LoraSpec(8, train_mlp=False, train_attn=False, train_unembed=False), True)
    with pytest.raises(TrainerError, match="train_mlp"):
        lora_targets({"attn": {"q"}, "mlp": set(), "unembed": set()}, LoraSpec(8, train_unembed=False), True)


def test_bad_datums_are_refused(host):
    host.create("bad", LoraSpec(rank=2))
    bad_len = [Datum([1, 2, 3], {"target_tokens": np.array([1, 2])})]
    with pytest.raises(TrainerError, match="model_input's length"):
        host.forward_backward(request("bad", bad_len))
    bad_id = [Datum([1, 2], {"target_tokens": np.array([1, 999])})]
    with pytest.raises(TrainerError, match="outside the vocabulary"):
        host.forward_backward(request("bad", bad_id))
    with pytest.raises(TrainerError, match="does not take loss_fn_inputs mask"):
        host.forward_backward(request("bad", [Datum([1], {"target_tokens": np.array([1]), "logprobs": np.zeros(1),
                                                          "advantages": np.zeros(1), "mask": np.ones(1)})],
                                      loss_fn="importance_sampling"))
    with pytest.raises(TrainerError, match="unknown model_id"):
        host.forward_backward(request("nope", make_data(0)))


def test_checkpoints_are_atomic_and_loads_need_stable(host, tmp_path, monkeypatch):
    """save_state / save_sampler fill a temp directory renamed into place with `STABLE` last
    (`tidal.paths.atomic_dir`); a failed save leaves the previous checkpoint; the service loads only complete ones."""
    import safetensors.torch

    from tidal.paths import STABLE, tinker_ckpt_dir
    from tidal.tinker.service import TinkerService, UserError

    host.create("ckpt", LoraSpec(rank=4, seed=5))
    state = tinker_ckpt_dir(tmp_path, "ckpt", "weights", "a")
    host.save_state("ckpt", state, "base")
    host.save_sampler("ckpt", tinker_ckpt_dir(tmp_path, "ckpt", "sampler_weights", "a"))
    for d in (state, tinker_ckpt_dir(tmp_path, "ckpt", "sampler_weights", "a")):
        assert (d / STABLE).is_file() and (d / "adapter_model.safetensors").is_file()
    assert TrainerHost.read_record(state)["lora"]["rank"] == 4
    before = (state / "adapter_model.safetensors").read_bytes()

    def disk_full(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    host.adapters["ckpt"].steps = 7
    with pytest.raises(OSError, match="disk full"):
        host.save_state("ckpt", state, "base")
    assert (state / "adapter_model.safetensors").read_bytes() == before and (state / STABLE).is_file()
    assert TrainerHost.read_record(state)["steps"] == 0
    assert sorted(p.name for p in state.parent.iterdir()) == ["a"]  # no temp left behind
    service = TinkerService("m", "m", "arch", 64, host, None, tmp_path, 32, set(), "m")  # type: ignore[arg-type]
    assert service.local("tinker://ckpt/weights/a") == state
    (state / STABLE).unlink()
    with pytest.raises(UserError, match="no \\(complete\\) checkpoint"):
        service.local("tinker://ckpt/weights/a")
    service.worker.shutdown()
