"""`TrainingBatch`: the rollouts of one training step, as flat numpy arrays, serialized with safetensors.

Layout: the token ids of all samples (prompt + completion) are concatenated into `tokens`; `lengths` gives
each sample's length. Per-token arrays (`loss_mask`, `inference_logprobs`) are aligned with `tokens`; a
token's logprob is the one vLLM reported for sampling it (0 for prompt tokens); `advantages` are per token
too (an outcome advantage repeated over the completion, or process-supervision advantages that vary along
it); `teacher_logprobs` is optional (present when the orchestrator scored completions with a teacher).
Per-sample arrays (`rewards`, `policy_steps`, `truncated`, optional `policy_steps_end`) have one entry per sample:
`policy_steps` is the policy that was serving when the sample's request started, `policy_steps_end` (written by
the in-flight orchestrator) the newest policy that may have produced some of its tokens (greater when the
weights changed during the request; `tidal.orchestrator.staleness`); `token_versions` (optional, per token, written
with orch `partial_rollouts`) the policy version that sampled each token (a prompt token: its sample's start version;
`tidal.orchestrator.partial`); `max_tokens` is the
completion budget the rollouts were sampled with, `max_steps` the run's length in batches (None: open-ended).
Scalars and the orchestrator's step metrics travel as JSON in the safetensors metadata. No pickle anywhere.

The trainer decides on typed values, not on metric strings: `policy_step` (the oldest policy that sampled a sample,
from `policy_steps`; QeRL's noise schedule), `off_policy_level` (how far the oldest trained token lags behind the
trainer's policy, from `token_versions` when present, else `policy_steps` / `policy_steps_end`; the mismatch guard's
on-policy scope) and `max_steps` (the progress line's ETA); it records them in its metrics row.

Images (prompts with images, `tidal.envs.images`): each distinct image once, as PNG bytes concatenated in
`image_data` (uint8) with `image_lengths` bytes each; `sample_image_counts` (per sample) and `sample_images`
(concatenated per sample: indices into the images, in the order of their placeholders) say which images a
sample's prompt holds (the completions of one prompt share them); `prompt_lengths` (per sample) is where each
sample's prompt ends, so the trainer puts image features on the prompt's placeholder tokens only (a model may
also sample a placeholder token in its completion). All five are present together or not at all.

`routed_experts` (optional, MoE router replay): per token the experts the inference engine routed it to, (tokens,
layers, top_k) uint8 or int16, `tidal.models.routes.no_route` where a token has none (`tidal.models.routes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_ARRAYS = {"tokens": np.int32, "lengths": np.int32, "loss_mask": np.uint8, "inference_logprobs": np.float32,
           "advantages": np.float32, "rewards": np.float32, "policy_steps": np.int32, "truncated": np.uint8}
_OPTIONAL = {"teacher_logprobs": np.float32, "policy_steps_end": np.int32, "token_versions": np.int32}
_IMAGES = {"image_data": np.uint8, "image_lengths": np.int64, "sample_images": np.int32,
           "sample_image_counts": np.int32, "prompt_lengths": np.int32}
_ROUTES = "routed_experts"
"""Optional (tokens, layers, top_k) uint8 | int16 array: its dtype travels as stored."""
_PER_TOKEN = ("tokens", "loss_mask", "inference_logprobs", "advantages", "teacher_logprobs", "token_versions")
_PER_SAMPLE = ("rewards", "policy_steps", "truncated")


class BatchFormatError(ValueError):
    """A batch file is unreadable or inconsistent; the message names the file."""


@dataclass
class TrainingBatch:
    """Rollouts for training step `step` (see module doc for the layout)."""

    step: int
    temperature: float
    tokens: np.ndarray
    lengths: np.ndarray
    loss_mask: np.ndarray
    inference_logprobs: np.ndarray
    advantages: np.ndarray
    rewards: np.ndarray
    policy_steps: np.ndarray
    truncated: np.ndarray | None = None
    teacher_logprobs: np.ndarray | None = None
    max_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    image_data: np.ndarray | None = None
    image_lengths: np.ndarray | None = None
    sample_images: np.ndarray | None = None
    sample_image_counts: np.ndarray | None = None
    prompt_lengths: np.ndarray | None = None
    policy_steps_end: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    token_versions: np.ndarray | None = None
    max_steps: int | None = None
    """The run's length in batches (orch `max_steps`; None: open-ended)."""

    def __post_init__(self) -> None:
        if self.truncated is None:
            self.truncated = np.zeros(len(self.lengths), dtype=np.uint8)
        for name, dtype in (_ARRAYS | _OPTIONAL | _IMAGES).items():
            if getattr(self, name) is not None:
                setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        if self.routed_experts is not None:
            self.routed_experts = np.ascontiguousarray(self.routed_experts)
        self.validate()

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def policy_step(self) -> int:
        """The oldest policy that sampled a sample of this batch (the smallest `policy_steps`); for an empty batch
        (nothing to train on) the trainer's current policy, `step - 1`."""
        return int(self.policy_steps.min()) if len(self.policy_steps) else max(self.step - 1, 0)

    @property
    def off_policy_level(self) -> int:
        """Policy updates between the oldest trained token and the policy the trainer holds before this step
        (`step - 1`); 0: every token was sampled by that policy (on-policy). With `token_versions` (partial
        rollouts) the oldest version among the loss tokens; else the oldest sample's start, and at least 1 when
        the weights changed during a sample's request (`policy_steps_end` > `policy_steps`)."""
        trained = self.loss_mask.astype(bool)
        if self.token_versions is not None and trained.any():
            return max(self.step - 1 - int(self.token_versions[trained].min()), 0)
        if not len(self.policy_steps):
            return 0
        changed = self.policy_steps_end is not None and bool((self.policy_steps_end != self.policy_steps).any())
        return max(self.step - 1 - self.policy_step, int(changed))

    def validate(self) -> None:
        """Raise ValueError when array shapes disagree."""
        n, total = len(self.lengths), int(self.lengths.sum())
        for name in _PER_TOKEN:
            if getattr(self, name) is not None and len(getattr(self, name)) != total:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, lengths sum to {total}")
        for name in (*_PER_SAMPLE, "policy_steps_end"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} samples")
        if n and self.lengths.min() < 1:
            raise ValueError("every sample needs at least one token")
        self._validate_images()
        r = self.routed_experts
        if r is not None and (r.ndim != 3 or len(r) != total or r.dtype not in (np.uint8, np.int16)):
            raise ValueError(f"routed_experts must be (tokens={total}, layers, top_k) uint8 or int16, got {r.dtype} "
                             f"{r.shape}")

    @property
    def has_images(self) -> bool:
        return self.image_data is not None

    def _validate_images(self) -> None:
        present = [k for k in _IMAGES if getattr(self, k) is not None]
        if not present:
            return
        if len(present) != len(_IMAGES):
            raise ValueError(f"image arrays {present} given without {sorted(set(_IMAGES) - set(present))}")
        assert self.image_lengths is not None and self.image_data is not None and self.prompt_lengths is not None
        assert self.sample_images is not None and self.sample_image_counts is not None
        n = len(self.lengths)
        if int(self.image_lengths.sum()) != len(self.image_data):
            raise ValueError(f"image_lengths sum to {int(self.image_lengths.sum())}, image_data has "
                             f"{len(self.image_data)} bytes")
        for name in ("sample_image_counts", "prompt_lengths"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} samples")
        if int(self.sample_image_counts.sum()) != len(self.sample_images):
            raise ValueError(f"sample_image_counts sum to {int(self.sample_image_counts.sum())}, sample_images has "
                             f"{len(self.sample_images)} entries")
        if len(self.sample_images) and not 0 <= int(self.sample_images.min()) <= int(self.sample_images.max()) \
                < len(self.image_lengths):
            raise ValueError(f"sample_images must index the {len(self.image_lengths)} images")
        if n and (self.prompt_lengths > self.lengths).any():
            raise ValueError("a sample's prompt_lengths exceeds its length")

    def images_of(self, i: int) -> list[int]:
        """Indices of the images in sample `i`'s prompt, in placeholder order (empty without images)."""
        if self.sample_image_counts is None or self.sample_images is None:
            return []
        start = int(self.sample_image_counts[:i].sum())
        return [int(j) for j in self.sample_images[start:start + int(self.sample_image_counts[i])]]

    def image_bytes(self, j: int) -> bytes:
        """The PNG bytes of image `j`."""
        assert self.image_lengths is not None and self.image_data is not None
        start = int(self.image_lengths[:j].sum())
        return self.image_data[start:start + int(self.image_lengths[j])].tobytes()

    def samples(self) -> list[slice]:
        """Slices of `tokens` (and per-token arrays) for each sample."""
        ends = np.cumsum(self.lengths)
        return [slice(int(e - ln), int(e)) for e, ln in zip(ends, self.lengths, strict=True)]

    def save(self, path: Path) -> None:
        """Write to `path` (callers make it atomic; see `transport.filesystem`)."""
        from safetensors.numpy import save_file

        meta, arrays = self._meta_arrays()
        save_file(arrays, str(path), metadata=meta)

    def _meta_arrays(self) -> tuple[dict[str, str], dict[str, np.ndarray]]:
        meta = {"step": str(self.step), "temperature": repr(self.temperature), "max_tokens": str(self.max_tokens),
                "max_steps": json.dumps(self.max_steps), "metrics": json.dumps(self.metrics),
                "format": "tidal.TrainingBatch/2"}
        return meta, {k: getattr(self, k) for k in [*_ARRAYS, *_OPTIONAL, *_IMAGES, _ROUTES]
                      if getattr(self, k) is not None}

    def to_bytes(self) -> bytes:
        """The same safetensors encoding as `save`, in memory (for the zmq transport)."""
        from safetensors.numpy import save

        meta, arrays = self._meta_arrays()
        return save(arrays, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainingBatch:
        """Inverse of `to_bytes`; any problem raises BatchFormatError."""
        from safetensors.numpy import load

        try:
            n = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
            if meta.get("format") != "tidal.TrainingBatch/2":
                raise ValueError(f"format {meta.get('format')!r}, expected 'tidal.TrainingBatch/2'")
            arrays = load(data)
            return cls(step=int(meta["step"]), temperature=float(meta["temperature"]),
                       max_tokens=int(meta["max_tokens"]), metrics=json.loads(meta.get("metrics", "{}")),
                       max_steps=_max_steps(meta), **{k: arrays[k] for k in _ARRAYS},
                       **{k: arrays[k] for k in [*_OPTIONAL, *_IMAGES, _ROUTES] if k in arrays})
        except Exception as exc:  # noqa: BLE001 - any decoding failure means a corrupt message
            raise BatchFormatError(f"corrupt or not a tidal batch: {exc}") from exc

    @classmethod
    def load(cls, path: Path) -> TrainingBatch:
        """Read a batch written by `save`; any problem raises BatchFormatError naming the file."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                if meta.get("format") != "tidal.TrainingBatch/2":
                    raise ValueError(f"format {meta.get('format')!r}, expected 'tidal.TrainingBatch/2'")
                arrays = {k: f.get_tensor(k) for k in _ARRAYS}
                arrays |= {k: f.get_tensor(k) for k in [*_OPTIONAL, *_IMAGES, _ROUTES] if k in f.keys()}  # noqa: SIM118
            return cls(step=int(meta["step"]), temperature=float(meta["temperature"]),
                       max_tokens=int(meta["max_tokens"]), metrics=json.loads(meta.get("metrics", "{}")),
                       max_steps=_max_steps(meta), **arrays)
        except Exception as exc:  # noqa: BLE001 - any decoding failure means a corrupt file
            raise BatchFormatError(f"batch file {path} is corrupt or not a tidal batch: {exc}") from exc


def _max_steps(meta: dict[str, str]) -> int | None:
    """The batch's `max_steps` from its metadata (an int or null; absent in files written before it travelled)."""
    value = json.loads(meta.get("max_steps", "null"))
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"max_steps {value!r} is not an integer or null")
    return value
