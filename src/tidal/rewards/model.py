"""Reward models: a sequence-classification model scoring completions, used as a TRL-style reward function.

`RewardModel("org/name" or a directory)` is a callable with the reward-function interface
(`f(prompts, completions, **kwargs) -> list[float]`). As TRL's GRPOTrainer does with a reward model, each
sample's text is the prompt followed by the completion — conversational samples rendered with the reward
model's own chat template (`prompt + completion` messages, no generation prompt), standard ones concatenated
as plain text — tokenized by the reward model's own tokenizer without added special tokens, right-padded in
batches of `batch_size`, and scored by the first logit (`logits[:, 0]`). The model is loaded once, on first use
(thread-safe: reward calls run in worker threads), in eval mode without gradients.

`GRPOTrainer(reward_funcs="org/name")` (any string that is not an import path) builds one; in YAML use the
function form: `reward_funcs: [{import_path: "tidal.rewards.model:reward_model", kwargs: {model: PATH}}]`
(one model per path, cached in the orchestrator). It imports torch and transformers into the orchestrator's
process when (and only when) a reward model is configured.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

DEFAULT_BATCH_SIZE = 16


class RewardModel:
    """A sequence-classification model as a reward function (see the module docs)."""

    def __init__(self, model: str, batch_size: int = DEFAULT_BATCH_SIZE, device: str = "cpu",
                 max_length: int | None = None, trust_remote_code: bool = False) -> None:
        """`model`: a `tidal:` name, a local directory or a Hub id; `device`: where it runs (`cpu`, `cuda`,
        `cuda:N`); `max_length`: truncate longer texts (None: no truncation)."""
        if batch_size < 1:
            raise ValueError(f"reward model {model}: batch_size must be >= 1, got {batch_size}")
        self.model_name, self.batch_size, self.device = model, batch_size, device
        self.max_length, self.trust_remote_code = max_length, trust_remote_code
        self.__name__ = Path(model.rstrip("/")).name or model  # the metric name, as TRL names reward models
        self._lock = threading.Lock()
        self._model: Any = None
        self._tok: Any = None
        self.loads = 0
        """How many times the model was loaded (once)."""

    def load(self) -> tuple[Any, Any]:
        """(tokenizer, model), loaded on first use."""
        with self._lock:
            if self._model is None:
                from transformers import AutoModelForSequenceClassification, AutoTokenizer

                from tidal.models.files import is_model_dir
                from tidal.models.sources import resolve_model

                path = resolve_model(self.model_name)
                if not is_model_dir(path):
                    raise ValueError(f"reward model '{self.model_name}' is not a model directory (no config.json)")
                tok = AutoTokenizer.from_pretrained(path, trust_remote_code=self.trust_remote_code)
                if tok.pad_token is None:
                    tok.pad_token = tok.eos_token
                model = AutoModelForSequenceClassification.from_pretrained(
                    path, trust_remote_code=self.trust_remote_code).to(self.device).eval()
                if model.config.pad_token_id is None:
                    model.config.pad_token_id = tok.pad_token_id
                self._tok, self._model = tok, model
                self.loads += 1
            return self._tok, self._model

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """Prompt + completion of each sample, as the reward model reads it."""
        tok, _ = self.load()
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, str):
                out.append(prompt + (completion if isinstance(completion, str) else completion[0]["content"]))
            else:
                out.append(tok.apply_chat_template(list(prompt) + list(completion), tokenize=False))
        return out

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        import torch

        tok, model = self.load()
        texts = self.texts(prompts, completions)
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            batch = tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True, padding_side="right",
                        add_special_tokens=False, truncation=self.max_length is not None,
                        max_length=self.max_length)
            with torch.no_grad():
                logits = model(**{k: v.to(self.device) for k, v in batch.items()}).logits  # (B, num_labels)
            scores += [float(x) for x in logits[:, 0].float().cpu()]
        return scores


IMPORT_PATH = "tidal.rewards.model:reward_model"
"""orch `reward_funcs[].import_path` of the YAML form (`reward_model`; the model in `kwargs.model`)."""


def named_models(sections: list[Any], in_process: list[Any] | None = None) -> list[tuple[str, str]]:
    """(model, where it is named) of every reward model of a run: orch `reward_funcs` `sections` of the YAML form
    and the `RewardModel`s among the (name, function, weight) reward functions given `in_process` (the API)."""
    found = [(str(s.kwargs["model"]), f"orch reward_funcs[{i}].kwargs.model") for i, s in enumerate(sections)
             if s.import_path == IMPORT_PATH and "model" in s.kwargs]
    return found + [(f.model_name, f"reward function '{name}'") for name, f, _ in in_process or []
                    if isinstance(f, RewardModel)]


_LOADED: dict[tuple[str, str], RewardModel] = {}
_LOADED_LOCK = threading.Lock()


def reward_model(prompts: list[Any], completions: list[Any], model: str, batch_size: int = DEFAULT_BATCH_SIZE,
                 device: str = "cpu", max_length: int | None = None, **kwargs: Any) -> list[float]:
    """The YAML form: orch `reward_funcs: [{import_path: "tidal.rewards.model:reward_model", kwargs: {model:
    PATH}}]`; one `RewardModel` per (model, device), loaded once."""
    with _LOADED_LOCK:
        rm = _LOADED.get((model, device))
        if rm is None:
            rm = _LOADED[(model, device)] = RewardModel(model, batch_size, device, max_length)
    rm.batch_size, rm.max_length = batch_size, max_length
    return rm(prompts, completions)
