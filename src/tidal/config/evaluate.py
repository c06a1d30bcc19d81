"""What `tidal eval` reads (`tidal.evaluate`): a model, zero or more adapters, an environment, the examples and how
to sample them. User input only: paths are resolved and checked by `tidal.evaluate.targets` before vLLM starts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tidal.config.base import StrictModel
from tidal.config.chat_template import check_chat_template
from tidal.config.environments import EnvSection


class EvalConfig(StrictModel):
    """`tidal eval`: score a model and its adapters on an environment's examples (docs/evaluation.md)."""

    model: str = "tidal:tiny-reverse"
    """The base model, as a config's `model` takes it: `tidal:NAME`, a local directory, a Hub id in the local cache,
    or a GGUF file (dequantized once into tidal's cache)."""
    adapters: list[str] = Field(default_factory=list)
    """PEFT LoRA adapters to score beside the base model, each a PEFT directory (`adapter_config.json`), a run
    directory (its `final/adapter`, else its newest `broadcasts/step_N`) or a checkpoint (`checkpoints/step_N`, its
    adapter); every one is checked against the model (targets, shapes) before vLLM starts."""
    base: bool = True
    """Also score the base model itself (the first row)."""
    env: EnvSection = Field(default_factory=lambda: EnvSection(id="reverse-text"))
    """The environment, as an orch `env` entry: a built-in id with `args`, `package.module:Class`, a verifiers or
    OpenEnv environment, or a running `tidal env-server` at `address`."""
    num_examples: int | None = Field(None, ge=1)
    """Examples to score (null: the environment's fixed eval set, all of it). With a fixed eval set, `num_examples`
    of its examples drawn with `seed` (all of them when it is larger); without one, `num_examples` generated with
    `seed`."""
    seed: int = 0
    """Seed of the example draw and of the sampled completions (greedy completions need none)."""
    greedy: bool = True
    """Score one greedy completion per example (temperature 0): `accuracy` is the greedy accuracy."""
    samples: int = Field(0, ge=0)
    """Sampled completions per example at `temperature` (0: none): mean reward and pass@k for every k <= samples,
    with the unbiased estimator."""
    temperature: float = Field(1.0, gt=0)
    """Temperature of the sampled completions (set without `samples`: refused, greedy rows have none)."""
    max_tokens: int = Field(256, ge=1)
    """Completion tokens at most; a completion stopped there counts in `cut/share`."""
    max_model_len: int | None = Field(None, ge=16)
    """Prompt + completion tokens at most (vLLM's `--max-model-len` when tidal eval starts it; null: the model's
    own length, capped at 4096 so vLLM's KV cache stays small)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the chat template, as orch `client.chat_template_kwargs` (e.g.
    `{enable_thinking: false}`)."""
    chat_template: str | None = None
    """Chat template the vLLM server tidal eval starts renders conversational prompts with, as infer
    `chat_template` (a file path or the Jinja template inline; null: the model's own). Give the value the run was
    trained with. A model without a template given chat prompts exits 2 before vLLM starts."""
    address: str | None = None
    """`http://host:port` of a running vLLM server serving `model` (null: tidal eval starts one and stops it).
    Adapters are loaded into it by name (it needs `--enable-lora` and runtime LoRA updating)."""
    serve: Literal["auto", "lora", "merged"] = "auto"
    """How adapters reach vLLM: `lora` loads each as a LoRA adapter (one server start, all rows sampled at once);
    `merged` folds each into the base weights and reloads them in place, one row after another (on CPU vLLM's
    LoRA path is ~5x slower than its plain one); `auto`: merged when tidal eval starts vLLM on a CPU-only machine,
    else lora."""
    port: int | None = Field(None, ge=1, le=65535)
    """Port of the vLLM server tidal eval starts (null: a free one; refused with `address`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM's dtype (auto: float32 on CPU, bfloat16 on a GPU, as training; another value with `address` is
    refused: the running server has its own)."""
    show_samples: int = Field(3, ge=0)
    """Completions printed and stored per row (the first examples')."""
    out: str | None = None
    """JSON report path (null: `eval.json` in the current directory); written whole (temp + rename). While rows
    are scored, `<out>.partial` holds those finished (`tidal.evaluate.partial`); removed once the report is written."""
    resume: bool = False
    """Keep the rows of `<out>.partial` (an earlier invocation with this `out` that did not finish) whose target is
    unchanged (the base model; an adapter with the same path and file contents) and score only the rest. Refused
    (exit 2, before vLLM starts) when there is no partial report or it was scored with other settings (every key
    but `adapters`, `base`, `out`, `port`, `policy_check`)."""
    policy_check: bool = True
    """The policy identity check (docs/orchestrator.md) of every adapter row: once vLLM serves the row's adapter
    (loaded or merged), its logprobs of a fixed 32-token probe are compared with the adapter's own (its
    `probe.json` when a tidal trainer published it, else computed here from the base model and the adapter, on
    the CPU); a row vLLM serves as another policy stops tidal eval with exit code 4 and one line (row, path,
    distances). false (`--no-policy-check`): no probe."""

    _chat_template = field_validator("chat_template")(check_chat_template)

    @model_validator(mode="after")
    def _something_to_do(self) -> EvalConfig:
        if not self.greedy and self.samples == 0:
            raise ValueError("greedy is false and samples is 0: nothing to sample; set samples: K or greedy: true")
        if not self.base and not self.adapters:
            raise ValueError("base is false and no adapters are given: nothing to score")
        if self.chat_template is not None and self.address is not None:
            raise ValueError("chat_template is given to the vLLM server tidal eval starts; a running server (address) "
                             "renders prompts with its own: start it with --chat-template, and drop chat_template")
        if self.serve == "merged" and self.address is not None:
            raise ValueError("serve: merged reloads weights into a server tidal eval starts itself; with address "
                             "(a running server) use serve: lora or auto")
        if "temperature" in self.model_fields_set and self.samples == 0:
            raise ValueError("temperature applies to the sampled completions, and samples is 0 (greedy rows are "
                             "temperature 0): set samples: K (--samples K) or drop temperature")
        if self.address is not None:
            given = [k for k in ("port", "dtype") if k in self.model_fields_set
                     and getattr(self, k) != type(self).model_fields[k].default]
            if given:
                raise ValueError(f"{given[0]} applies to the vLLM server tidal eval starts, and address names a "
                                 f"running one (started with its own {given[0]}): drop {given[0]} or address")
        return self
