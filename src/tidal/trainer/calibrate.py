"""The trainer's peak memory measured before vLLM starts (`tidal grpo` on a GPU, `tidal.colocate.split`): build the
trainer a TrainConfig describes and run one training step on its largest micro-batch (`calibrate`), in a child
process so that its CUDA memory is gone before vLLM starts (`measure_in_child`; `python -m tidal.trainer.calibrate
TRAIN.json` prints the peak as JSON). A mixture-of-experts model whose run replays routes (train `router_replay`
true, or `auto` on an architecture tidal replays) gets a batch that carries routes (`synthetic_routes`), as its real
batches will: the replay hooks run in the measured step, and `router_replay: true` does not refuse the batch.
"""

from __future__ import annotations

from typing import Any

from tidal.models.config import model_config, text_config
from tidal.models.memory import GIB
from tidal.models.routes import REPLAYABLE, moe_shape, route_dtype
from tidal.trainer.memory import peak_gib, reset_peak


def synthetic_batch(rows: int, sequence_len: int, vocab: int, seed: int = 0) -> Any:
    """A `TrainingBatch` of `rows` samples of `sequence_len` tokens each (a quarter of each a prompt): the largest
    micro-batch the trainer packs for a run of these lengths."""
    import numpy as np

    from tidal.transport.batch import TrainingBatch

    rng = np.random.default_rng(seed)
    lengths = np.full(rows, sequence_len)
    mask = np.tile(np.r_[np.zeros(sequence_len // 4), np.ones(sequence_len - sequence_len // 4)], rows)
    adv = np.repeat(rng.normal(size=rows), sequence_len)
    return TrainingBatch(step=1, temperature=1.0, tokens=rng.integers(0, vocab, size=rows * sequence_len),
                         lengths=lengths, loss_mask=mask, inference_logprobs=-rng.random(rows * sequence_len) * 5,
                         advantages=adv, rewards=rng.random(rows), policy_steps=np.zeros(rows),
                         truncated=np.zeros(rows, dtype=bool))


def synthetic_routes(tokens: int, config: dict[str, Any], setting: bool | str, seed: int = 0) -> Any:
    """(tokens, layers, top_k) routed experts for a calibration batch of a (text) config.json `config`: top_k distinct
    experts per token and layer, uniformly drawn; None when the run replays no routes (train `router_replay`
    `setting` false, a dense model, or `auto` on an architecture tidal does not replay)."""
    import numpy as np

    layers, experts, top_k = moe_shape(config)
    replays = setting is True or (setting == "auto" and config.get("model_type") in REPLAYABLE)
    if not replays or not experts or not top_k:
        return None
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :top_k]  # distinct per token-layer
    return picks.astype(route_dtype(experts))


def calibrate(train: Any) -> dict[str, float]:
    """Build the trainer `train` describes and run one training step on its largest micro-batch (`synthetic_batch`);
    returns the measured peak in GiB: `allocated` and `reserved` (torch.cuda's) on CUDA, the peak RSS on CPU."""

    import torch

    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer

    model, device = load_policy(train)
    opt = make_optimizer(model, train)
    config = text_config(model_config(train.model))
    rows = (train.micro_batch_tokens // train.sequence_len if train.micro_batch_tokens
            else train.per_device_train_batch_size)
    batch = synthetic_batch(rows, train.sequence_len, int(config["vocab_size"]))
    batch.routed_experts = synthetic_routes(len(batch.tokens), dict(config), train.router_replay)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak(device)
    train_step(model, opt, batch, train, device, pad_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"allocated": torch.cuda.max_memory_allocated(device) / GIB,
                "reserved": torch.cuda.max_memory_reserved(device) / GIB}
    peak = peak_gib(device)
    return {"allocated": peak, "reserved": peak}


CALIBRATION_TIMEOUT_S = 900.0


def measure_in_child(train: Any, gradient_checkpointing: bool) -> float | None:
    """`calibrate` in a child process (its CUDA memory is gone when it exits, before vLLM starts): the peak reserved
    GiB with `gradient_checkpointing` as given; infinity when the step ran out of memory on the empty GPU; None
    (with a warning) when it could not run."""
    import json
    import subprocess
    import sys
    import tempfile
    import warnings

    from tidal import procs

    cfg = train.model_copy(update={"gradient_checkpointing": gradient_checkpointing, "cpu_affinity": None})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(cfg.model_dump_json())
    try:  # through tidal.procs: the child dies with this process (parent-death signal), its group at the timeout
        proc = procs.run([sys.executable, "-m", "tidal.trainer.calibrate", f.name], CALIBRATION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warnings.warn(f"trainer memory calibration did not run ({exc!r}); using the estimate alone", stacklevel=2)
        return None
    finally:
        import os

        os.unlink(f.name)
    if proc.returncode != 0:
        if "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr:
            return float("inf")
        warnings.warn(f"trainer memory calibration failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}; "
                      f"using the estimate alone", stacklevel=2)
        return None
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["reserved"])


if __name__ == "__main__":  # python -m tidal.trainer.calibrate TRAIN.json: one calibration step, JSON on stdout
    import json
    import sys

    from tidal.config.train import TrainConfig

    print(json.dumps(calibrate(TrainConfig.model_validate_json(open(sys.argv[1]).read()))), flush=True)
