"""How `tidal grpo` ends a run whose trainer does not exit 0 (`tidal.colocate.supervise.run_colocate`): it tells how to
resume a failed run only when there is something to resume from (a trainer checkpoint under the run directory), and
a trainer that trained to its end but could not write a final export (exit `procs.EXPORT_FAILED`) ends the run with
that code once the orchestrator is done, not as a failure. Checked on real processes: a stub interpreter whose
`grpo-infer` answers `/health`, whose trainer exits with a given code and whose orchestrator waits or ends."""

from __future__ import annotations

import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tidal.colocate.supervise import run_colocate
from tidal.paths import STABLE, ckpt_dir
from tidal.procs import EXPORT_FAILED

STUB = textwrap.dedent("""\
    #!{python}
    # a stand-in for `python -m tidal.cli CMD CONFIG ...`: vLLM answers /health, the trainer exits at once
    import sys, time, http.server
    cmd, config = sys.argv[3], sys.argv[4]
    if cmd == "grpo-infer":
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", int(open(config).read())), Health).serve_forever()
    if cmd == "grpo-train":
        print("Traceback: the trainer failed", flush=True)
        sys.exit({train_code})
    time.sleep({orch_s})  # the orchestrator: waits for batches that never come, or ends after its last one
    """)
HINT = "[tidal] resume the run with: tidal grpo --resume"


def stub_run(tmp_path: Path, checkpoint: bool, train_code: int = 1, orch_s: float = 60) -> int:
    """`run_colocate`'s exit code on the stub, whose trainer exits `train_code` and whose orchestrator exits 0
    after `orch_s` seconds; `checkpoint`: the run directory holds a complete trainer checkpoint (step 2) first."""
    stub = tmp_path / "python-stub"
    stub.write_text(STUB.format(python=sys.executable, train_code=train_code, orch_s=orch_s))
    stub.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configs = {name: tmp_path / f"{name}.yaml" for name in ("infer", "orch", "train")}
    for path in configs.values():
        path.write_text(str(port))
    run_dir = tmp_path / "run"
    if checkpoint:
        step = ckpt_dir(run_dir, "trainer", 2)
        step.mkdir(parents=True)
        (step / STABLE).write_text("")
    return run_colocate(str(stub), run_dir, configs, f"http://127.0.0.1:{port}/health", infer_start_timeout_s=60,
                        resume_hint="tidal grpo --resume")


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_resume_hint_needs_a_trainer_checkpoint(tmp_path, capfd, checkpoint):
    assert stub_run(tmp_path, checkpoint) == 1
    err = capfd.readouterr().err
    assert "the trainer exited with code 1" in err, err[-2000:]
    assert (HINT in err) == checkpoint, err[-2000:]


def test_a_trainer_whose_final_export_failed_ends_the_run_with_its_code_after_the_orchestrator(tmp_path, capfd):
    t0 = time.monotonic()
    assert stub_run(tmp_path, True, train_code=EXPORT_FAILED, orch_s=3) == EXPORT_FAILED
    assert time.monotonic() - t0 >= 3, "the orchestrator was waited for, not stopped as after a failure"
    out, err = capfd.readouterr()
    assert "a final export it was asked for is missing" in err and "`tidal export`" in err, err[-2000:]
    assert "error:" not in err and HINT not in err and "run complete" not in out, "not a failure, not a success"
