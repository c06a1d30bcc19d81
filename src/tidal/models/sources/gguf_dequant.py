"""The child process of `tidal.models.sources.gguf.convert`:
`python -m tidal.models.sources.gguf_dequant FILE.gguf OUT_DIR` dequantizes a
GGUF file with transformers + gguf into a Hugging Face model directory (float32 safetensors, config.json, the tokenizer
and chat template the file carries).

transformers loads a GGUF model as a model "quantized with QuantizationMethod.GGUF" and refuses `save_pretrained`
for it, although its weights are already plain float32 tensors: the quantizer and the config's
`quantization_config` are dropped before saving, so the directory is an ordinary unquantized checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path


def dequantize(gguf_path: Path, out: Path) -> None:
    """Write the model and tokenizer of `gguf_path` as an HF directory `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tidal.models.sources.gguf_dequant FILE.gguf OUT_DIR", file=sys.stderr)
        return 2
    dequantize(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
