"""`make gpu-lease` (scripts/gpu_lease.py) on CPU: its order, its plan within a deadline, its judgement of a row's
output, and real runs of a ledger of its own (real child processes: a pass, a failure, a row stopped at its budget
with its whole process group, a skipped row, the smoke row stopping the lease), plus `--dry-run` through make.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_lease  # noqa: E402
import gpu_ledger  # noqa: E402


def row(id, result="never run", budget=10, priority=9, date=None, needs=(), command="python3 -c pass", lease=True):
    ran = result != "never run"
    return {"id": id, "what": "w", "command": command, "budget_s": budget, "lease": lease, "needs": list(needs),
            "priority": priority, "result": result, "measured_s": 1.0 if ran else None,
            "device": "GPU" if ran else None, "commit": None, "date": date, "figure": "f" if ran else None,
            "table": None, "note": None if lease else "why"}


def test_order_is_smoke_then_never_run_then_failed_then_oldest_pass():
    rows = [row("p-new", "pass", date="2026-11-27"), row("f", "fail", date="2026-11-26"), row("n2", priority=2),
            row("p-old", "pass", date="2026-11-20"), row("n1", priority=1), row("smoke", "pass", date="2026-11-28"),
            row("off", lease=False)]
    assert [r["id"] for r in gpu_lease.order(rows)] == ["smoke", "n1", "n2", "f", "p-old", "p-new"]


def test_plan_fits_the_deadline_and_says_what_it_leaves_out():
    rows = [row("smoke", budget=100), row("big", budget=500, priority=1), row("trl", budget=50, priority=2,
                                                                             needs=["trl"]),
            row("small", budget=200, priority=3), row("tail", budget=250, priority=4)]
    p = gpu_lease.plan(rows, 400, available=set())
    assert [r["id"] for r in p.run] == ["smoke", "small"] and p.planned_s == 300 <= 400
    assert dict((r["id"], why) for r, why in p.left_out) == {
        "big": "budget 500 s > 300 s left", "trl": "needs trl, not here", "tail": "budget 250 s > 100 s left"}
    assert [r["id"] for r in gpu_lease.plan(rows, 400, None).run] == ["smoke", "trl", "small"]
    assert [r["id"] for r in gpu_lease.plan(rows, 400, None, only={"tail"}).run] == ["tail"]


def test_the_real_ledger_plans_the_issue_order_within_any_deadline():
    rows = gpu_ledger.load()
    for deadline in (120, 300, 600, gpu_lease.DEFAULT_DEADLINE_S, 3000):
        p = gpu_lease.plan(rows, deadline)
        assert p.planned_s <= deadline
    first = [r["id"] for r in gpu_lease.plan(rows, 10**6).run]
    expected = ["smoke", "e2e-0.6b", "g4", "o", "s", "q", "e2", "policy-check", "e2e-4b", "warm-pool-gpu", "L1", "L2",
                "L3", "L4", "j"]
    assert first[:len(expected)] == expected
    assert gpu_lease.DEFAULT_DEADLINE_S <= gpu_lease.PER_CALL_S - gpu_lease.STOP_MARGIN_S


def test_judge_reads_the_exit_code_the_budget_and_ledger_result_lines():
    ok = 'LEDGER_RESULT {"row": "g4", "status": "pass", "figure": "g4: fine"}'
    bad = 'LEDGER_RESULT {"row": "g4", "status": "FAIL", "figure": "g4: planned 3 GiB < peak 9"}'
    late = 'LEDGER_RESULT {"row": "j", "status": "not reached", "figure": "j: 3 s left"}'
    assert gpu_lease.judge(0, "x\n" + ok, 60) == ("pass", "g4: fine")
    assert gpu_lease.judge(1, bad, 60) == ("fail", "g4: planned 3 GiB < peak 9")
    assert gpu_lease.judge(0, late, 60)[0] == "skipped"
    assert gpu_lease.judge(0, "last words\n", 60) == ("pass", "last words")
    assert gpu_lease.judge(3, "boom\n", 60) == ("fail", "exit 3; boom")
    status, figure = gpu_lease.judge(None, ok, 60)
    assert status == "fail" and figure.startswith("stopped at its budget of 60 s")
    assert gpu_lease.judge(0, "LEDGER_RESULT {broken", 60)[0] == "fail"
    assert gpu_lease.judge(0, "....\n4 passed in 3.20s\n", 60) == ("pass", "4 passed in 3.20s")
    for summary in ("4 passed, 1 skipped in 3.20s", "==== 1 passed, 7 skipped, 2 deselected in 9.10s ===="):
        status, figure = gpu_lease.judge(0, f"....\n{summary}\n", 60)  # a skipped test proves nothing
        assert status == "skipped" and "skipped some of the row's tests" in figure, (summary, figure)
    assert gpu_lease.judge(0, "==== 3 skipped in 0.20s ====\n", 60)[0] == "skipped"
    assert gpu_lease.judge(5, "no tests ran in 0.05s\n", 60)[0] == "skipped"
    assert gpu_lease.judge(1, "1 failed, 2 passed in 3.00s\n", 60)[0] == "fail"


SKIPPED = ("python3 -c \"print('LEDGER_RESULT {\\\"status\\\": \\\"skipped\\\", "
           "\\\"figure\\\": \\\"x\\\"}')\"")


def write_ledger(path: Path, rows: list[dict]) -> Path:
    gpu_ledger.dump(rows, path)
    return path


def lease(ledger: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, "scripts/gpu_lease.py", "--ledger", str(ledger), "--out", str(out),
                           "--allow-cpu", "--commit", "abc1234", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_lease_runs_rows_kills_one_at_its_budget_and_writes_rows(tmp_path):
    marker = tmp_path / "grandchild.pid"
    sleeper = (f"python3 -c \"import subprocess,sys; p=subprocess.Popen([sys.executable,'-c','import time; "
               f"time.sleep(60)']); open('{marker}','w').write(str(p.pid)); p.wait()\"")
    rows = [row("smoke", command="python3 -c \"print('smoke ok')\""),
            row("slow", budget=3, priority=1, command=sleeper),
            row("bad", priority=2, command="python3 -c \"import sys; print('no good'); sys.exit(4)\""),
            row("skip", "pass", date="2026-11-01", priority=3, command=SKIPPED),
            row("far", budget=500, priority=4)]
    ledger = write_ledger(tmp_path / "ledger.json", rows)
    started = time.monotonic()
    proc = lease(ledger, tmp_path / "out", "--deadline", "100")
    assert time.monotonic() - started < 60
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "out" / "gpu_ledger_rows.json").read_text())["rows"]
    by_id = {r["id"]: r for r in out}
    assert list(by_id) == ["smoke", "slow", "bad", "skip"]
    assert by_id["smoke"]["result"] == "pass" and by_id["smoke"]["figure"] == "smoke ok"
    assert by_id["smoke"]["commit"] == "abc1234" and by_id["smoke"]["device"].startswith("CPU")
    assert by_id["slow"]["result"] == "fail" and "stopped at its budget of 3 s" in by_id["slow"]["figure"]
    assert by_id["bad"]["result"] == "fail" and by_id["bad"]["figure"] == "exit 4; no good"
    assert by_id["skip"]["result"] == "pass" and by_id["skip"]["date"] == "2026-11-01"  # skipped: unchanged
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{grandchild}").exists(), "the row's process group outlived its budget"
    assert (tmp_path / "out" / "logs" / "bad.log").read_text().strip() == "no good"
    assert "not reached" not in (tmp_path / "out" / "GPU-LEASE.md").read_text()
    tail = proc.stdout.strip().splitlines()
    assert "the next lease will run:" in proc.stdout and "far" not in "\n".join(tail[-4:])
    assert tail[-1].strip().startswith("= ")
    merged = json.loads(ledger.read_text())["rows"]
    gpu_ledger.merge(merged, out)
    assert {r["id"]: r["result"] for r in merged} == {"smoke": "pass", "slow": "fail", "bad": "fail",
                                                      "skip": "pass", "far": "never run"}


def test_a_failed_smoke_stops_the_lease(tmp_path):
    rows = [row("smoke", command="python3 -c \"import sys; sys.exit(1)\""), row("next", priority=1)]
    proc = lease(write_ledger(tmp_path / "ledger.json", rows), tmp_path / "out")
    assert proc.returncode == 1 and "lease stops here" in proc.stdout
    out = json.loads((tmp_path / "out" / "gpu_ledger_rows.json").read_text())["rows"]
    assert [r["id"] for r in out] == ["smoke"]
    assert "| next | not reached (stays never run)" in (tmp_path / "out" / "GPU-LEASE.md").read_text()


def test_bad_arguments_and_a_malformed_ledger_exit_2(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"rows": [row("x") | {"result": "maybe"}]}))
    proc = lease(broken, tmp_path / "out")
    assert proc.returncode == 2 and "result 'maybe'" in proc.stderr
    proc = lease(write_ledger(tmp_path / "ok.json", [row("x")]), tmp_path / "out", "--only", "nope")
    assert proc.returncode == 2 and "nope" in proc.stderr


def test_make_gpu_lease_dry_run_prints_a_plan_that_fits():
    make = shutil.which("make")
    assert make is not None
    proc = subprocess.run([make, "-s", "gpu-lease", 'GPU_LEASE_ARGS=--dry-run --deadline 600'], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    total = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("= "))
    planned = float(total.split()[1])
    assert 0 < planned <= 600 and "1. smoke" in proc.stdout
