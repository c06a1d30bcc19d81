"""`weight_broadcast.type: nccl` against real vLLM: the trainer pushes merged LoRA weights into the workers
through vLLM's weight-transfer engine (gloo on this CPU machine) and vLLM then serves exactly that policy."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.conftest import MODEL, free_port
from tests.integration.test_vllm_server import sample, trainer_logprobs
from tidal.trainer.model.load import load_base_model
from tidal.trainer.publish.broadcast import lora_merged_weights
from tidal.trainer.publish.push_vllm import WeightPusher

pytestmark = pytest.mark.vllm

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_policy(seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_base_model(MODEL, torch.device("cpu"), torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


def gap(model, url: str) -> float:
    prompt, comps = sample(url, MODEL)
    return max(float((trainer_logprobs(model, prompt, c, 1.0) - torch.tensor(c.logprobs)).abs().max())
               for c in comps)


def test_merged_weights_equal_peft_merge_in_float64():
    model = random_policy(3).double()
    ours = dict(lora_merged_weights(model))
    reference = {k.removesuffix(".weight"): v for k, v in model.merge_and_unload().state_dict().items()}
    assert len(ours) == 7 * len({k.split(".self_attn")[0].split(".mlp")[0] for k in ours})
    for name, w in ours.items():
        assert torch.allclose(w, reference[name.removesuffix(".weight")], atol=1e-12, rtol=0), name


def test_pushed_policy_is_served_exactly_and_versioned(nccl_server):
    url, proc, log = nccl_server
    root = url.removesuffix("/v1")
    base = load_base_model(MODEL, torch.device("cpu"), torch.float32).eval()
    assert gap(base, url) < 1e-4
    pusher = WeightPusher([url], "127.0.0.1", free_port(), timeout_s=60, api_key=None, device=torch.device("cpu"))
    try:
        first = random_policy(1)
        pusher.push(first, 1)
        assert httpx.get(f"{root}/weight_info").json()["weight_version"] == "1"
        assert gap(first, url) < 1e-4, "vLLM must serve the pushed policy"
        assert gap(base, url) > 1e-2, "the push must change the served weights"
        second = random_policy(2)  # the group stays open: a second push reuses it
        group = pusher.group
        pusher.push(second, 2)
        assert pusher.group is group
        assert httpx.get(f"{root}/weight_info").json()["weight_version"] == "2"
        assert gap(second, url) < 1e-4 and gap(first, url) > 1e-2
        assert httpx.get(f"{root}/is_paused").json()["is_paused"] is False
    finally:
        pusher.close()
    assert proc.poll() is None, log.read_text()[-2000:]


def test_push_to_a_dead_server_fails_closes_the_group_and_a_later_push_reopens(nccl_server, tmp_path):
    url, _, _ = nccl_server
    dead = f"http://127.0.0.1:{free_port()}/v1"
    pusher = WeightPusher([dead], "127.0.0.1", free_port(), timeout_s=5, api_key=None, device=torch.device("cpu"))
    with pytest.raises(httpx.HTTPError):
        pusher.push(random_policy(4), 3)
    assert pusher.group is None
    pusher.roots = [url.removesuffix("/v1")]  # the server is back (as after a restart)
    policy = random_policy(5)
    pusher.push(policy, 3)
    pusher.close()
    assert gap(policy, url) < 1e-4


def test_a_taken_rendezvous_port_is_a_clear_error_and_the_server_recovers(nccl_server):
    import socket
    import time

    url, proc, _ = nccl_server
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pusher = WeightPusher([url], "127.0.0.1", port, timeout_s=5, api_key=None, device=torch.device("cpu"))
        with pytest.raises(RuntimeError, match=rf"127.0.0.1:{port}.*weight_broadcast.host / port"):
            pusher.push(random_policy(6), 4)
    time.sleep(6)  # the worker gives up its rendezvous after its timeout
    pusher = WeightPusher([url], "127.0.0.1", free_port(), timeout_s=30, api_key=None, device=torch.device("cpu"))
    policy = random_policy(7)
    pusher.push(policy, 5)
    pusher.close()
    assert gap(policy, url) < 1e-4 and proc.poll() is None


def full_policy(seed: int) -> torch.nn.Module:
    """The bundled model with every weight moved, its tied input embedding (= lm_head) included."""
    torch.manual_seed(seed)
    model = load_base_model(MODEL, torch.device("cpu"), torch.float32)
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


async def reload(url: str, weights_dir) -> None:
    """vLLM reloads the full weights in `weights_dir` in place (`weight_broadcast.reload: merged`)."""
    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient

    client = VllmClient(ClientSection(base_url=[url]))
    try:
        await client.reload_weights(str(weights_dir))
    finally:
        await client.close()


def test_a_fully_fine_tuned_tied_model_is_served_exactly_after_reloads_and_pushes(nccl_server, tmp_path):
    """vLLM-CPU keeps a pre-packed copy of a tied lm_head; `tidal.inference.backends.vllm.tied_head` re-packs it after
    every
    in-place update, so each new policy's head (= its new embedding) is the one vLLM samples from."""
    import asyncio

    from safetensors.torch import save_file

    from tidal.models.sources import resolve_model
    from tidal.trainer.publish.broadcast import checkpoint_keys, merged_state_dict

    url, proc, log = nccl_server
    base = load_base_model(MODEL, torch.device("cpu"), torch.float32).eval()
    pusher = WeightPusher([url], "127.0.0.1", free_port(), timeout_s=60, api_key=None, device=torch.device("cpu"))
    try:
        for step, how in enumerate(["reload", "push", "reload", "push"], start=11):
            policy = full_policy(step)
            if how == "push":
                pusher.push(policy, step)
            else:
                out = tmp_path / f"step_{step}"
                out.mkdir()
                save_file(merged_state_dict(policy, checkpoint_keys(resolve_model(MODEL))),
                          str(out / "model.safetensors"))
                asyncio.run(reload(url, out))
            assert gap(policy, url) < 1e-3, f"step {step} ({how}): vLLM serves another policy than the published one"
            assert gap(base, url) > 1e-2, f"step {step} ({how}): the update must change the served weights"
        pusher.push(base, step + 1)  # leave the server on the base weights for the other tests
        assert gap(base, url) < 1e-3
    finally:
        pusher.close()
    assert proc.poll() is None, log.read_text()[-2000:]
