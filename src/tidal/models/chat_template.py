"""Which chat template renders a model's conversational prompts, and the refusal, before anything starts, of chat
prompts that nothing could render (torch-free).

A conversational prompt (chat messages, `tidal.envs.base.Example.prompt` as a list) becomes tokens through a chat
template: vLLM's `/tokenize` renders every rollout and evaluation prompt with the template it was started with
(`--chat-template`, from infer / eval `chat_template`) or else the model's own; `tidal sft` renders with the trainer's
tokenizer (train `chat_template` or the model's). A base model usually carries none (Gemma 3 270M's GGUF does not):
vLLM then answers the first `/tokenize` with HTTP 400, minutes after it started. `check_chat_prompts` refuses such a
run up front (`ConfigError`, exit 2) naming the model, the environments and both ways out: plain-text prompts (an
environment whose prompts are strings, TRL's "standard" format) or a `chat_template`.

- `model_template(model_dir)`: the template a model directory carries: `chat_template.jinja` (what transformers 5
  saves), else tokenizer_config.json's `chat_template` (a string, or named templates of which `default` is used),
  else `chat_template.json` (a processor's). None: there is none.
- `run_template(model, chat_template)`: the configured template's text (`tidal.config.chat_template`), else the
  model's own.
- `standard_prompt_ids(with_specials, plain)`: a plain-text (standard) prompt's ids: the text's own, after the
  special tokens the tokenizer puts BEFORE a text (its BOS: Gemma's `<bos>`, Llama's `<|begin_of_text|>`, as
  `generate` and vLLM's text prompts get them), never those it puts after (an EOS would end the prompt).
- Model types for which vLLM brings a template of its own when the model has none (its
  `chat_templates/registry.py`, vLLM 0.32: vision and OCR models) are not refused (`VLLM_FALLBACK_TYPES`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tidal.config.chat_template import template_text
from tidal.config.load import ConfigError

VLLM_FALLBACK_TYPES = frozenset({"blip-2", "clip", "colpali", "deepseek_ocr", "deepseek_ocr2", "unlimited-ocr",
                                 "unlimited_ocr", "deepseek_vl_v2", "minicpmv", "minicpmv4_6", "minicpmv4_7",
                                 "paligemma", "siglip", "siglip2"})
"""Model types vLLM 0.32 renders chat prompts for with a built-in template when the model carries none."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pick(value: Any) -> str | None:
    """A `chat_template` entry: a string, or named templates (a list of {name, template} or a dict) -> `default`."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict) and isinstance(value.get("default"), str):
        return value["default"] or None
    return None


def model_template(model_dir: str | Path) -> str | None:
    """The chat template the model directory `model_dir` carries (module docs), None when it carries none."""
    d = Path(model_dir)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        text = jinja.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            return text
    for name in ("tokenizer_config.json", "chat_template.json"):
        found = _pick(_read_json(d / name).get("chat_template"))
        if found:
            return found
    return None


def run_template(model_dir: str | Path, chat_template: str | None) -> str | None:
    """The template that renders the run's chat prompts: `chat_template`'s (a file or inline; ValueError when its
    file cannot be read), else the model directory's own (None: there is none)."""
    if chat_template is not None:
        return template_text(chat_template)
    return model_template(model_dir)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory holding one of these has a tokenizer whose template can be asked about."""


def has_tokenizer(model_dir: str | Path) -> bool:
    """The directory holds a tokenizer (a directory without one is refused by the other checks, not this one)."""
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def vllm_has_fallback(model_dir: str | Path) -> bool:
    """vLLM brings a template for this model's type when it carries none (`VLLM_FALLBACK_TYPES`)."""
    return str(_read_json(Path(model_dir) / "config.json").get("model_type", "")) in VLLM_FALLBACK_TYPES


def check_chat_prompts(model: str, model_dir: str | Path, chat_template: str | None, chat_envs: Iterable[str],
                       key: str) -> None:
    """Refuse conversational prompts that nothing can render: when `chat_envs` (the environments whose prompts are
    chat messages) is not empty and neither `chat_template` (the config's value, `key` naming it) nor the model
    directory gives a template, ConfigError naming `model`, the environments and both ways out."""
    envs = sorted(set(chat_envs))
    if not envs or vllm_has_fallback(model_dir) or not has_tokenizer(model_dir):
        return
    try:
        template = run_template(model_dir, chat_template)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if template is not None:
        return
    raise ConfigError(
        f"model '{model}' has no chat template (a base model: its tokenizer carries none, {Path(model_dir)}), but "
        f"environment(s) {', '.join(repr(e) for e in envs)} give chat-message prompts, which only a chat template "
        f"turns into tokens (vLLM would refuse the first prompt with HTTP 400). Either give plain-text prompts (an "
        f"environment whose prompts are strings, e.g. `args: {{prompt_format: text}}` for the built-in addition, "
        f"or a dataset with a string `prompt` column), or set {key} to a chat template (a file path or the Jinja "
        f"template inline) that renders them (docs/real-model.md, base models)")


def standard_prompt_ids(with_specials: list[int], plain: list[int]) -> list[int]:
    """A plain-text prompt's token ids from the tokenizer's encoding of it with (`with_specials`) and without
    (`plain`) special tokens: the leading specials (BOS) kept, trailing ones (EOS) dropped; `plain` when the two
    do not frame the same text."""
    n = len(plain)
    for k in range(len(with_specials) - n + 1):
        if with_specials[k:k + n] == plain:
            return with_specials[:k] + plain
    return plain
