"""MoE router replay against float64 references, per architecture (tiny random configs, no download).

Replaying the trainer's own routes gives exactly the unpatched model's logits; replacing one token's experts at
one layer changes that token's logits and, when the layer is not the last, those of the later tokens of its own
sequence (they attend to its hidden state in the layers above), nothing before it and nothing in another row;
the replayed gate weights are (to float32's precision: the routers' softmax runs in float32) the float64 softmax
of the router logits at the replayed experts, renormalised as the architecture does. The routes travel through
the client, TrainingBatch (safetensors) and packing; the refusals exit 2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tidal.config.load import ConfigError
from tidal.models.arch import ArchInfo
from tidal.models.routes import decode_routes, no_route, resolve_router_replay, route_dtype, sample_routes
from tidal.trainer.model import router_replay
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64,
         "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 6, "moe_intermediate_size": 16, "norm_topk_prob": True,
                                     "decoder_sparse_step": 1}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 6, "moe_intermediate_size": 16, "norm_topk_prob": False,
                                     "shared_expert_intermediate_size": 16, "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 6, "sliding_window": None}),
    "olmoe": ("OlmoeConfig", {"num_experts": 6, "norm_topk_prob": False}),
}


def tiny(arch: str, seed: int) -> torch.nn.Module:
    cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cls)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64,
                                                          experts_implementation="eager").eval()
    with torch.no_grad():  # routers init to zeros in some architectures: distinct logits, distinct routes
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    return model


def own_routes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, T, V), routes (B, T, layers, k)) of the unpatched model, routes read from its routers."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2].clone()))
             for i, m in enumerate(m for m in model.modules() if type(m).__name__.endswith("TopKRouter"))]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    b, t = ids.shape
    return logits, torch.stack([seen[i] for i in sorted(seen)], dim=1).reshape(b, t, len(seen), -1)


def replayed(model: torch.nn.Module, ids: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    router_replay.use(model, routes)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_replay_float64(arch: str) -> None:
    seed = int(np.random.default_rng().integers(1 << 30))
    model = tiny(arch, seed)
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (2, 12), generator=rng)
    base, routes = own_routes(model, ids)
    layers, k, experts = routes.shape[2], routes.shape[3], 6
    assert router_replay.install(model, replay=True) == layers
    # own routes: identical logits (float64, bitwise: the same softmax values at the same experts)
    assert torch.equal(replayed(model, ids, routes), base), f"seed {seed}"
    # no route anywhere (-1): the routers choose, identical too
    assert torch.equal(replayed(model, ids, torch.full_like(routes, -1)), base)
    t = 5
    for layer in (0, layers - 1):
        other = routes.clone()
        own = set(routes[0, t, layer].tolist())
        other[0, t, layer] = torch.tensor([e for e in range(experts) if e not in own][:k])
        got = replayed(model, ids, other)
        diff = (got - base).abs().amax(-1)  # (B, T)
        changed = {t} | (set(range(t + 1, ids.shape[1])) if layer < layers - 1 else set())
        for pos in range(ids.shape[1]):
            if pos in changed:
                assert diff[0, pos] > 1e-9, f"{arch} layer {layer}: token {pos} did not change (seed {seed})"
            else:
                assert diff[0, pos] == 0, f"{arch} layer {layer}: token {pos} changed (seed {seed})"
        assert diff[1].max() == 0  # another row: untouched
    # the gate weights the experts get: float64 softmax of the router logits at the replayed experts
    check_gate(model, ids, routes, arch)


def check_gate(model: torch.nn.Module, ids: torch.Tensor, routes: torch.Tensor, arch: str) -> None:
    router = next(m for m in model.modules() if type(m).__name__.endswith("TopKRouter"))
    got: list[tuple] = []
    h = router.register_forward_hook(lambda m, a, out: got.append((a[0], out)))
    perm = routes.flip(-1)[..., :]  # same experts, another order
    perm[0, 3, 0] = torch.tensor([0, 1])  # and one token sent elsewhere
    replayed(model, ids, perm)
    h.remove()
    hidden, (logits, weights, experts) = got[-1]
    want_idx = perm[:, :, 0].reshape(-1, 2)
    assert torch.equal(experts, want_idx)
    ref = torch.softmax(hidden.reshape(-1, hidden.shape[-1]) @ router.weight.T, -1).gather(-1, want_idx)
    if arch == "mixtral" or getattr(router, "norm_topk_prob", False):
        ref = ref / ref.sum(-1, keepdim=True)
    # every architecture computes its router softmax in float32 (`dtype=torch.float`), the replay too: float32's
    # precision against the float64 reference
    assert weights.dtype == (torch.float32 if arch == "mixtral" else torch.float64)
    assert torch.allclose(weights.double(), ref, rtol=0, atol=1e-6)
    assert not torch.allclose(weights.double(), ref.flip(-1), rtol=0, atol=1e-3)


def test_agreement_and_measure_only() -> None:
    model = tiny("qwen3_moe", 3)
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    base, routes = own_routes(model, ids)
    router_replay.install(model, replay=False)
    other = routes.clone()
    other[0, :5, 0] = (routes[0, :5, 0] + 1) % 6  # 5 of 30 token-layers differ (a shifted pair is another set)
    other[0, 9] = -1  # the last token: no route (not counted)
    router_replay.use(model, other)
    out = model(input_ids=ids).logits  # with autograd: the training forward counts
    assert torch.equal(out.detach(), base)  # measure only: the model's own routing
    metrics = router_replay.step_metrics(model, lambda v: v)
    assert metrics["router/routes"] == 9 * 3
    assert metrics["router/agreement"] == pytest.approx(1 - 5 / 27)


def test_routes_batch_roundtrip_and_packing(tmp_path) -> None:
    layers, k = 3, 2
    dtype = route_dtype(6)
    assert dtype == np.uint8 and route_dtype(300) == np.int16
    raw = np.random.default_rng(0).integers(0, 6, (7, layers, k))  # vLLM: every token but the last
    import base64
    import io
    buf = io.BytesIO()
    np.save(buf, raw.astype(np.uint8))
    got = decode_routes(base64.b64encode(buf.getvalue()).decode())
    one = sample_routes(got, 8, layers, k, dtype)
    assert (one[:7] == raw).all() and (one[7] == no_route(dtype)).all()
    two = sample_routes(None, 5, layers, k, dtype)
    batch = TrainingBatch(step=1, temperature=1.0, tokens=np.arange(13) % 50 + 3, lengths=np.array([8, 5]),
                          loss_mask=np.array([0] * 4 + [1] * 4 + [0] * 2 + [1] * 3),
                          inference_logprobs=np.zeros(13), advantages=np.zeros(13), rewards=np.zeros(2),
                          policy_steps=np.zeros(2), routed_experts=np.concatenate([one, two]))
    batch.save(tmp_path / "b.safetensors")
    back = TrainingBatch.load(tmp_path / "b.safetensors")
    assert back.routed_experts is not None and back.routed_experts.dtype == np.uint8
    assert (back.routed_experts == batch.routed_experts).all()
    assert (TrainingBatch.from_bytes(batch.to_bytes()).routed_experts == batch.routed_experts).all()
    mbs = pack(back, 16, 2)
    rows = torch.cat([mb.routed_experts.reshape(-1, layers, k) for mb in mbs])
    ids = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
    seq = torch.cat([mb.seq_ids.reshape(-1) for mb in mbs])
    assert (rows[seq == 0][:7] == torch.from_numpy(raw)).all() and (rows[seq == 0][7] == -1).all()
    assert (rows[seq == 1] == -1).all() and (rows[seq < 0] == -1).all()
    assert torch.equal(ids[seq == 0], torch.from_numpy(batch.tokens[:8]).long())
    with pytest.raises(ValueError, match="routed_experts"):
        TrainingBatch(step=1, temperature=1.0, tokens=np.arange(3), lengths=np.array([3]), loss_mask=np.ones(3),
                      inference_logprobs=np.zeros(3), advantages=np.zeros(3), rewards=np.zeros(1),
                      policy_steps=np.zeros(1), routed_experts=np.zeros((2, 3, 2), dtype=np.uint8))


def test_resolution_and_refusals() -> None:
    moe = ArchInfo("Qwen3MoeForCausalLM", "qwen3_moe", True, False, False)
    dense = ArchInfo("Qwen3ForCausalLM", "qwen3", False, True, False)
    other = ArchInfo("DeepseekV3ForCausalLM", "deepseek_v3", True, False, False)
    assert resolve_router_replay("auto", moe, "m", None) is True
    assert resolve_router_replay("auto", moe, "m", "vLLM-CPU cannot") is False
    assert resolve_router_replay("auto", dense, "m", None) is False
    assert resolve_router_replay(False, moe, "m", None) is False
    for info, match in ((dense, "dense"), (other, "replays routes for"), (moe, "vLLM-CPU cannot")):
        with pytest.raises(ConfigError, match=match):
            resolve_router_replay(True, info, "m", "vLLM-CPU cannot" if info is moe else None)


def test_true_without_routes_stops_the_trainer() -> None:
    model = tiny("olmoe", 0)
    with pytest.raises(ValueError, match="carries no routed experts"):
        router_replay.prepare(model, True, False, 4)
    router_replay.prepare(model, "auto", False, 4)
    assert router_replay.state_of(model) is None  # nothing hooked without routes
    router_replay.prepare(model, False, True, 5)
    state = router_replay.state_of(model)
    assert state is not None and state.replay is False


def test_client_reads_routes_from_generate() -> None:
    """vLLM 0.24's `/inference/v1/generate` answer as its source writes it (vLLM-CPU cannot produce one: routes
    need Model Runner V2, which needs Triton; `tidal.models.routes`): ids, logprobs, routes and the text from
    /detokenize reach the Completion; the routes reach the batch."""
    import asyncio
    import base64
    import io
    import json

    import httpx

    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.models.routes import batch_routes

    routes = np.random.default_rng(1).integers(0, 6, (4 + 3 - 1, 3, 2)).astype(np.uint8)
    buf = io.BytesIO()
    np.save(buf, routes)
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"path": request.url.path, **body})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": "".join(chr(97 + t) for t in body["tokens"])})
        choice = {"index": 0, "finish_reason": "stop", "token_ids": [5, 6, 2],
                  "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5} for t in (5, 6, 2)]},
                  "routed_experts": base64.b64encode(buf.getvalue()).decode()}
        return httpx.Response(200, json={"choices": [choice]})

    async def go():
        client = VllmClient(ClientSection(base_url=["http://vllm:1/v1"], return_routed_experts=True))
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        try:
            return await client.sample("m", [9, 8, 7, 3], 1, 8, 1.0, seed=3)
        finally:
            await client.close()

    (comp,) = asyncio.run(go())
    assert seen[0]["path"] == "/inference/v1/generate" and seen[0]["token_ids"] == [9, 8, 7, 3]
    assert seen[0]["sampling_params"]["n"] == 1 and seen[0]["sampling_params"]["seed"] == 3
    assert seen[0]["sampling_params"]["output_kind"] == 2  # FINAL_ONLY: vLLM 0.24 answers all n (test_short_groups)
    assert comp.token_ids == [5, 6, 2] and comp.logprobs == [-0.5] * 3 and comp.text == "fg"  # EOS left out
    assert (comp.routed_experts == routes).all()
    stacked = batch_routes([(7, comp.routed_experts), (5, None)])
    assert stacked is not None and stacked.shape == (12, 3, 2) and stacked.dtype == np.uint8
    assert (stacked[:6] == routes).all() and (stacked[6:] == 255).all()


def test_refusals_exit_2(tmp_path, capsys) -> None:
    """`tidal grpo --dry-run` / `grpo-infer` exit 2 naming the key and the reason, before anything starts."""
    import re

    from tests.archs import build
    from tidal.cli import main

    moe = str(build("qwen3-moe", tmp_path / "moe"))
    cases = {
        "dense": (["grpo", "--dry-run", "--train.router_replay", "true"], r"router_replay: true.*is dense"),
        "vLLM-CPU": (["grpo", "--dry-run", "--model", moe, "--train.router_replay", "true"],
                     r"router_replay: true, but vLLM-CPU 0.32 cannot return routed experts.*Model Runner V2"),
        "infer on CPU": (["grpo-infer", "--infer.model", moe, "--infer.enable_lora", "false",
                          "--infer.return_routed_experts", "true"],
                         r"return_routed_experts: true, but vLLM-CPU 0.32 cannot.*Triton"),
        "infer sglang": (["grpo-infer", "--infer.backend", "sglang", "--infer.return_routed_experts", "true"],
                         r"return_routed_experts asks vLLM.*SGLang backend"),
        "orch sglang": (["grpo-orch", "--orch.client.backend", "sglang", "--orch.client.return_routed_experts",
                         "true"], r"return_routed_experts: tidal's SGLang backend"),
    }
    for name, (args, match) in cases.items():
        code = main(args)
        out, err = capsys.readouterr()
        assert code == 2, f"{name}: exit {code}\n{err[-2000:]}"
        assert re.search(match, err, re.S), f"{name}: {err[-2000:]}"
    # auto on CPU: no routes asked for, the run derives as before
    assert main(["grpo", "--dry-run", "--model", moe]) == 0
    assert "return_routed_experts: true" not in capsys.readouterr().out
