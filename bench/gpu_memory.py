"""The whole GPU's used memory for the GPU benches and checks (bench/gpu_e2e.py, scripts/gpu_check_rows.py): a
peak sampler over every process (NVML through pynvml, else `nvidia-smi`; on CPU the RSS of a process tree), the used
memory now, and a wait until the GPU is back near a level. The GPU is the first of `CUDA_VISIBLE_DEVICES`, an index
or a UUID (`GPU-...`, `MIG-...`, or a unique prefix of one, as CUDA takes them), mapped to NVML's index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from typing import Any

GIB = 2**30


class PeakMemory:
    """The whole GPU's used memory (NVML: pynvml, else `nvidia-smi`), or on CPU the RSS of `pid`'s process tree,
    sampled every 0.2 s in a thread; `peak_gib` the maximum, `base_gib` the first sample."""

    def __init__(self, cuda: bool, pid: int | None = None) -> None:
        self.cuda, self.pid = cuda, pid
        self._stop = threading.Event()
        self._read = self._reader()
        self.base_gib = self.peak_gib = self._read() if self._read else float("nan")
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _reader(self) -> Any:
        if not self.cuda:
            import psutil

            def rss() -> float:
                if self.pid is None:
                    return 0.0
                try:
                    root = psutil.Process(self.pid)
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    return 0.0
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                return total / GIB
            return rss
        device = visible_device(os.environ.get("CUDA_VISIBLE_DEVICES"))
        try:
            import pynvml

            pynvml.nvmlInit()
            uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(pynvml.nvmlDeviceGetCount())]
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index(device, uuids))
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / GIB
        except Exception:  # no pynvml / NVML: nvidia-smi (its -i takes an index or a UUID)
            def smi() -> float:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", device], capture_output=True, text=True, timeout=10).stdout.strip()
                return int(out) / 1024 if out.isdigit() else float("nan")
            return smi if shutil.which("nvidia-smi") else None

    def _poll(self) -> None:
        while not self._stop.is_set() and self._read is not None:
            try:
                value = self._read()
            except Exception:
                value = float("nan")
            if value == value:
                self.peak_gib = value if self.peak_gib != self.peak_gib else max(self.peak_gib, value)
            time.sleep(0.2)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_gib


def visible_device(value: str | None) -> str:
    """The first GPU of `CUDA_VISIBLE_DEVICES` as written (an index or a `GPU-...` / `MIG-...` UUID); "0" unset."""
    return ((value or "0").split(",")[0] or "0").strip()


def nvml_index(device: str, uuids: list[Any]) -> int:
    """NVML's index of `device` (`visible_device`): an index as it is, a UUID (or a unique prefix of one, as CUDA
    accepts) by its place in `uuids` (NVML's UUIDs by index, str or bytes); ValueError naming them otherwise."""
    if device.isdigit():
        return int(device)
    names = [u.decode() if isinstance(u, bytes) else str(u) for u in uuids]
    hits = [i for i, u in enumerate(names) if u == device or u.startswith(device)]
    if len(hits) != 1:
        raise ValueError(f"CUDA_VISIBLE_DEVICES names {device!r}, which matches {len(hits)} of this machine's GPUs "
                         f"{names}")
    return hits[0]


def gpu_used_gib(query: str = "memory.used") -> float:
    """nvidia-smi's `query` (MiB) of the first visible GPU, in GiB; NaN without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return float("nan")
    index = visible_device(os.environ.get("CUDA_VISIBLE_DEVICES"))  # nvidia-smi -i takes an index or a UUID
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", index],
                         capture_output=True, text=True, timeout=10).stdout.strip()
    return int(out) / 1024 if out.isdigit() else float("nan")


def wait_gpu_free(base_gib: float, seconds: float = 45) -> None:
    """Until the GPU is back near `base_gib` (the side before may still be tearing down), up to `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not gpu_used_gib() <= base_gib + 1.0:
        time.sleep(1)
