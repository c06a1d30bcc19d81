"""GRPOTrainer's arguments beyond the model, the datasets and the reward functions, as TRL 1.16 scripts pass them.

- `processing_class` (a tokenizer or processor): TRL tokenizes prompts and renders chat templates with it. In tidal
  the vLLM server and the trainer process load the model's own tokenizer from the model directory (tokens, not
  text, cross process boundaries), so the one given is used when it agrees with the model's (same vocabulary, same
  special tokens, same chat template) and refused, naming what differs, when it does not: a different tokenizer
  would be ignored in the run, not used.
- `optimizers`: TRL takes `(optimizer instance, scheduler instance)` built over the model in the script's process.
  tidal's trainer is another process that builds its own optimizer, so instances are refused with that reason;
  an optimizer class with its keyword arguments (`(torch.optim.AdamW, None)` or `((torch.optim.AdamW, {"lr": ...}),
  None)`, transformers' `optimizer_cls_and_kwargs` shape) becomes the GRPOConfig keys it means
  (`optim`, `learning_rate`, `adam_beta1`/`adam_beta2`, `weight_decay`, `adam_epsilon`), which reach the trainer's
  config.
- `callbacks`: `tidal.api.callbacks`.
- `reward_processing_classes`: one per reward function, as in TRL (a single one for a single function); for a
  reward model (a model name in `reward_funcs`, `tidal.rewards.model`) it is used when it agrees with the tokenizer
  in the reward model's directory, which `RewardModel` loads, and refused naming what differs otherwise; for a
  plain function (where TRL ignores it) it is refused, so that nothing given is ignored.
- `rollout_func` (TRL's custom-rollout hook): the orchestrator calls it for each group and trains on the token ids
  and logprobs it returns (`tidal.orchestrator.rollout_func`, which gives it a trainer-like object that samples
  through tidal's vLLM server); with `tools` / `environment_factory` it is refused (TRL would run its tool loop
  over the function's completions, which tidal's tool loop does not take).
- `quantization_config`: refused with the reason (`REFUSED`), until tidal has it.
"""

from __future__ import annotations

from typing import Any

from tidal.api.grpo_config import GRPOConfig

OPTIMIZER_CLASSES = {"torch.optim.adamw.AdamW": "adamw_torch", "bitsandbytes.optim.adamw.AdamW8bit": "adamw_8bit",
                     "bitsandbytes.optim.adamw.PagedAdamW8bit": "adamw_8bit"}
"""Optimizer classes (module.qualname) tidal's trainer builds -> GRPOConfig `optim`."""

OPTIMIZER_KWARGS = {"lr": "learning_rate", "weight_decay": "weight_decay", "eps": "adam_epsilon"}
"""Optimizer keyword -> GRPOConfig key (`betas` -> adam_beta1/adam_beta2 is handled apart)."""

REFUSED = {
    "quantization_config": "a bitsandbytes-quantized trainer model is not supported; tidal's QLoRA is the train "
                           "key qlora_fp8 (an FP8 base under the LoRA adapter)",
}
"""GRPOTrainer argument -> why tidal refuses it (the error says it)."""


def refuse_unsupported(**given: Any) -> None:
    """Raise NotImplementedError naming the first `REFUSED` argument given (not None) and why."""
    for key, value in given.items():
        if value is not None and value != []:
            raise NotImplementedError(f"GRPOTrainer({key}=...): {REFUSED[key]}; leave it out")


def class_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def optimizer_keys(optimizers: Any) -> dict[str, Any]:
    """The GRPOConfig keys that TRL's `optimizers` argument means (see the module doc); raises NotImplementedError
    for instances and TypeError/ValueError naming what is wrong."""
    if optimizers is None or tuple(optimizers) == (None, None):
        return {}
    opt, scheduler = tuple(optimizers)
    if scheduler is not None:
        raise NotImplementedError("GRPOTrainer(optimizers=(..., scheduler)): a scheduler instance is built over an "
                                  "optimizer in this process, and tidal's trainer process builds its own; set "
                                  "GRPOConfig lr_scheduler_type / warmup_steps instead")
    cls, kwargs = opt if isinstance(opt, tuple) else (opt, {})
    if not isinstance(cls, type):
        raise NotImplementedError(f"GRPOTrainer(optimizers=({type(cls).__name__} instance, None)): an optimizer "
                                  "instance holds this process's parameters, but tidal's trainer is another process "
                                  "that builds its own optimizer; pass the class and its keyword arguments, "
                                  "optimizers=((torch.optim.AdamW, {'lr': ...}), None)")
    optim = OPTIMIZER_CLASSES.get(class_name(cls))
    if optim is None:
        raise ValueError(f"GRPOTrainer(optimizers=...): tidal's trainer builds {sorted(OPTIMIZER_CLASSES)}, not "
                         f"{class_name(cls)}")
    out: dict[str, Any] = {"optim": optim}
    for key, value in dict(kwargs or {}).items():
        if key in OPTIMIZER_KWARGS:
            out[OPTIMIZER_KWARGS[key]] = value
        elif key == "betas":
            out["adam_beta1"], out["adam_beta2"] = (float(b) for b in value)
        else:
            raise ValueError(f"GRPOTrainer(optimizers=...): keyword {key!r} of {cls.__name__} is not supported by "
                             f"tidal (supported: {sorted([*OPTIMIZER_KWARGS, 'betas'])})")
    return out


def with_optimizer(args: GRPOConfig, optimizers: Any) -> GRPOConfig:
    """`args` with the keys `optimizers` means; the same object when it means none."""
    keys = optimizer_keys(optimizers)
    return GRPOConfig.model_validate({**args.model_dump(exclude_unset=True), **keys}) if keys else args


def tokenizer_of(processing_class: Any) -> Any:
    """The tokenizer of a tokenizer or a processor (its `.tokenizer`)."""
    return getattr(processing_class, "tokenizer", None) or processing_class


def model_tokenizer(model: str, chat_template: str | None = None) -> Any:
    """The tokenizer in model `model`'s directory (what the vLLM server and the trainer load), with
    `chat_template` (GRPOConfig `chat_template_path`: a file or an inline template) as its template when given."""
    from transformers import AutoTokenizer

    from tidal.config.chat_template import template_text
    from tidal.models.sources import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    if chat_template is not None:
        tok.chat_template = template_text(chat_template)
    return tok


def tokenizer_difference(given: Any, model: str, chat_template: str | None = None) -> str | None:
    """What differs between the tokenizer `given` and the one in model `model`'s directory (with `chat_template`
    when given), or None."""
    ours = model_tokenizer(model, chat_template)
    given = tokenizer_of(given)
    if not hasattr(given, "get_vocab"):
        return f"it is a {type(given).__name__}, not a tokenizer or a processor with one"
    if given.get_vocab() != ours.get_vocab():
        return f"its vocabulary ({len(given.get_vocab())} tokens) is not the model's ({len(ours.get_vocab())})"
    for attr in ("eos_token", "bos_token", "pad_token", "chat_template"):
        if getattr(given, attr, None) != getattr(ours, attr, None):
            return f"its {attr} differs from the model's"
    return None


def check_reward_processing_classes(classes: Any, reward_funcs: list[tuple[str, Any, float]]) -> None:
    """Refuse (ValueError) `reward_processing_classes` that do not fit `reward_funcs` ((name, function, weight), in
    order; see the module doc)."""
    from tidal.rewards.model import RewardModel

    if classes is None:
        return
    classes = list(classes) if isinstance(classes, list | tuple) else [classes]
    if len(classes) != len(reward_funcs):
        raise ValueError(f"GRPOTrainer(reward_processing_classes=...): {len(classes)} for {len(reward_funcs)} reward "
                         f"functions; TRL needs one per reward function (None where there is none)")
    for i, (cls, (name, func, _)) in enumerate(zip(classes, reward_funcs, strict=True)):
        if cls is None:
            continue
        if not isinstance(func, RewardModel):
            raise ValueError(f"GRPOTrainer(reward_processing_classes[{i}]=...): reward function {name!r} is not a "
                             f"reward model, so no tokenizer is used for it (TRL ignores it too); give None there")
        why = tokenizer_difference(cls, func.model_name)
        if why is not None:
            raise ValueError(f"GRPOTrainer(reward_processing_classes[{i}]=...) disagrees with reward model "
                             f"{func.model_name!r}: {why}. tidal's RewardModel tokenizes with the tokenizer in its "
                             f"directory; save yours there or give None")


def check_processing_class(processing_class: Any, model: str, chat_template: str | None = None) -> None:
    """Refuse (ValueError) a `processing_class` that disagrees with the model's own tokenizer (see the module doc),
    whose chat template is GRPOConfig `chat_template_path`'s when that is given."""
    if processing_class is None:
        return
    why = tokenizer_difference(processing_class, model, chat_template)
    if why is not None:
        raise ValueError(f"GRPOTrainer(processing_class=...) disagrees with model {model!r}: {why}. tidal's vLLM "
                         f"server and trainer tokenize with the tokenizer in the model directory; save yours there "
                         f"(tokenizer.save_pretrained(model_dir)) or leave processing_class out (a chat template of "
                         f"your own: GRPOConfig(chat_template_path=FILE or the template inline))")


def rollout_function(rollout_func: Any, model: str, args: GRPOConfig, processing_class: Any, tooling: Any) -> Any:
    """TRL's `rollout_func` as the orchestrator's `RolloutFunc` (see the module doc), or None."""
    if rollout_func is None:
        return None
    if tooling is not None:
        raise NotImplementedError("GRPOTrainer(rollout_func=...) with tools= or environment_factory=: TRL runs its "
                                  "tool loop over the completions a rollout function returns, which tidal does not; "
                                  "call the tools inside the rollout function, or drop rollout_func")
    from tidal.orchestrator.rollout_func import RolloutFunc

    if not callable(rollout_func):  # before loading a tokenizer for it
        raise TypeError(f"GRPOTrainer(rollout_func=...) must be a function (prompts, trainer) -> dict, got a "
                        f"{type(rollout_func).__name__}")
    tokenizer = processing_class if processing_class is not None else model_tokenizer(model, args.chat_template_path)
    return RolloutFunc(rollout_func, model, tokenizer, args)
