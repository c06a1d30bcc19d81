"""The `chat_template` key (infer, train and eval configs; the Python API's `chat_template_path`): the Jinja chat
template that turns conversational prompts (chat messages) into tokens, for a model that carries none (a base model
such as Gemma 3 270M) or to replace the one it carries. As TRL's `chat_template_path`, one value: a file path or the
template itself inline.

- Inline when the value holds `{{` or `{%` (every usable template does); otherwise a path to a file (relative to the
  current directory), which must exist, be UTF-8 and hold a template, checked when the config is read (exit 2 naming
  the key).
- `template_text(value)` is the template either way; `template_arg(value)` is what vLLM's and SGLang's
  `--chat-template` get (an absolute path for a file, so a server started elsewhere reads the same file; the text
  itself when inline: vLLM 0.32 takes a value holding `{`, `}` or a newline that is no file as the template).
Where the value is used (vLLM's `/tokenize` for every rollout and evaluation prompt, the trainer's tokenizer for SFT
and the exports) and the check that conversational prompts have a template before anything starts:
`tidal.models.chat_template`.
"""

from __future__ import annotations

from pathlib import Path

INLINE_MARKS = ("{{", "{%")
"""A value holding one of these is the template itself, not a path."""


def is_inline(value: str) -> bool:
    """`value` is the template itself (holds `{{` or `{%`), not a path."""
    return any(m in value for m in INLINE_MARKS)


def template_text(value: str) -> str:
    """The template `value` gives: itself when inline, else the file's text. ValueError saying what is wrong (no
    such file, unreadable, not UTF-8, empty)."""
    if is_inline(value):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template: no file {path.resolve()} (give a path to a Jinja template file, or the "
                         f"template itself inline: a value holding {{{{ or {{%)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template: cannot read {path.resolve()} as UTF-8 text ({type(exc).__name__}: {exc})"
                         ) from None
    if not text.strip():
        raise ValueError(f"chat_template: {path.resolve()} is empty; it must hold a Jinja chat template")
    return text


def check_chat_template(value: str | None) -> str | None:
    """Pydantic validator of a `chat_template` key: inline, or a readable non-empty file (see `template_text`)."""
    if value is not None:
        if not value.strip():
            raise ValueError("chat_template is empty; give a file path or an inline Jinja template, or null")
        template_text(value)
    return value


def template_arg(value: str) -> str:
    """What a server's `--chat-template` gets for `value`: the file's absolute path, or the inline template."""
    return value if is_inline(value) else str(Path(value).expanduser().resolve())
