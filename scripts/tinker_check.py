"""Drive a running `tidal serve-tinker` with the official tinker SDK, as a Tinker user's loop would: the `t` check of
`make gpu-check` (scripts/gpu_check.py starts the server and runs this with its time budget).

    python3 scripts/tinker_check.py URL API_KEY [--unembed]

One LoRA training client; 4 samples of a reverse-text prompt with logprobs; `forward_backward` with
`importance_sampling` (advantages: reward minus the group mean, nudged off zero) and with `cross_entropy` (the
reference answer) accumulated into one `optim_step`; `save_weights_for_sampler`; the same prompt sampled again from
the saved adapter (hot-loaded into vLLM). Fails (exit 1) unless both losses are finite and the logprobs vLLM gives
the first samples' tokens changed with the step. Prints one `TINKER_CHECK {json}` line of figures, also on failure.
Simplification: one prompt, one step; it checks the plumbing on a device, not learning (tests/integration/
test_tinker_loops.py shows the reward rising on CPU).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def drive(url: str, key: str, unembed: bool, figures: dict[str, Any]) -> None:
    import tinker
    from tinker import types as tinker_types

    from tidal.envs.reverse_text import ReverseText

    types: Any = tinker_types  # the SDK's Datum takes plain lists for TensorData at run time
    started = time.monotonic()
    service: Any = tinker.ServiceClient(base_url=url, api_key=key)
    caps: Any = tinker.RestClient(base_url=url, api_key=key).get_server_capabilities().result()
    base = caps.supported_models[0].model_name
    tc = service.create_lora_training_client(base_model=base, rank=8, seed=0, train_unembed=unembed).result()
    tok = tc.get_tokenizer()
    env = ReverseText()
    ex = env.sample(random.Random(0))
    prompt = list(tok.apply_chat_template(ex.prompt, tokenize=True, add_generation_prompt=True)["input_ids"])
    params = types.SamplingParams(max_tokens=24, temperature=1.0, seed=1)
    sampler0 = service.create_sampling_client(model_path=tc.save_weights_for_sampler("step-0").result().path).result()
    seqs = sampler0.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
    figures["first sample s"] = round(time.monotonic() - started, 1)
    rewards = [env.reward(ex, tok.decode(s.tokens, skip_special_tokens=True)) for s in seqs]
    mean = sum(rewards) / len(rewards)
    pad = [0.0] * (len(prompt) - 1)
    is_data = [types.Datum(model_input=types.ModelInput.from_ints((prompt + s.tokens)[:-1]),
                           loss_fn_inputs={"target_tokens": (prompt + s.tokens)[1:], "logprobs": pad + s.logprobs,
                                           "advantages": pad + [r - mean + 0.1 * (i % 2 - 0.5)] * len(s.tokens)})
               for i, (s, r) in enumerate(zip(seqs, rewards, strict=True))]
    answer = tok.encode(env.reference_completion(ex), add_special_tokens=False) + [tok.eos_token_id]
    full = prompt + answer
    ce_data = [types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                           loss_fn_inputs={"target_tokens": full[1:],
                                           "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})]
    fb_is = tc.forward_backward(is_data, "importance_sampling")
    fb_ce = tc.forward_backward(ce_data, "cross_entropy")
    optim = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    is_out, ce_out = fb_is.result(), fb_ce.result()
    optim.result()
    figures["importance_sampling loss:sum"] = is_out.metrics["loss:sum"]
    figures["cross_entropy loss:sum"] = ce_out.metrics["loss:sum"]
    # the trainer's logprobs of vLLM's sampled tokens at step 0 (same policy): how far the two engines agree
    gaps = [abs(a - b) for s, out in zip(seqs, is_out.loss_fn_outputs, strict=True)
            for a, b in zip(s.logprobs, out["logprobs"].to_numpy()[len(prompt) - 1:], strict=True)]
    figures["vLLM vs trainer logprob max |d| (step 0)"] = float(f"{max(gaps):.3g}")
    sampler1 = service.create_sampling_client(model_path=tc.save_weights_for_sampler("step-1").result().path).result()
    again = sampler1.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
    figures["sampled logprobs step 0 -> 1 (first seq, 4 tokens)"] = [
        [round(x, 3) for x in seqs[0].logprobs[:4]], [round(x, 3) for x in again[0].logprobs[:4]]]
    scored = types.ModelInput.from_ints(prompt + seqs[0].tokens)
    lp0, lp1 = sampler0.compute_logprobs(scored).result(), sampler1.compute_logprobs(scored).result()
    moved = max(abs(a - b) for a, b in zip(lp0[len(prompt):], lp1[len(prompt):], strict=True))
    figures["logprob change of the step-0 tokens (max |d|)"] = float(f"{moved:.3g}")
    figures["total s"] = round(time.monotonic() - started, 1)
    service.close("success").result()
    if not all(math.isfinite(figures[f"{k} loss:sum"]) for k in ("importance_sampling", "cross_entropy")):
        raise SystemExit("a loss is not finite")
    if not moved > 1e-3:
        raise SystemExit(f"the optimizer step did not change vLLM's logprobs (max change {moved:.2g})")


def main() -> int:
    url, key = sys.argv[1], sys.argv[2]
    figures: dict[str, Any] = {}
    try:
        drive(url, key, "--unembed" in sys.argv[3:], figures)
    finally:
        print("TINKER_CHECK " + json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
