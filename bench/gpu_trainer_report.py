"""The report of `make bench-gpu` (bench/gpu_trainer.py): one markdown section per device kind with a table per row
shape (tokens/s, MFU, peak memory, compiled graphs; the prime-rl shape against prime-rl's H100 anchor figures), the
`BENCH_ROW` json lines scripts/gpu_check.py reads, and the variant ratios. Pure formatting of the rows the
benchmark's children measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAMES = {"0.6b": "Qwen3-0.6B", "4b": "Qwen3-4B", "8b": "Llama-3.1-8B"}
ANCHOR = {"0.6b": (13.34e3, 10.9, 5.1), "4b": (6.23e3, 21.7, 23.3)}
"""prime-rl on one H100, LoRA: tokens/s, MFU %, peak GiB (the figures issue 14 quotes)."""


def row_text(tokens: int, sample: int) -> str:
    """`samples x tokens` of a row, e.g. `16 x 1,024` or `1 x 16,384`."""
    whole, rest = divmod(tokens, sample)
    return f"{whole} x {sample:,}" + (f" + 1 x {rest:,}" if rest else "")


def shape_text(shape: str, tokens: int, sample: int) -> str:
    """What a shape's rows hold, for the line above its table."""
    if shape == "prime-rl":
        return (f"prime-rl's shape: one causal sequence of {tokens:,} tokens per row (micro-batch), the loss on every "
                f"token, as prime-rl's trainer benchmark feeds it (`FakeDataLoader`, `generate_samples=False`); MFU "
                f"counts attention over the whole causal sequence (c_i up to {tokens:,}). The only shape compared "
                f"with prime-rl.")
    return (f"Packed GRPO shape: samples of {sample:,} tokens ({row_text(tokens, sample)}; a quarter of each a "
            f"prompt, no loss) in one {tokens:,}-token row, position_ids restarting per sample, no attention across "
            f"samples; MFU counts attention within each sample (c_i up to {sample:,}). Not prime-rl's shape: no ratio "
            f"to prime-rl.")


def mfu(r: dict[str, Any], peak_tflops: float | None) -> float | None:
    return r["achieved_tflops"] / peak_tflops if peak_tflops else None


def anchor_ratios(r: dict[str, Any], compare: bool) -> tuple[float, float] | None:
    """(tokens/s, peak memory) against prime-rl's anchor: only a prime-rl-shape row of a full-size run."""
    if not compare or r["shape"] != "prime-rl" or r["model"] not in ANCHOR:
        return None
    tps, _, mem = ANCHOR[r["model"]]
    return r["tokens_per_s"] / tps, r["peak_gib"] / mem


def graphs_text(r: dict[str, Any]) -> str:
    """`flex (budget) / dynamo`, with what was compiled during the timed steps, if anything."""
    def num(key: str) -> str:
        return "n/a" if r.get(key) is None else str(r[key])

    flex = num("flex_graphs") + (f" (budget {r['flex_graph_budget']})" if r.get("flex_graph_budget") is not None
                                 else "")
    timed = [f"+{r[k]} {k.split('_')[0]}" for k in ("flex_graphs_timed", "dynamo_graphs_timed") if r.get(k)]
    return f"{flex} / {num('dynamo_graphs')}" + (f" ({', '.join(timed)} while timed)" if timed else "")


def table(rows: list[dict[str, Any]], peak_tflops: float | None, compare: bool, shape: str) -> list[str]:
    """One shape's rows; the prime-rl ratio columns only for prime-rl's shape of a full-size run."""
    ratios = compare and shape == "prime-rl"
    name = "prime-rl shape: 1 causal sequence per row" if shape == "prime-rl" else "packed GRPO shape"
    out = [f"| model ({name}) | layers | samples x tokens per row | first step (s), compile included | "
           "compiled graphs: flex (budget) / all dynamo | timed step (s) | tokens/s | model TFLOP per step | "
           "TFLOP/s | MFU | peak memory (GiB) |" + (" vs prime-rl: tokens/s | vs prime-rl: memory |" if ratios else ""),
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if ratios else "")]
    for r in rows:
        m = mfu(r, peak_tflops)
        first = "n/a" if r.get("first_step_s") is None else f"{r['first_step_s']:.1f}"
        line = (f"| {label(r)} | {r['layers']} | {row_text(r['tokens'], r['sample_len'])} | {first} | "
                f"{graphs_text(r)} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops_per_step']:.2f} | "
                f"{r['achieved_tflops']:.3g} | {'n/a' if m is None else f'{100 * m:.1f}%'} | {r['peak_gib']:.2f} |")
        if ratios:
            vs = anchor_ratios(r, compare)
            line += f" {vs[0]:.2f}x | {vs[1]:.2f}x |" if vs else " | |"
        out.append(line)
    return out


def bench_row(r: dict[str, Any], peak_tflops: float | None, compare: bool, device_name: str) -> str:
    """The one-line JSON summary of a row a caller parses (`BENCH_ROW {...}` on stdout)."""
    vs = anchor_ratios(r, compare)
    keys = ("model", "shape", "variant", "option", "layers", "tokens", "sample_len", "samples_per_row", "loss_tokens",
            "warmup", "steps", "first_step_s", "warmup_s", "flex_graphs", "flex_graph_budget", "flex_graphs_timed",
            "dynamo_graphs", "dynamo_graphs_timed", "layer_graphs", "layer_graphs_timed",
            "step_s", "tokens_per_s", "tflops_per_step", "achieved_tflops",
            "peak_gib", "build_s")
    out = {k: r.get(k) for k in keys}
    first = r.get("first_step_s")
    out |= {"label": label(r), "device": device_name, "mfu": mfu(r, peak_tflops),
            "compile_s_est": None if first is None else max(first - r["step_s"], 0.0),
            "vs_prime_rl_tokens_per_s": vs[0] if vs else None, "vs_prime_rl_memory": vs[1] if vs else None}
    return "BENCH_ROW " + json.dumps(out)


def label(r: dict[str, Any]) -> str:
    """A row's name: the model, then its variant and option when not the defaults."""
    extra = [x for x in (r.get("variant", "bf16"), r.get("option", "default")) if x not in ("bf16", "default")]
    return " ".join([NAMES[r["model"]], *extra])


def variant_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """Each variant / option against `bf16` `default` of the same model and shape, measured in the same run."""
    out = ["| model | shape | variant / option | tokens/s vs default | peak memory vs default |",
           "|---|---|---|---|---|"]
    for r in rows:
        ref = next((b for b in rows if b["model"] == r["model"] and b["shape"] == r["shape"]
                    and b["variant"] == "bf16" and b["option"] == "default"), None)
        if ref is not None and r is not ref:
            speed, memory = r["tokens_per_s"] / ref["tokens_per_s"], r["peak_gib"] / ref["peak_gib"]
            out.append(f"| {NAMES[r['model']]} | {r['shape']} | "
                       f"{label(r).removeprefix(NAMES[r['model']]).strip()} | {speed:.2f}x | {memory:.2f}x |")
    return out


def anchor_lines() -> list[str]:
    return ["| model | tokens/s | MFU | peak memory (GiB) |", "|---|---|---|---|",
            *(f"| Qwen3-{m.upper()} LoRA | {t:,.0f} | {f}% | {g} |" for m, (t, f, g) in ANCHOR.items())]


PENDING = ("Not measured yet: no GPU was available to the session that wrote this benchmark (issue 14's target is "
           ">= 1.5x prime-rl's tokens/s at no more memory, on prime-rl's shape). On an H100 or H200: `make bench-gpu` "
           "(both models, both shapes, 16k tokens per row, all 28 / 36 layers; `--quick` for 1 warm-up + 3 timed "
           "steps) replaces this section with measured figures.")


INTRO = [
    "# Trainer throughput: tokens/s, MFU and peak memory of tidal's training step", "",
    "Written by `make bench-gpu` (bench/gpu_trainer.py; its docstring says what is measured and how). Qwen3-0.6B "
    "and Qwen3-4B shapes (random init, vocabulary 151,936), LoRA r16 on all linear layers, one row of 16,384 tokens "
    "per micro-batch, tidal's `train_step` (chunked logprobs, GRPO loss, AdamW), gradient checkpointing on. Each "
    "model in two row shapes, each its own table: prime-rl's (one causal sequence of 16,384 tokens per row, the loss "
    "on every token) and the packed GRPO shape (16 samples of 1,024 tokens, a quarter of each a prompt, no "
    "attention across samples). MFU = (6 N T + 12 L n_heads head_dim sum_i c_i) / step time / 989 TFLOP/s (bf16 "
    "dense, H100/H200); N = matmul parameters, c_i = keys token i attends to (causal, within its sample), so the "
    "attention term counts what each shape really attends to: by this formula a prime-rl-shape row is 2.3x (0.6B) "
    "and 1.5x (4B) the model FLOPs of a packed row of the same 16,384 tokens. The first step (its torch.compile "
    "included) and the compiled graphs (flex's, with its budget, and all of dynamo's) are reported apart from the "
    "timed steps.", "",
    "Anchor: prime-rl on one H100 (the figures issue 14 quotes), from prime-rl's trainer benchmark, which feeds one "
    "16,384-token causal sequence per micro-batch (`FakeDataLoader`, `generate_samples=False`: position_ids "
    "0..16,383, the loss on every token). Only that shape is compared with it: the prime-rl-shape tables carry the "
    "ratios; the packed rows (1,024-token samples, far less attention per token) have none, since their tokens/s "
    "is not the same work. prime-rl's checkpointing and MFU formula are not known here (counting the embedding "
    "table in N gives a higher MFU than this formula for the same speed), so compare tokens/s and memory first:", "",
    *anchor_lines(), "",
    "One section per device kind; a run replaces its own. The CPU section is a smoke test of the script "
    "(a few layers, short rows): its figures say nothing about GPU throughput.", ""]


def write_report(path: Path, device_kind: str, lines: list[str]) -> None:
    """Replace (or add) this device kind's section of `path`, keeping the others; a missing CUDA section says it
    is still to be measured."""
    sections: dict[str, str] = {}
    if path.exists():
        for part in path.read_text().split("\n## ")[1:]:
            sections[part.split("\n", 1)[0].strip()] = "## " + part.rstrip() + "\n"
    sections[device_kind] = "\n".join([f"## {device_kind}", "", *lines]) + "\n"
    sections.setdefault("CUDA", "\n".join(["## CUDA", "", PENDING]) + "\n")
    path.write_text("\n".join(INTRO) + "\n" + "\n".join(sections[k] for k in sorted(sections)))


PROFILE_INTRO = [
    "# Trainer step profile: where the time of tidal's training step goes, by kind", "",
    "Written by `python bench/gpu_trainer.py --profile` (issue 43; `--profile-out`, default bench/GPU-PROFILE.md). "
    "Each row is built as bench/gpu_trainer.py builds it (random init, LoRA r16 on all linear layers, gradient "
    "checkpointing on, chunked logprobs, GRPO loss, AdamW; module docstring), warmed up, timed without the "
    "profiler (`timed step`), then `--profile-steps` steps run under torch.profiler (input shapes recorded). "
    "`tidal.trainer.profile` attributes each instant of device busy time (the union of the CUDA kernels and "
    "copies; on CPU of the aten ops) to the innermost kernel running then, and names its kind by its name, its "
    "launching op (input shapes: a LoRA matmul has the LoRA rank among its dimensions) and the profiler ranges "
    "tidal sets (`tidal::recompute` around a checkpoint's recompute, `tidal::lm_head` around the chunked logprob "
    "pass, `tidal::optimizer` around clipping + AdamW + zero_grad, `tidal::attention` around its attention "
    "kernels' forward); the rules are in that module's docstring. Host gaps = wall time - device busy: the time "
    "the device waited for Python. The rows add up to the profiled step's wall time (on a GPU usually longer "
    "than the timed step: the profiler's overhead is host-side, so it inflates the host gaps most).", ""]


PROFILE_PENDING = ("Not measured yet: no GPU was lent to the session that wrote `--profile` (issue 43). On an H100 "
                   "or H200: `python bench/gpu_trainer.py --profile` (the Qwen3-4B prime-rl-shape row and the "
                   "Qwen3-0.6B packed row), or `scripts/gpu_check.py --only e2`, replaces this section.")


def profile_lines(row: dict[str, Any]) -> list[str]:
    """One profiled row: what it is, then `tidal.trainer.profile.markdown`'s table."""
    from tidal.trainer.profile import markdown

    prof = row["profile"]
    return [f"### {label(row)}, {row['shape']} shape ({row_text(row['tokens'], row['sample_len'])} tokens per row, "
            f"{row['layers']} layers)", "",
            f"Timed step without the profiler: {1e3 * row['step_s']:.1f} ms ({row['tokens_per_s']:,.0f} tokens/s); "
            f"profiled: {prof['steps']} step(s), {prof['spans']:,} spans.", "", *markdown(prof), ""]
