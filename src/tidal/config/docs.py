"""Render the config reference (docs/configuration.md) from the pydantic models and their field docstrings.

`python -m tidal.config.docs > docs/configuration.md`; a unit test checks the committed file is current.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel

from tidal.config.infer import InferConfig
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig

HEADER = """# Configuration reference

Generated from the config models by `python -m tidal.config.docs`; do not edit by hand.

Keys follow the tables of Surogate's GRPO guide (seed 000). **Status**: `yes` works; `not supported yet`
means the key is accepted by name but any value other than its default is rejected with that message (never
silently ignored); `default only` means another value could have no effect in tidal, and is rejected with
the reason. Unknown keys are errors that name the nearest valid key. Every key can be overridden from
the command line with a dotted path: `--train.loss.kl_tau 0.1`, `--orch.sampling.max_tokens 64`,
`--infer.port 8001`.

**Base models (no chat template).** Chat-message prompts need a chat template; a model that carries none (a base
model such as `tidal:gemma3-270m`) given them is refused before vLLM starts, naming the model and both ways out:
plain-text prompts (an environment whose prompts are strings, e.g. addition's `prompt_format: text`), or the
`chat_template` key (infer and train, one value: `tidal grpo` makes an unset one follow the other; a file path or
the Jinja template inline; `tidal eval --chat-template`; the Python API's `chat_template_path`). Plain-text prompts
start with the tokenizer's BOS when it puts one before a text (Gemma's `<bos>`). docs/real-model.md, "A base model".
"""


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for cand in (annotation, *typing.get_args(annotation)):
        for arg in (cand, *typing.get_args(cand)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return text or str(annotation).replace("typing.", "").replace("tidal.config.", "")


def rows(model: type[BaseModel], prefix: str = "", unsupported: bool = False) -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        off = unsupported or name in model.UNSUPPORTED  # type: ignore[attr-defined]
        desc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        if sub is not None:
            listy = typing.get_origin(field.annotation) is list
            out.append(f"| `{key}` | section | | {'not supported yet' if off else 'yes'} | {desc} |")
            out += rows(sub, f"{key}[]." if listy else f"{key}.", off)
            continue
        default = field.get_default(call_default_factory=True)
        shown = "(required)" if field.is_required() else f"`{default!r}`"
        typ = _type_name(field.annotation).replace("|", "\\|")
        status = "not supported yet" if off else "default only" if name in model.REFUSED else "yes"  # type: ignore[attr-defined]
        out.append(f"| `{key}` | {typ} | {shown} | {status} | {desc} |")
    return out


def render() -> str:
    parts = [HEADER]
    for title, model in (("Trainer (`train.yaml`)", TrainConfig), ("Inference (`infer.yaml`)", InferConfig),
                         ("Orchestrator (`orch.yaml`)", OrchConfig)):
        doc = (model.__doc__ or "").strip()
        parts.append(f"\n## {title}\n\n{doc}\n\n| key | type | default | status | description |\n|---|---|---|---|---|")
        parts += rows(model)
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
