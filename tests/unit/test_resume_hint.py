"""`tidal grpo` tells how to resume a failed run only when there is something to resume from: a trainer checkpoint
under the run directory (`tidal.colocate.supervise.run_colocate`). Checked on real processes: a stub interpreter
whose `grpo-infer` answers `/health` and whose trainer exits with code 1."""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

import pytest

from tidal.colocate.supervise import run_colocate
from tidal.paths import STABLE, ckpt_dir

STUB = textwrap.dedent("""\
    #!{python}
    # a stand-in for `python -m tidal.cli CMD CONFIG ...`: vLLM answers /health, the trainer fails at once
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
        sys.exit(1)
    time.sleep(60)  # the orchestrator waits for batches that never come
    """)
HINT = "[tidal] resume the run with: tidal grpo --resume"


def failed_run(tmp_path: Path, checkpoint: bool) -> None:
    """`run_colocate` on the stub, whose trainer exits 1; `checkpoint`: the run directory holds a complete
    trainer checkpoint (step 2) before it starts."""
    stub = tmp_path / "python-stub"
    stub.write_text(STUB.format(python=sys.executable))
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
    code = run_colocate(str(stub), run_dir, configs, f"http://127.0.0.1:{port}/health", infer_start_timeout_s=60,
                        resume_hint="tidal grpo --resume")
    assert code == 1


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_resume_hint_needs_a_trainer_checkpoint(tmp_path, capfd, checkpoint):
    failed_run(tmp_path, checkpoint)
    err = capfd.readouterr().err
    assert "the trainer exited with code 1" in err, err[-2000:]
    assert (HINT in err) == checkpoint, err[-2000:]
