"""`tidal.inference.backends.vllm.seeded_cpu`: a discarded sample rewinds a CPU generator by state (issue 53).

The runner here is a stand-in with vLLM's attribute names; its `_bookkeeping_sync` runs vLLM 0.32's rewind line
verbatim (`gen.set_offset(gen.get_offset() - 4)`), which raises on a CPU generator. The real server path is in
tests/integration/test_seeded_sampling.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tidal.inference.backends.vllm import seeded_cpu


class Runner:
    """vLLM's model-runner attributes the patch reads; `_sample` draws once per seeded row (vLLM's exponential_)."""

    def __init__(self, seeds: list[int], discard: list[bool]) -> None:
        gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
        self.input_batch = SimpleNamespace(num_reqs=len(seeds), generators=gens)
        self.discard_request_mask = SimpleNamespace(np=np.array(discard + [False] * 3))

    def _sample(self) -> dict[int, float]:
        return {i: float(torch.empty(4, dtype=torch.float64).exponential_(generator=g)[0])
                for i, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self) -> str:
        for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "booked"


def draws(seed: int, k: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return [float(torch.empty(4, dtype=torch.float64).exponential_(generator=g)[0]) for _ in range(k)]


def test_vllm_rewind_crashes_on_a_cpu_generator():
    runner = Runner([1, 2], [True, False])
    runner._sample()
    with pytest.raises(RuntimeError, match="does not use offset"):
        runner._bookkeeping_sync()


def test_discarded_draw_is_undone_and_kept_draws_advance():
    seeds = [int(s) for s in torch.randint(0, 2**31, (3,))]
    runner = Runner(seeds, [True, False, True])
    sample, book = seeded_cpu.snapshotting(Runner._sample), seeded_cpu.restoring(Runner._bookkeeping_sync)
    sample(runner)
    assert book(runner) == "booked"
    assert list(runner.input_batch.generators) == [0, 1, 2], "every generator is back in the batch"
    runner.discard_request_mask.np[:] = False  # the prefill is done: the next step's samples are kept
    second = sample(runner)
    book(runner)
    # rows 0 and 2 drew as if the discarded step never happened; row 1 kept its first draw
    assert second == {0: draws(seeds[0], 1)[0], 1: draws(seeds[1], 2)[1], 2: draws(seeds[2], 1)[0]}


def test_restored_even_when_bookkeeping_raises():
    runner = Runner([5], [True])
    seeded_cpu.snapshotting(Runner._sample)(runner)

    def failing(self):
        raise ValueError("boom")

    with pytest.raises(ValueError):
        seeded_cpu.restoring(failing)(runner)
    assert float(torch.empty(4, dtype=torch.float64).exponential_(
        generator=runner.input_batch.generators[0])[0]) == draws(5, 1)[0]


def test_install_patches_the_cpu_runner_once():
    pytest.importorskip("vllm.v1.worker.cpu_model_runner")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert seeded_cpu.install() and seeded_cpu.install()
    assert getattr(CPUModelRunner._sample, seeded_cpu.MARK)
    assert CPUModelRunner._bookkeeping_sync.__wrapped__ is GPUModelRunner._bookkeeping_sync, "wrapped once"
    assert not getattr(GPUModelRunner._bookkeeping_sync, seeded_cpu.MARK, False), "CUDA runners untouched"
