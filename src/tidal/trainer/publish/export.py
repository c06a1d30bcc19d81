"""Final export (`{run_dir}/final/`): the trained LoRA adapter and, on request, the merged full model.

`final/adapter/` is a PEFT adapter directory (`PeftModel.from_pretrained`, vLLM `--lora-modules`).
`final/merged/` is a Hugging Face model directory: the base model's config, tokenizer and other files, with
`model.safetensors` holding the base weights plus the LoRA deltas under the base checkpoint's tensor names
(one file; `AutoModelForCausalLM.from_pretrained` and `vllm serve` load it like the base model). A fully
fine-tuned policy (train `lora: false`) has no adapter: it is written once, as `final/model/` (a Hugging Face
model directory with the tokenizer), whatever `export` says. Each directory is written to a temp name, renamed,
then marked `STABLE`. `final/gguf/model-{f16|f32}.gguf` (train `export.gguf`) is the same merged model (or the fully
fine-tuned one) as one GGUF file with the base model's tokenizer (`tidal.trainer.publish.gguf_out`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

from tidal.assets import resolve_model
from tidal.config.train import ExportSection
from tidal.paths import atomic_dir, final_dir
from tidal.trainer.publish.broadcast import checkpoint_keys, merged_state_dict


def write_merged(model: Any, base_dir: Path, out: Path) -> Path:
    """The merged model as a Hugging Face directory at `out` (the training model is not modified)."""
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        for f in base_dir.iterdir():  # config, generation config, tokenizer, chat template, ...
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        weights = merged_state_dict(model, checkpoint_keys(base_dir))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_final_gguf(model: Any, base_dir: Path, run_dir: Path, dtype: Literal["f16", "f32"]) -> Path:
    """`final/gguf/model-{dtype}.gguf`: the merged (or fully trained) weights with the base model's config and
    tokenizer."""
    from tidal.trainer.publish.gguf_out import write_gguf

    weights = merged_state_dict(model, checkpoint_keys(base_dir))
    with atomic_dir(final_dir(run_dir, "gguf")) as tmp:
        write_gguf(weights.items(), base_dir, tmp / f"model-{dtype}.gguf", dtype)
    return final_dir(run_dir, "gguf") / f"model-{dtype}.gguf"


def export_final(model: Any, tokenizer: Any, export: ExportSection, base_model: str,
                 run_dir: Path) -> dict[str, Path]:
    """Write what `export` asks for (`base_model`: train `model`, whose files the merged export copies);
    returns {"adapter": path, "merged": path} for what was written."""
    from tidal.trainer.publish.broadcast import is_peft

    out: dict[str, Path] = {}
    if export.gguf:
        out["gguf"] = write_final_gguf(model, Path(resolve_model(base_model)), run_dir, export.gguf)
    if not is_peft(model):
        out["model"] = final_dir(run_dir, "model")
        with atomic_dir(out["model"]) as tmp:
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
        return out
    if export.adapter:
        out["adapter"] = final_dir(run_dir, "adapter")
        with atomic_dir(out["adapter"]) as tmp:
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
    if export.merged:
        out["merged"] = write_merged(model, Path(resolve_model(base_model)), final_dir(run_dir, "merged"))
    return out
