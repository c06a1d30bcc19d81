"""`make bench-weights`: how long a new policy takes to reach vLLM, per weight-broadcast path, in one run.

One vLLM server (LoRA off, `weight_reload` and `weight_broadcast_type: nccl` both on) and one PEFT policy of
the chosen model (LoRA on all linear layers). Each round changes the adapter and times, from "the optimizer
step is done" to "vLLM serves the new weights":

- baseline, `weight_broadcast.reload: merged` (filesystem): the trainer writes `broadcasts/step_n/` (adapter +
  merged safetensors, temp + rename + STABLE) and the orchestrator has vLLM reload them (`/collective_rpc
  reload_weights`, then `/reset_prefix_cache`);
- the same with only the LoRA-adapted weights in the merged file (what the trainer publishes for a LoRA policy
  since issue 57: `tidal.trainer.publish.broadcast.changed_keys`; the embeddings and norms stay as vLLM loaded them);
- `weight_broadcast.reload: factors`: the trainer publishes the adapter only (A, B, alpha / r; what every LoRA policy
  directory holds anyway) and the orchestrator has each vLLM worker merge it into its weights in place
  (`/collective_rpc tidal_merge_lora`, then `/reset_prefix_cache`; `tidal.inference.backends.vllm.lora_merge`): its
  first round also reads the base copy of the adapted weights the worker keeps;
- `weight_broadcast.type: nccl`: the trainer pushes the merged LoRA-adapted weights into the workers (pause,
  start, update + broadcast, finish, resume) — gloo on CPU, NCCL on GPU.

Writes `bench/WEIGHT_SYNC.md` (median and ratio; the first round of each path, which opens connections and
groups, is reported apart), with the largest gap between vLLM's prompt logprobs of one policy served through the
worker merge and through the LoRA-adapted-only merged reload (the path it replaces).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)


def report(args: argparse.Namespace, times: dict[str, list[float]], gaps: list[float], tokens: int) -> list[str]:
    """The lines of bench/WEIGHT_SYNC.md: per path, the first round and the median of the rest, as a ratio to the
    full merged reload; the worker merge's largest logprob gap to the slim merged reload."""
    base = statistics.median(times["merged files + reload"][1:])
    lines = ["# Weight broadcast: time from optimizer step to vLLM serving the new weights", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()} ({args.device}), model "
             f"`{args.model}`, LoRA r16 on all linear layers, {args.rounds} rounds; command: "
             f"`python bench/weight_sync.py {' '.join(sys.argv[1:])}`.", "",
             "| path | first round (s) | median of the rest (s) | ratio to the baseline |", "|---|---|---|---|"]
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        lines.append(f"| {name}{' (baseline)' if name == 'merged files + reload' else ''} | {ts[0]:.3f} | {med:.3f} | "
                     f"{med / base:.2f} |")
    return [*lines, "", f"Largest |vLLM prompt logprob gap| between the worker merge and the LoRA-adapted-only "
                        f"merged reload of the same policy, over {len(gaps)} policies x {tokens} tokens: "
                        f"{max(gaps):.3g}."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tidal:tiny-reverse")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(REPO / "bench" / "WEIGHT_SYNC.md"))
    args = ap.parse_args()

    import httpx
    import torch
    from peft import LoraConfig, get_peft_model

    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.models.sources import resolve_model
    from tidal.paths import broadcast_dir
    from tidal.trainer.model.load import load_base_model
    from tidal.trainer.publish.broadcast import changed_keys, checkpoint_keys, publish_adapter
    from tidal.trainer.publish.push_vllm import WeightPusher

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = get_peft_model(load_base_model(args.model, device, dtype), LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    keys = checkpoint_keys(resolve_model(args.model))
    port = harness.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-weight-bench-"))
    log = tmp / "infer.log"
    proc = harness.start("infer", [sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.model", args.model,
                                   "--infer.port", str(port), "--infer.enable_lora", "false", "--infer.weight_reload",
                                   "true", "--infer.weight_broadcast_type", "nccl"], log)
    url = f"http://127.0.0.1:{port}/v1"
    factors = "LoRA factors (adapter only) + merge in vLLM's worker"
    times: dict[str, list[float]] = {"merged files + reload": [],
                                     "merged files, LoRA-adapted weights only + reload": [], factors: [],
                                     "nccl push": []}
    probe = list(range(1, 65))  # token ids whose prompt logprobs compare the slim reload with the worker merge
    gaps: list[float] = []
    slim = changed_keys(model, keys)  # what the trainer publishes for a LoRA policy (grpo.slim_reloads)
    try:
        harness.wait_ready(proc, f"http://127.0.0.1:{port}/health", 600)
        pusher = WeightPusher([url], "127.0.0.1", harness.free_port(), 600, None, device)
        client = VllmClient(ClientSection(base_url=[url], timeout=600))
        loop = asyncio.new_event_loop()
        served = loop.run_until_complete(client.wait_ready())[0]
        for step in range(1, args.rounds + 1):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.01)
            t0 = time.perf_counter()
            publish_adapter(model, tmp, 3 * step - 2, keep=2, merged_keys=keys)  # policy numbers only go up
            loop.run_until_complete(client.reload_weights(str(broadcast_dir(tmp, 3 * step - 2) / "merged")))
            times["merged files + reload"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            publish_adapter(model, tmp, 3 * step - 1, keep=2, merged_keys=slim)
            loop.run_until_complete(client.reload_weights(str(broadcast_dir(tmp, 3 * step - 1) / "merged")))
            times["merged files, LoRA-adapted weights only + reload"].append(time.perf_counter() - t0)
            slim_lps = loop.run_until_complete(client.prompt_logprobs(served, probe))
            t0 = time.perf_counter()
            publish_adapter(model, tmp, 3 * step, keep=2)
            loop.run_until_complete(client.merge_lora(str(broadcast_dir(tmp, 3 * step))))
            times[factors].append(time.perf_counter() - t0)
            merged_lps = loop.run_until_complete(client.prompt_logprobs(served, probe))
            gaps.append(max(abs(a - b) for a, b in zip(slim_lps, merged_lps, strict=True)))
            t0 = time.perf_counter()
            pusher.push(model, step)
            times["nccl push"].append(time.perf_counter() - t0)
        version = httpx.get(f"http://127.0.0.1:{port}/weight_info").json()["weight_version"]
        assert version == str(args.rounds), version
        loop.run_until_complete(client.close())
        pusher.close()
    finally:
        harness.stop(proc)
    lines = report(args, times, gaps, len(probe))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
