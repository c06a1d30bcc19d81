"""Issue 37: `tidal grpo` starts the orchestrator and the trainer with vLLM where nothing needs vLLM first
(`tidal.colocate.start_order`). The launcher's order is checked on real processes
(`tidal.colocate.supervise.run_colocate` with a stub interpreter whose `grpo-infer` answers `/health` after a delay
and whose orchestrator and trainer record when they started); a real `tidal grpo` with the overlap:
tests/e2e/test_grpo_runs.py."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tidal.colocate import start_order as startup
from tidal.colocate.start_order import SEQUENTIAL, Milestones, StartPlan, start_plan, wait_for_gate
from tidal.colocate.supervise import run_colocate
from tidal.paths import infer_ready_path


def test_plan_per_device():
    assert start_plan("cpu") == StartPlan(orch_early=True, train_early=True, train_gated=False)
    gpu = start_plan("cuda")  # GPU memory order: the trainer imports early, builds its model after /health
    assert gpu == StartPlan(orch_early=False, train_early=True, train_gated=True)
    assert start_plan("cpu", "sequential") == start_plan("cuda", "sequential") == SEQUENTIAL
    assert not SEQUENTIAL.orch_early and not SEQUENTIAL.train_early
    assert SEQUENTIAL.describe() == "starting orchestrator and trainer"
    assert start_plan("cpu").describe() == "orchestrator and trainer started with it"
    assert "GPU memory order" in gpu.describe()


def test_the_gate_waits_for_its_file(tmp_path):
    gate = tmp_path / "logs" / "INFER_READY"
    threading.Timer(0.4, lambda: (gate.parent.mkdir(), gate.write_text("ready\n"))).start()
    waited = wait_for_gate(gate, timeout_s=30)
    assert 0.3 <= waited < 10 and gate.exists()
    with pytest.raises(TimeoutError, match="never appeared"):
        wait_for_gate(tmp_path / "absent", timeout_s=0.3)


def test_milestones_from_the_lines_tidal_prints(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(startup.time, "monotonic", lambda: now[0])
    m = Milestones(start=100.0)
    for t, who, line in [(5.0, "train", "06:20:49 [train] trainer ready on cpu: 311,296 trainable parameters"),
                         (20.0, "orch", "06:21:11 [orch] orchestrator ready: tidal:tiny-reverse, 8 prompts"),
                         (21.0, "train", "06:21:11 [train] step 1 would be a trainer line"),  # not orch's
                         (22.0, "orch", "06:21:12 [orch] batch 1 written: reward 0.441, policy 0"),
                         (23.0, "orch", "06:21:13 [orch] batch 2 written: reward 0.401, policy 0"),
                         (25.0, "train", "06:21:15 [train] step 1/3 | reward 0.441 ± 0.291 | mismatch_kl 1.7e-12")]:
        now[0] = 100.0 + t
        m.feed(who, line)
    # the stray "step 1" at 21 s came from the trainer and counts; the later one does not move the mark
    assert m.marks == {"trainer ready": 5.0, "orchestrator ready": 20.0, "first step done": 21.0, "first batch": 22.0}
    assert m.done()
    assert m.summary() == ("first step done after 21.0 s (trainer ready 5.0, orchestrator ready 20.0, first batch "
                           "22.0 s since vLLM was started)")


STUB = textwrap.dedent("""\
    #!{python}
    # a stand-in for `python -m tidal.cli CMD CONFIG ...`: records what it does in $STUB_RECORD
    import os, sys, time, http.server, threading
    cmd, config = sys.argv[3], sys.argv[4]
    record = open(os.environ["STUB_RECORD"], "a", buffering=1)
    record.write(f"{{cmd}} start {{time.time()}}\\n")
    if cmd == "grpo-infer":
        time.sleep(1.0)  # vLLM's start-up
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
            def log_message(self, *a):
                pass
        server = http.server.HTTPServer(("127.0.0.1", int(open(config).read())), Health)
        record.write(f"grpo-infer healthy {{time.time()}}\\n")
        server.serve_forever()
    if "--start-gate" in sys.argv:
        from tidal.colocate.start_order import wait_for_gate
        wait_for_gate(__import__("pathlib").Path(sys.argv[sys.argv.index("--start-gate") + 1]), 60)
        record.write(f"{{cmd}} gate {{time.time()}}\\n")
    if cmd == "grpo-train":
        print("00:00:00 [train] trainer ready on cpu: 1 trainable parameters", flush=True)
        time.sleep(0.3)
        print("00:00:01 [train] step 1/1 | reward 0.5", flush=True)
    record.write(f"{{cmd}} exit {{time.time()}}\\n")
    """)


def launch(tmp_path: Path, plan: StartPlan | None) -> dict[str, float]:
    """`run_colocate` with the stub interpreter; returns `{"cmd event": time}` from its record."""
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
    infer_ready_path(run_dir).parent.mkdir(parents=True)
    infer_ready_path(run_dir).write_text("from an earlier start\n")  # removed before anything starts
    os.environ["STUB_RECORD"] = str(tmp_path / "record")
    try:
        assert run_colocate(str(stub), run_dir, configs, f"http://127.0.0.1:{port}/health", plan=plan) == 0
    finally:
        del os.environ["STUB_RECORD"]
    events = {}
    for line in (tmp_path / "record").read_text().splitlines():
        cmd, event, t = line.split()
        events.setdefault(f"{cmd} {event}", float(t))
    return events


def test_on_cpu_orchestrator_and_trainer_start_with_vllm(tmp_path, capfd):
    ev = launch(tmp_path, start_plan("cpu"))
    healthy = ev["grpo-infer healthy"]
    assert ev["grpo-orch start"] < healthy and ev["grpo-train start"] < healthy
    assert "grpo-train gate" not in ev, "a CPU trainer needs no gate"
    out = capfd.readouterr().out
    assert "orchestrator and trainer started with it" in out
    assert "[tidal] first step done after " in out and "trainer ready " in out and "vLLM ready " in out


def test_sequential_starts_both_after_health(tmp_path):
    for i, plan in enumerate([start_plan("cpu", "sequential"), None]):  # None: the order before
        (tmp_path / str(i)).mkdir()
        ev = launch(tmp_path / str(i), plan)
        assert ev["grpo-orch start"] > ev["grpo-infer healthy"] and ev["grpo-train start"] > ev["grpo-infer healthy"]


def test_on_a_gpu_the_trainer_passes_its_gate_only_after_health(tmp_path):
    ev = launch(tmp_path, start_plan("cuda"))
    healthy = ev["grpo-infer healthy"]
    assert ev["grpo-train start"] < healthy <= ev["grpo-train gate"], "imports early, the model after /health"
    assert ev["grpo-orch start"] > healthy, "the orchestrator keeps its GPU-machine order"
    # the gate written by this start, not the stale one: the trainer did not pass early
    assert ev["grpo-train gate"] - ev["grpo-train start"] > 0.5
    assert time.time() >= ev["grpo-train exit"]


def test_the_command_line_options():
    from tidal.cli import build_parser

    p = build_parser()
    assert p.parse_args(["grpo"]).startup == "auto"
    assert p.parse_args(["grpo", "--startup", "sequential"]).startup == "sequential"
    with pytest.raises(SystemExit) as exc:  # argparse: exit 2 naming the valid choices
        p.parse_args(["grpo", "--startup", "overlap"])
    assert exc.value.code == 2
    assert p.parse_args(["grpo-train", "--start-gate", "/x/INFER_READY"]).start_gate == "/x/INFER_READY"
    assert p.parse_args(["grpo-train"]).start_gate is None
