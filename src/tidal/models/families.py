"""What works per model family: one table (torch-free data) that the preflight, `tidal grpo --dry-run` and
docs/models.md read.

A family is a set of transformers `model_type`s (`Family.model_types`) with the facts tidal acts on:
- `linear_attention`: layers with a recurrent state and a convolution window (Qwen3.5's gated-delta-net).
  transformers' torch path of those layers ignores packed-sample boundaries (the fla kernels take `cu_seqlens`,
  the torch fallback on CPU does not), so a packed row would carry one sample's state into the next: the trainer
  packs **one sample per row** for such a model (`packing_rule`, `tidal.trainer.step.packing`) and never shares
  prompts (`tidal.trainer.model.attention.prompt_sharing_blocker`);
- `torchvision`: vLLM's model code for it imports torchvision (`tidal.inference.backends.vllm.support`);
- `cells`: the capability matrix, column (`COLUMNS`) -> `Cell` (what holds, and the test that backs it, as
  `path::test[param]`; `-` where nothing is claimed). `tests/unit/test_families.py` checks that every named test
  exists and that every family of `tests/archs.py` has a row.

Rows are looked up by `model_type` (`family_of`), from a config.json dict or a transformers config (`text_config`
of a VLM checkpoint included). A model of no family here is not refused: the matrix says nothing about it.

**The text path of a VLM checkpoint** (`TEXT_PATH_VLMS`: Qwen3.5's, Qwen3.5-MoE's, Gemma 3's and Gemma 4's
`*ForConditionalGeneration`; many of their small checkpoints are published as VLMs): tidal trains and serves their
language model on text prompts. The trainer builds the checkpoint's own class (so its parameter names, turned into
checkpoint names by transformers' reverse conversion, are the checkpoint's: `model.language_model.*`, Gemma 3's
`language_model.model.*` on disk) with LoRA on the language model only, and never runs the vision tower; vLLM
serves it with `--language-model-only` (no vision tower, no image processor: `text_path_only`). Image prompts are
refused by name (the trainer builds no image inputs for these).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

COLUMNS = ("vLLM-CPU serves", "trainer", "LoRA", "full FT", "packing", "merged reload", "weight push", "GGUF in",
           "GGUF out (llama.cpp)", "GPU ledger")
"""The matrix's columns, in docs/models.md's order."""
LINEAR_LAYER_TYPES = frozenset({"linear_attention"})
"""`layer_types` entries of layers with a recurrent state (transformers' Qwen3.5 / Qwen3-Next)."""
MATRIX = "tests/integration/test_arch_matrix.py"
ONE_PER_ROW = "one sample per row"
PACKED = "packed (block-diagonal)"
TEXT_PATH_VLMS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                  "Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration")
"""VLM checkpoint classes whose text path tidal trains and serves (module doc); checked by the `*-vlm` rows of
`tests/archs.py`."""


@dataclass(frozen=True)
class Cell:
    """One claim of the matrix and the test that backs it."""

    value: str
    """What holds (`yes`, `refused: why`, `not checked`, ...)."""
    test: str = "-"
    """`path::test[param]` of the test that checks it (`-`: none; then `value` must not claim it works)."""


@dataclass(frozen=True)
class Family:
    """One model family's row."""

    name: str
    """Display name (docs/models.md)."""
    model_types: tuple[str, ...]
    """transformers `model_type`s of the family (text models and their VLM checkpoints' text configs)."""
    arch: str
    """The `tests/archs.py` architecture that stands for it in the tests."""
    linear_attention: bool = False
    """It has layers with a recurrent state (see the module doc): packed one sample per row."""
    torchvision: str = "no"
    """Whether vLLM 0.32's model code for it imports torchvision (`no`, or how tidal deals with it)."""
    cells: dict[str, Cell] = field(default_factory=dict)
    """Column -> `Cell` (every column of `COLUMNS`)."""
    architectures: tuple[str, ...] = ()
    """Checkpoint classes this row is for (a VLM checkpoint's text path, `TEXT_PATH_VLMS`): such a checkpoint finds
    this row before its `model_type`'s; empty: any class of its `model_types`."""


def _matrix(arch: str, *, lora: bool = True, full: bool = True, gguf_in: Cell | None = None,
            gguf_out: Cell | None = None, gpu: Cell | None = None, packing: Cell | None = None) -> dict[str, Cell]:
    """The cells of a family checked by the architecture matrix (`tests/integration/test_arch_matrix.py`)."""
    t = f"[{arch}]"
    return {
        "vLLM-CPU serves": Cell("yes (fp32, mismatch KL <= 1e-3)",
                                f"{MATRIX}::test_vllm_serves_it_and_the_trainer_agrees{t}"),
        "trainer": Cell("yes (2 GRPO steps)", f"{MATRIX}::test_a_two_step_grpo_run_completes{t}"),
        "LoRA": Cell("yes (adapter served by vLLM)" if lora else "trainer only; vLLM-CPU gets merged weights",
                     f"{MATRIX}::test_a_lora_adapter_loads_into_vllm_and_is_served_exactly{t}"),
        "full FT": Cell("yes" if full else "refused on CPU (vLLM-CPU garbles updated experts)",
                        f"{MATRIX}::test_a_fully_fine_tuned_policy_reaches_vllm_exactly{t}"),
        "packing": packing or Cell(PACKED, "tests/unit/test_packing.py::test_packed_logprobs_equal_unpacked_fp32"),
        "merged reload": Cell("yes", f"{MATRIX}::test_a_lora_policy_reloaded_as_merged_weights_is_served_exactly{t}"),
        "weight push": Cell("yes (gloo)", f"{MATRIX}::test_a_pushed_lora_policy_is_served_exactly{t}"),
        "GGUF in": gguf_in or Cell("not checked"),
        "GGUF out (llama.cpp)": gguf_out or Cell("refused (tidal.trainer.publish.gguf_out.ARCHS)",
                                                 "tests/unit/test_gguf_models.py::"
                                                 "test_gguf_export_refuses_what_it_cannot_write"),
        "GPU ledger": gpu or Cell("-"),
    }


GGUF_LLAMA_CPP = "tests/e2e/test_gguf_gemma_llama_cpp.py"
GGUF_WRITTEN = Cell("written (read back by transformers), not run in llama.cpp",
                    "tests/unit/test_gguf_export.py::test_chat_markers_are_control_tokens")
LINEAR_PACKING = Cell(ONE_PER_ROW + " (recurrent state, conv window)",
                      "tests/unit/test_linear_attention_packing.py::test_packed_logprobs_equal_one_sample_per_row")

VLM_STAND_IN = "no (vLLM imports it; tidal's plugin stands in: vl_imports; served --language-model-only)"

GEMMA4_VLM_OPEN = dict.fromkeys(("vLLM-CPU serves", "LoRA", "full FT", "merged reload", "weight push"), Cell(
    "NO, refused up front (exit 2): vLLM-CPU's Gemma4ForConditionalGeneration serves the text path differently from "
    "transformers (largest logprob gap 0.75 at fp32, 2026-12-06; unexplained, open); the text checkpoint is served",
    "tests/unit/test_cpu_served.py::test_tidal_grpo_exits_2_before_anything_starts[gemma4-vlm]"))
"""The Gemma 4 VLM checkpoint's serving cells: vLLM-CPU served it wrongly in the matrix (`tests/archs.py`
gemma4-vlm, now left out of it), so tidal refuses it on CPU (`tidal.models.arch.CPU_MISSERVED`); the trainer side
passes (tests/unit/test_vlm_text_path.py)."""


def vlm_packing(arch: str) -> Cell:
    """A VLM checkpoint's text path packs as its text model does (two samples in a row, float64 against each alone)."""
    return Cell(PACKED, "tests/unit/test_vlm_text_path.py::"
                        f"test_the_trainer_loads_the_checkpoint_and_its_text_logprobs_are_the_text_models[{arch}]")

FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama",), "llama3", cells=_matrix(
        "llama3", gguf_in=Cell("yes", "tests/unit/test_gguf_models.py::test_gguf_source_resolves_to_the_same_model"
                                      "[llama]"),
        gguf_out=Cell("yes (SmolLM2: specials single, greedy equal)",
                      "tests/e2e/test_gguf_llama_cpp.py::test_smollm2_export_runs_in_llama_cpp"),
        gpu=Cell("e2e-0.6b, smollm2-135m (bench/GPU-LEDGER.md)"))),
    Family("Qwen2.5", ("qwen2",), "qwen2.5", cells=_matrix("qwen2.5", gguf_out=GGUF_WRITTEN)),
    Family("Qwen3", ("qwen3",), "qwen3", cells=_matrix(
        "qwen3", gguf_in=Cell("yes", "tests/unit/test_gguf_models.py::test_gguf_source_resolves_to_the_same_model"
                                     "[qwen3]"),
        gguf_out=GGUF_WRITTEN, gpu=Cell("e2e-0.6b, e2e-4b (bench/GPU-LEDGER.md)"))),
    Family("Qwen3.5", ("qwen3_5", "qwen3_5_text"), "qwen3.5",
           linear_attention=True, torchvision="no (vLLM imports it; tidal's plugin stands in: vl_imports)",
           cells=_matrix("qwen3.5", packing=LINEAR_PACKING, gguf_out=Cell(
               "yes, dense text models (tiny, V heads reordered and not: specials single, greedy equal, F32 and F16)",
               "tests/e2e/test_gguf_qwen35_llama_cpp.py::test_tiny_qwen35_export_runs_in_llama_cpp[qwen3.5]"),
                         gpu=Cell("qwen3.5-fla, cuda-vllm-new-families (never run)"))),
    Family("Qwen3.5 VLM, text path", ("qwen3_5",), "qwen3.5-vlm", linear_attention=True,
           torchvision=VLM_STAND_IN,
           architectures=("Qwen3_5ForConditionalGeneration",),
           cells=_matrix("qwen3.5-vlm", packing=LINEAR_PACKING, gguf_out=Cell(
               "yes, its text model (from text_config: the same file as the text model's)",
               "tests/unit/test_gguf_qwen35.py::test_the_text_path_of_a_vision_language_checkpoint"),
                         gpu=Cell("qwen3.5-fla, cuda-vllm-vlm-text-paths (never run)"))),
    Family("Qwen3.5-MoE", ("qwen3_5_moe", "qwen3_5_moe_text"), "qwen3.5-moe", linear_attention=True,
           torchvision="no (vLLM imports it; tidal's plugin stands in: vl_imports)",
           cells=_matrix("qwen3.5-moe", lora=False, full=False, packing=LINEAR_PACKING, gguf_out=Cell(
               "yes (tiny, 4 experts top 2 + shared: specials single, greedy equal, F32 and F16)",
               "tests/e2e/test_gguf_qwen35_llama_cpp.py::test_tiny_qwen35_export_runs_in_llama_cpp[qwen3.5-moe]"),
                         gpu=Cell("qwen3.5-fla, cuda-vllm-vlm-text-paths (never run)"))),
    Family("Gemma 3", ("gemma3", "gemma3_text"), "gemma3", cells=_matrix(
        "gemma3", gguf_out=Cell("yes (real Gemma 3 270M and tiny: specials single, greedy equal, F32 and F16)",
                                f"{GGUF_LLAMA_CPP}::test_real_gemma3_270m_export_runs_in_llama_cpp"),
        gpu=Cell("cuda-vllm-new-families (never run)"))),
    Family("Gemma 4", ("gemma4", "gemma4_text"), "gemma4", cells=_matrix(
        "gemma4", gguf_out=Cell("yes, dense text models (tiny: specials single, greedy equal, F32 and F16)",
                                f"{GGUF_LLAMA_CPP}::test_tiny_gemma_export_runs_in_llama_cpp[gemma4]"),
        gpu=Cell("cuda-vllm-new-families (never run)"))),
    Family("Gemma 3 VLM, text path", ("gemma3",), "gemma3-vlm", architectures=("Gemma3ForConditionalGeneration",),
           torchvision=VLM_STAND_IN,
           cells=_matrix("gemma3-vlm", packing=vlm_packing("gemma3-vlm"), gguf_out=Cell(
               "written from text_config (tiny, read back; the text model's llama.cpp check covers the tensors)",
               "tests/unit/test_gguf_gemma.py::test_gemma3_vlm_checkpoint_writes_its_text_model"),
                         gpu=Cell("cuda-vllm-vlm-text-paths (never run)"))),
    Family("Gemma 4 VLM, text path", ("gemma4",), "gemma4-vlm", architectures=("Gemma4ForConditionalGeneration",),
           torchvision=VLM_STAND_IN,
           cells={**_matrix("gemma4-vlm", packing=vlm_packing("gemma4-vlm"), gguf_out=Cell(
               "accepted (text_config, as Gemma 3's VLM); not checked on a Gemma 4 VLM checkpoint"),
                         gpu=Cell("cuda-vllm-vlm-text-paths (never run)")), **GEMMA4_VLM_OPEN}),
    Family("Qwen3-MoE", ("qwen3_moe",), "qwen3-moe", cells=_matrix("qwen3-moe", lora=False, full=False)),
    Family("Mistral", ("mistral",), "mistral", cells=_matrix("mistral", gguf_out=GGUF_WRITTEN)),
    Family("Gemma 2", ("gemma2",), "gemma2", cells=_matrix(
        "gemma2", gguf_out=Cell("yes (tiny: specials single, greedy equal, F32 and F16)",
                                f"{GGUF_LLAMA_CPP}::test_tiny_gemma_export_runs_in_llama_cpp[gemma2]"))),
    Family("Phi-3", ("phi3",), "phi3", cells=_matrix("phi3")),
    Family("OLMo 2", ("olmo2",), "olmo2", cells=_matrix("olmo2")),
    Family("Granite", ("granite",), "granite", cells=_matrix("granite")),
)
"""Every family tidal tests, in docs/models.md's order."""


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def _text(config: Any) -> Any:
    """The text model's config of a VLM checkpoint (`text_config`), else `config`."""
    text = _get(config, "text_config")
    return text if text is not None else config


def family_of(config: Any) -> Family | None:
    """The family of a model (its config.json dict or a transformers config): the row of its checkpoint class
    (`Family.architectures`), else by `model_type`; None: not in the table."""
    arch = architecture(config)
    by_class = next((f for f in FAMILIES if arch in f.architectures), None)
    if by_class is not None:
        return by_class
    types = {_get(config, "model_type"), _get(_text(config), "model_type")}
    return next((f for f in FAMILIES if not f.architectures and types & set(f.model_types)), None)


def architecture(config: Any) -> str:
    """The checkpoint's class (`architectures[0]` of a config.json dict or a transformers config; '' if none)."""
    archs = _get(config, "architectures") or []
    return str(archs[0]) if archs else ""


def text_path_only(config: Any) -> bool:
    """A VLM checkpoint tidal runs on its text path only (`TEXT_PATH_VLMS`, module doc)."""
    return architecture(config) in TEXT_PATH_VLMS


def has_linear_attention(config: Any) -> bool:
    """The model has layers with a recurrent state (`layer_types`, a VLM's text config included) or belongs to a
    family that has."""
    kinds = _get(_text(config), "layer_types") or []
    family = family_of(config)
    return bool(LINEAR_LAYER_TYPES & set(kinds)) or (family is not None and family.linear_attention)


def packing_rule(config: Any) -> str:
    """How the trainer packs this model's samples: `ONE_PER_ROW` for a model with linear-attention layers (their
    state must not cross samples), else `PACKED`."""
    return ONE_PER_ROW if has_linear_attention(config) else PACKED


def describe(config: Any) -> str:
    """The model's row as text (`tidal grpo --dry-run`): family, packing rule and every cell with its test."""
    family = family_of(config)
    if family is None:
        return (f"model family: {_get(config, 'model_type')} is not in tidal's tested matrix (docs/models.md); "
                f"packing: {packing_rule(config)}")
    lines = [f"model family: {family.name} (docs/models.md; tests/archs.py '{family.arch}')",
             f"  packing: {packing_rule(config)}; vLLM needs torchvision: {family.torchvision}"]
    lines += [f"  {col}: {family.cells[col].value}  [{family.cells[col].test}]" for col in COLUMNS]
    return "\n".join(lines)
