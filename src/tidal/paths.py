"""The run directory: every path the three components share, and the one way a file or a directory becomes
visible to another process.

Layout of a run directory (`--output-dir`, or orch `output_dir`):

    rollouts/step_{n}.safetensors   batch n (orchestrator -> trainer; filesystem transport) and `DONE`
    broadcasts/step_{n}/            policy n (trainer -> orchestrator): PEFT adapter, `merged/`, `STABLE`
    broadcasts/PUSH_REQUEST         an orchestrator asks for the current policy again (weight_broadcast nccl)
    checkpoints/{trainer,orch}/step_{n}/   checkpoints, each with `STABLE`
    metrics.jsonl, samples.jsonl, eval.jsonl, report.html, tensorboard/, configs/, logs/ (+ INFER_READY),
    final/{adapter,merged}/
    data/{train,NAME}.jsonl         the Python API's datasets (`tidal.api`: `GRPOTrainer`'s train / eval rows)
    sft/ (+ sft/step_{n}/)          `tidal sft`'s result (adapter or full model) and snapshots, each with `STABLE`

Layout of a `tidal serve-tinker` directory (`--output-dir`):

    checkpoints/{MODEL_ID}/{weights,sampler_weights}/{NAME}/   `tinker://MODEL_ID/KIND/NAME`, each with `STABLE`
    vllm.log

Durability rule (one for everything another process or a later run reads): a file is written under a temp
name beside its final name, fsynced, renamed into place and its directory fsynced (`atomic_file`); a directory
is filled under a temp name, every file in it fsynced, renamed into place, then marked complete by a `STABLE`
file written the same way (`atomic_dir`). A reader trusts a file once it exists and a directory once its
`STABLE` exists; a failed write removes its temp and leaves what was there before. Temp names start with a dot
and carry the writer's pid; a temp left by a writer that died is removed by the next write beside it.

The seed's trainer `output_dir` may be the run directory itself or a parent holding one `run_*` run directory
(`find_run_dir`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

STABLE = "STABLE"


# --- path builders --------------------------------------------------------------------------------------------

def rollouts_dir(run_dir: Path) -> Path:
    return run_dir / "rollouts"


def batch_path(run_dir: Path, step: int) -> Path:
    return rollouts_dir(run_dir) / f"step_{step}.safetensors"


def done_path(run_dir: Path) -> Path:
    """Holds the orchestrator's last step once it has written every batch."""
    return rollouts_dir(run_dir) / "DONE"


def broadcasts_dir(run_dir: Path) -> Path:
    return run_dir / "broadcasts"


def broadcast_dir(run_dir: Path, step: int) -> Path:
    return broadcasts_dir(run_dir) / f"step_{step}"


def push_request_path(run_dir: Path) -> Path:
    return broadcasts_dir(run_dir) / "PUSH_REQUEST"


def ckpt_root(run_dir: Path, component: str) -> Path:
    return run_dir / "checkpoints" / component


def ckpt_dir(run_dir: Path, component: str, step: int) -> Path:
    return ckpt_root(run_dir, component) / f"step_{step}"


def metrics_path(run_dir: Path) -> Path:
    """One JSON record per trained step (the trainer is its only writer)."""
    return run_dir / "metrics.jsonl"


def samples_path(run_dir: Path) -> Path:
    return run_dir / "samples.jsonl"


def eval_path(run_dir: Path) -> Path:
    return run_dir / "eval.jsonl"


def report_path(run_dir: Path) -> Path:
    return run_dir / "report.html"


def tensorboard_dir(run_dir: Path) -> Path:
    return run_dir / "tensorboard"


def configs_dir(run_dir: Path) -> Path:
    """The resolved configs a co-locate run was started with."""
    return run_dir / "configs"


def logs_dir(run_dir: Path) -> Path:
    return run_dir / "logs"


def infer_ready_path(run_dir: Path) -> Path:
    """`tidal grpo`'s gate: written once every inference server answers `/health`; a trainer started with vLLM
    on a GPU waits for it before touching CUDA (`tidal.colocate.start_order`)."""
    return run_dir / "logs" / "INFER_READY"


def final_dir(run_dir: Path, what: str) -> Path:
    """`final/adapter`, `final/merged` or (full fine-tuning) `final/model`: the exports written when training ends."""
    return run_dir / "final" / what


def data_dir(run_dir: Path) -> Path:
    """The Python API's datasets as JSON lines (`train.jsonl`, one `{name}.jsonl` per eval dataset)."""
    return run_dir / "data"


def sft_dir(run_dir: Path, save_to: str | None = None) -> Path:
    """`tidal sft`'s result: train `sft.save_to` when set, else `{run_dir}/sft`."""
    return Path(save_to) if save_to else run_dir / "sft"


def tinker_ckpt_dir(run_dir: Path, model_id: str, kind: str, name: str) -> Path:
    """`tinker://{model_id}/{kind}/{name}` of a `tidal serve-tinker` directory (`kind`: weights or
    sampler_weights)."""
    return run_dir / "checkpoints" / model_id / kind / name


def holds_run(run_dir: Path) -> bool:
    """True when `run_dir` already holds (part of) a run."""
    return any(p.exists() for p in (rollouts_dir(run_dir), broadcasts_dir(run_dir), metrics_path(run_dir)))


def step_files(directory: Path, suffix: str = "") -> list[int]:
    """Steps n of the `step_{n}{suffix}` entries of `directory`, ascending (no check of completeness)."""
    if not directory.is_dir():
        return []
    names = (p.name.removesuffix(suffix) for p in directory.glob(f"step_*{suffix}"))
    return sorted(int(n[5:]) for n in names if n[5:].isdigit())


def stable_steps(directory: Path) -> list[int]:
    """Steps n whose `directory/step_{n}/STABLE` exists (complete directories), ascending."""
    return [s for s in step_files(directory) if (directory / f"step_{s}" / STABLE).is_file()]


def find_run_dir(output_dir: str | Path, timeout_s: float = 600.0, poll_s: float = 0.5) -> Path:
    """Resolve the trainer's run directory, waiting up to `timeout_s` for the orchestrator to create it."""
    root = Path(output_dir)
    if root.name.startswith("run_") or rollouts_dir(root).is_dir():
        return root
    start = time.monotonic()
    while True:
        runs = sorted(d for d in root.glob("run_*") if rollouts_dir(d).is_dir()) if root.is_dir() else []
        if len(runs) == 1:
            return runs[0]
        if len(runs) > 1:
            raise RuntimeError(f"{root} holds several run directories ({', '.join(r.name for r in runs)}); "
                               "set output_dir to one of them or pass --output-dir")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no run directory with rollouts/ appeared under {root} in {timeout_s:.0f} s; "
                               "is the orchestrator running with the same output_dir?")
        time.sleep(poll_s)


# --- atomic writes --------------------------------------------------------------------------------------------

def _temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp.{os.getpid()}")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temps(directory: Path) -> None:
    """Remove temps (`.NAME.tmp.PID`) in `directory` whose writer is gone (a crash, a kill, a full disk)."""
    if not directory.is_dir():
        return
    for p in directory.glob(".*.tmp.*"):
        pid = p.name.rsplit(".", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
            _remove(p)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temp path to write; on success it is fsynced and renamed to `path` (then the directory is
    fsynced); on any error it is removed and `path` is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        yield tmp
        _fsync_path(tmp)
        os.replace(tmp, path)
        _fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes | str) -> None:
    """`data` at `path`, atomically (see `atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_dir(final: Path, marker: str = "", *, keep_complete: bool = False) -> Iterator[Path]:
    """Yield an empty temp directory to fill; on success every file in it is fsynced, it replaces `final`, and
    `final/STABLE` (holding `marker`) is written last. On any error the temp directory is removed and
    `final` is left as it was. `keep_complete`: for a cache entry of which any copy is as good as another (two
    processes filling the same one at once): when `final` is complete (its STABLE exists) by the time the temp is,
    the temp is dropped and `final`, which a reader may be using, is left alone."""
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_temps(final.parent)
    tmp = _temp_name(final)
    _remove(tmp)
    try:
        tmp.mkdir()
        yield tmp
        if keep_complete and (final / STABLE).is_file():
            _remove(tmp)
            return
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_path(f)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_path(final.parent)
    except BaseException:
        _remove(tmp)
        raise
    write_atomic(final / STABLE, marker)
