"""What the policy identity check can tell apart under a 16-bit sampler: capture, then replay (bench/PROBE-68.md).

`capture RUN KEPT URL OUT`: RUN is a finished `tidal grpo` run directory, KEPT a directory holding copies of its
`broadcasts/step_n` (a run keeps only its newest few; copy them as they appear, bench/PROBE-68.md says how), URL a
vLLM server started with the run's infer config (`tidal grpo-infer RUN/configs/infer.yaml`, another port; with
`weight_reload: true`, as the run's factors merges need). For the base and each kept policy it records the trainer's
logprobs of a random probe (`tidal.trainer.publish.probe.score`: the trainer's model built from RUN/configs/train.yaml,
scored without autocast, as the trainer now publishes them) and the server's prompt logprobs after merging that
policy into it (`VllmClient.merge_lora`, orch `weight_broadcast.reload: factors`), and writes them to OUT (json:
`ids`, `trainer`, `served`, one list per policy, base first: tests/data/probe_bf16_smollm2.json is one).

`replay OUT [--lengths 32,64,128,256]`: for each probe length (its first tokens), the verdicts `tidal.transport.probe
.judge` gives as `tidal grpo` runs it (the record's previous policy and base, the last 8 policies checked): false
alarms on the policy actually served, the lowest placement of a served policy and the highest of a stale one at
resolution >= 1, and, for a sampler stuck on policy j, the steps until the check and until the distance alone
(tolerance 0.1) catches it. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

EARLIER = 8  # tidal.orchestrator.identity.IdentityCheck.EARLIER


def trainer_side(run: Path, kept: Path, steps: list[int], length: int) -> tuple[list[int], list[list[float]]]:
    """The probe's ids and the trainer's logprobs of them for the base and each kept policy."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from tidal.config.load import load_config
    from tidal.config.train import TrainConfig
    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_policy, load_tokenizer
    from tidal.trainer.publish.probe import score, vocab_limit
    from tidal.transport.probe import probe_ids

    cfg = load_config(TrainConfig, run / "configs/train.yaml")
    torch.set_num_threads(2)
    model, _ = load_policy(cfg)
    ids = probe_ids(vocab_limit(model, load_tokenizer(resolve_model(cfg.model))), length)
    with model.disable_adapter():  # type: ignore[operator]
        out = [score(model, ids)]
    for n in steps:
        set_peft_model_state_dict(model, load_file(str(kept / f"step_{n}/adapter_model.safetensors")))
        out.append(score(model, ids))
    return ids, out


async def served_side(url: str, model: str, kept: Path, steps: list[int], ids: list[int]) -> list[list[float]]:
    """The server's prompt logprobs of `ids` with the base, then with each kept policy merged in."""
    from tidal.config.orch_sections import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient

    client = VllmClient(ClientSection(base_url=[url]))
    try:
        out = [await client.prompt_logprobs(model, ids)]
        for n in steps:
            await client.merge_lora(str(kept / f"step_{n}"))
            out.append(await client.prompt_logprobs(model, ids))
        return out
    finally:
        await client.close()


def capture(args: argparse.Namespace) -> None:
    from tidal.config.load import load_config
    from tidal.config.train import TrainConfig

    run, kept = Path(args.run), Path(args.kept)
    steps = sorted(int(p.name.split("_")[1]) for p in kept.glob("step_*"))
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"{kept} must hold step_1 .. step_N without gaps (found {steps})")
    ids, trainer = trainer_side(run, kept, steps, args.length)
    model = load_config(TrainConfig, run / "configs/train.yaml").model
    served = asyncio.run(served_side(args.url, model, kept, steps, ids))
    Path(args.out).write_text(json.dumps({"about": args.about, "ids": ids,
                                          "trainer": [[round(x, 6) for x in v] for v in trainer],
                                          "served": [[round(x, 6) for x in v] for v in served]},
                                         separators=(",", ":")))
    print(f"wrote {args.out}: {len(steps)} policies, {len(ids)} tokens")


def verdicts(data: dict[str, Any], length: int) -> dict[str, Any]:
    """One length's row: see the module doc."""
    from tidal.transport.probe import ProbeRecord, Verdict, distance, judge, position

    t = [v[:length] for v in data["trainer"]]
    s = [v[:length] for v in data["served"]]
    last = len(t) - 1

    def verdict(j: int, n: int) -> Verdict:
        rec = ProbeRecord(step=n, ids=data["ids"][:length], new=t[n], dtype="bfloat16", previous=t[n - 1],
                          previous_step=n - 1, base=t[0])
        return judge(s[j], rec, 0.1, {k: t[k] for k in range(max(n - EARLIER, 1), n)})

    placed = [(position(s[n], t[j], t[n]), position(s[j], t[j], t[n])) for n in range(1, last + 1) for j in range(n)]
    return {"length": length, "false_alarms": sum(not verdict(n, n).ok for n in range(1, last + 1)),
            "served_min": min(p[0][0] for p in placed if p[0][1] >= 1.0),
            "stale_max": max(p[1][0] for p in placed if p[1][1] >= 1.0),
            "one_step": sum(not verdict(n - 1, n).ok for n in range(2, last + 1)),
            "lags": [next((n - j for n in range(j + 1, last + 1) if not verdict(j, n).ok), None) for j in range(last)],
            "distance_lags": [next((n - j for n in range(j + 1, last + 1) if distance(s[j], t[n]) > 0.1), None)
                              for j in range(last)]}


def replay(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.data).read_text())
    print("| probe tokens | false alarms (policy n served) | lowest served placement | highest stale placement | "
          "n - 1 served, caught | steps until a sampler stuck on policy j = 0, 1, ... is caught | the distance alone |")
    print("|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        r = verdicts(data, length)
        show = lambda v: ", ".join("-" if x is None else str(x) for x in v)  # noqa: E731
        print(f"| {r['length']} | {r['false_alarms']} of {len(data['trainer']) - 1} | {r['served_min']:.2f} | "
              f"{r['stale_max']:.2f} | {r['one_step']} of {len(data['trainer']) - 2} | {show(r['lags'])} | "
              f"{show(r['distance_lags'])} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("run")
    c.add_argument("kept")
    c.add_argument("url")
    c.add_argument("out")
    c.add_argument("--length", type=int, default=384)
    c.add_argument("--about", default="")
    r = sub.add_parser("replay")
    r.add_argument("data")
    r.add_argument("--lengths", default="32,64,128,256")
    args = ap.parse_args()
    capture(args) if args.cmd == "capture" else replay(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
