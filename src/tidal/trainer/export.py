"""Final export (`{run_dir}/final/`): the trained LoRA adapter and, on request, the merged full model.

`final/adapter/` is a PEFT adapter directory (`PeftModel.from_pretrained`, vLLM `--lora-modules`).
`final/merged/` is a Hugging Face model directory: the base model's config, tokenizer and other files, with
`model.safetensors` holding the base weights plus the LoRA deltas under the base checkpoint's tensor names
(one file; `AutoModelForCausalLM.from_pretrained` and `vllm serve` load it like the base model). Each
directory is written to a temp name, renamed, then marked `STABLE`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tidal.assets import resolve_model
from tidal.config.train import TrainConfig
from tidal.trainer.broadcast import checkpoint_keys, merged_state_dict


def _atomic_dir(final: Path, fill: Any) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        fill(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (final / "STABLE").write_text("")
    return final


def write_merged(model: Any, base_dir: Path, out: Path) -> Path:
    """The merged model as a Hugging Face directory at `out` (the training model is not modified)."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        for f in base_dir.iterdir():  # config, generation config, tokenizer, chat template, ...
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        weights = merged_state_dict(model, checkpoint_keys(base_dir))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return _atomic_dir(out, fill)


def export_final(model: Any, tokenizer: Any, cfg: TrainConfig, run_dir: Path) -> dict[str, Path]:
    """Write what `cfg.export` asks for; returns {"adapter": path, "merged": path} for what was written."""
    out: dict[str, Path] = {}
    if cfg.export.adapter:
        def adapter(tmp: Path) -> None:
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))

        out["adapter"] = _atomic_dir(run_dir / "final" / "adapter", adapter)
    if cfg.export.merged:
        out["merged"] = write_merged(model, Path(resolve_model(cfg.model)), run_dir / "final" / "merged")
    return out
