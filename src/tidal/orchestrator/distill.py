"""On-policy distillation metrics of one batch (docs/algorithms.md, "On-policy distillation").

The student samples, the teacher scores every sampled token (orch `teacher`: vLLM `prompt_logprobs`, untempered),
and the per-token reverse KL `KL(student || teacher)` is estimated on the sampled tokens by the single-sample
estimate `d_t = student_t - teacher_t` (both logprobs of the token the student sampled). Its mean over the batch's
loss tokens is `teacher/reverse_kl`; the trainer turns `-teacher_tau * d_t` into the token's advantage
(`tidal.trainer.step.loss`). The student logprob here is the one vLLM sampled with (at the sampling temperature; with
`temperature: 1` it is the student's own distribution), so the metric needs no trainer forward pass.
"""

from __future__ import annotations

import numpy as np

from tidal.transport.batch import TrainingBatch


def reverse_kl_per_token(student: np.ndarray, teacher: np.ndarray) -> np.ndarray:
    """(N,) `student - teacher`: the per-token estimate of KL(student || teacher) at the sampled tokens."""
    return np.asarray(student, dtype=np.float64) - np.asarray(teacher, dtype=np.float64)


def distill_metrics(batch: TrainingBatch, teacher_time_s: float) -> dict[str, float]:
    """`teacher/reverse_kl` (mean per loss token; 0 for a batch without loss tokens) and `teacher/latency_s` (the
    wall time of the batch's teacher requests), for a batch that carries teacher logprobs."""
    assert batch.teacher_logprobs is not None
    on = np.asarray(batch.loss_mask) > 0  # (T,) completion tokens in the loss
    d = reverse_kl_per_token(np.asarray(batch.inference_logprobs)[on], np.asarray(batch.teacher_logprobs)[on])
    return {"teacher/reverse_kl": float(d.mean()) if d.size else 0.0, "teacher/latency_s": float(teacher_time_s)}
