"""Final export (`{run_dir}/final/`): the trained LoRA adapter and, on request, the merged full model and a GGUF file.

`final/adapter/` is a PEFT adapter directory (`PeftModel.from_pretrained`, vLLM `--lora-modules`).
`final/merged/` is a Hugging Face model directory: the base model's config, tokenizer and other files, with
`model.safetensors` holding the base weights plus the LoRA deltas under the base checkpoint's tensor names
(one file; `AutoModelForCausalLM.from_pretrained` and `vllm serve` load it like the base model). A fully
fine-tuned policy (train `lora: false`) has no adapter: it is written once, as `final/model/` (a Hugging Face
model directory with the tokenizer), whatever `export` says. Each directory is written to a temp name, renamed,
then marked `STABLE`. `final/gguf/model-{type}.gguf` (train `export.gguf`) is the same merged model (or the fully
fine-tuned one) as one GGUF file with the base model's tokenizer (`tidal.trainer.publish.gguf_out`), written LAST:
whatever goes wrong there (a tensor without a llama.cpp name, a full disk, ...) leaves the adapter / model already
in place and raises `GGUFExportError`, whose one-line message names the `tidal export` command that writes the GGUF
from them later (`tidal.trainer.publish.export_cmd`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tidal.config.train import ExportSection
from tidal.models.sources import resolve_model
from tidal.paths import atomic_dir, final_dir
from tidal.trainer.publish.broadcast import checkpoint_keys, merged_state_dict

GGUF_RECORD = "gguf_tokenizer.json"
"""A GGUF source's tokenizer facts (`tidal.models.sources.gguf.TOKENIZER_FILE`), carried into final/model too."""


class GGUFExportError(RuntimeError):
    """The GGUF step failed after everything else of the final export was written (message: one line)."""


def write_merged(model: Any, base_dir: Path, out: Path, chat_template: str | None = None) -> Path:
    """The merged model as a Hugging Face directory at `out` (the training model is not modified); `chat_template`:
    the trainer tokenizer's template, written as `chat_template.jinja` where it is not the base model's own (train
    `chat_template`), so the merged model renders prompts as the run did."""
    from safetensors.torch import save_file

    from tidal.models.chat_template import model_template

    with atomic_dir(out) as tmp:
        for f in base_dir.iterdir():  # config, generation config, tokenizer, chat template, gguf_tokenizer.json ...
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        if chat_template and chat_template != model_template(base_dir):
            (tmp / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        weights = merged_state_dict(model, checkpoint_keys(base_dir))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_final_gguf(weights: dict[str, Any], base_dir: Path, run_dir: Path, dtype: str,
                     rope_scaling: dict[str, Any] | None = None) -> Path:
    """`final/gguf/model-{dtype}.gguf`: `weights` (checkpoint names) with the base model's config and tokenizer.
    The files of other types already there are kept (hard-linked into the new directory, copied where links fail):
    a second `tidal export --gguf TYPE` adds its file, it does not delete the first."""
    import os

    from tidal.trainer.publish.gguf_out import write_gguf

    final, name = final_dir(run_dir, "gguf"), f"model-{dtype}.gguf"
    with atomic_dir(final) as tmp:
        if (final / "STABLE").is_file():
            for old in final.glob("model-*.gguf"):
                if old.name != name:
                    try:
                        os.link(old, tmp / old.name)
                    except OSError:
                        shutil.copy2(old, tmp / old.name)
        write_gguf(weights.items(), base_dir, tmp / name, dtype, rope_scaling)
    return final / name


def base_dir_of(model: Any, base_model: str) -> Path:
    """The directory the policy was loaded from (its config's `_name_or_path`, so a GGUF source's cache entry is
    used without the source file), else `base_model` resolved."""
    loaded = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or "."))
    return loaded if (loaded / "config.json").is_file() else Path(resolve_model(base_model))


def export_final(model: Any, tokenizer: Any, export: ExportSection, base_model: str, run_dir: Path,
                 rope_scaling: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write what `export` asks for (`base_model`: train `model`, whose files the merged export copies; the GGUF
    last); returns {"adapter" | "merged" | "model" | "gguf": path} for what was written. A failing GGUF step raises
    GGUFExportError after the rest is written."""
    from tidal.trainer.publish.broadcast import is_peft

    out: dict[str, Path] = {}
    base_dir = base_dir_of(model, base_model)
    if not is_peft(model):
        out["model"] = final_dir(run_dir, "model")
        with atomic_dir(out["model"]) as tmp:
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            if (base_dir / GGUF_RECORD).is_file():
                shutil.copy2(base_dir / GGUF_RECORD, tmp / GGUF_RECORD)
    else:
        if export.adapter:
            out["adapter"] = final_dir(run_dir, "adapter")
            with atomic_dir(out["adapter"]) as tmp:
                model.save_pretrained(str(tmp))
                tokenizer.save_pretrained(str(tmp))
        if export.merged:
            out["merged"] = write_merged(model, base_dir, final_dir(run_dir, "merged"),
                                         getattr(tokenizer, "chat_template", None))
    if export.gguf:
        try:
            weights = merged_state_dict(model, checkpoint_keys(base_dir))
            out["gguf"] = write_final_gguf(weights, base_dir, run_dir, export.gguf, rope_scaling)
        except Exception as exc:  # noqa: BLE001 - any failure here must leave what was written, and say so
            if not out:  # the GGUF was to be the only result: keep the adapter instead of nothing
                out["adapter"] = final_dir(run_dir, "adapter")
                with atomic_dir(out["adapter"]) as tmp:
                    model.save_pretrained(str(tmp))
                    tokenizer.save_pretrained(str(tmp))
            why = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise GGUFExportError(f"GGUF export failed ({why}); kept: {', '.join(str(p) for p in out.values())}; "
                                  f"write it later with: tidal export {run_dir} --gguf {export.gguf}") from exc
    return out
