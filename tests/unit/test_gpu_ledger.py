"""The GPU ledger (bench/gpu_ledger.json, scripts/gpu_ledger.py) and what the docs say about GPUs.

Every GPU claim is a ledger row; the committed bench/GPU-LEDGER.md is the json's rendering; every `ledger:ID` the docs
name exists; a sentence of the docs that calls something verified / passed / proven on a GPU names only rows that
passed, and one that says something was measured or ran on a GPU names rows that ran. Merging a lease's rows changes
only the rows it ran.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_ledger  # noqa: E402

DOCS = sorted([*REPO.glob("docs/*.md"), *REPO.glob("bench/*.md"), REPO / "README.md"])
CITE = re.compile(r"`ledger:([A-Za-z0-9][\w.-]*)`")
PASSED = re.compile(r"\b(verified|passed|proven|proved)\s+on\s+(a|an|the|one)\s+(GPU|H100|H200)", re.I)
RAN = re.compile(r"\b(measured|ran)\s+on\s+(a|an|the|one)\s+(GPU|H100|H200)", re.I)
NEGATED = re.compile(r"\b(not|never|nothing|no)\b[\w\s]{0,12}$", re.I)


def rows() -> dict[str, dict]:
    return {r["id"]: r for r in gpu_ledger.load()}


def sentences(text: str) -> list[str]:
    """The docs' sentences (paragraphs joined, split after . ! ? before a capital, a backtick or a bracket)."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        out += re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", " ".join(para.split()))
    return out


def claims(sentence: str, pattern: re.Pattern[str]) -> bool:
    """Whether `sentence` makes `pattern`'s claim un-negated ("not yet passed on a GPU" is no claim)."""
    return any(not NEGATED.search(sentence[:m.start()]) for m in pattern.finditer(sentence))


def test_the_ledger_is_valid_and_holds_every_gpu_row():
    ledger = rows()
    import gpu_check

    for name in (c.name for c in gpu_check.CHECKS):
        assert name in ledger or f"{name}-0.6b" in ledger, f"gpu_check row {name} has no ledger row"
    for needed in ("smoke", "e2e-0.6b", "e2e-4b", "e2", "q", "qwen3-vl", "j", "liger", "compiled-layers",
                   "fused-adamw", "parity-elementwise", "profile-elementwise", "smollm2-135m",
                   "partial-rollouts-longtail", "L1", "L2", "L3", "L4"):
        assert needed in ledger, needed
    ran = [r for r in ledger.values() if r["result"] != "never run"]
    assert {r["result"] for r in ran} == {"pass", "fail"} and all(r["device"] and r["date"] for r in ran)


def test_the_markdown_is_the_rendering_of_the_json():
    text = gpu_ledger.render(gpu_ledger.load())
    assert (REPO / "bench" / "GPU-LEDGER.md").read_text() == text, "run: python3 scripts/gpu_ledger.py render"
    proc = subprocess.run([sys.executable, "scripts/gpu_ledger.py", "check"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_row_the_docs_name_exists_and_claims_match_results():
    ledger, problems, cited = rows(), [], set()
    for path in DOCS:
        if path.name == "GPU-LEDGER.md":
            continue
        for sentence in sentences(path.read_text()):
            ids = CITE.findall(sentence)
            cited.update(ids)
            problems += [f"{path.name}: unknown row {i}" for i in ids if i not in ledger]
            known = [ledger[i] for i in ids if i in ledger]
            if claims(sentence, PASSED) and (not known or any(r["result"] != "pass" for r in known)):
                problems.append(f"{path.name}: a pass claim without passed rows: {sentence[:160]}")
            if claims(sentence, RAN) and (not known or any(r["result"] == "never run" for r in known)):
                problems.append(f"{path.name}: a GPU measurement without rows that ran: {sentence[:160]}")
    assert not problems, "\n".join(problems)
    assert len(cited) >= 20, f"the docs cite only {sorted(cited)}"


def test_the_claim_rules_catch_what_they_should():
    assert claims("This was verified on a GPU.", PASSED)
    assert not claims("Router replay is not yet passed on a GPU.", PASSED)
    assert claims("Measured on the H200: b 137 s.", RAN) and not claims("It was never measured on a GPU.", RAN)
    assert sentences("A b. `ledger:x` c.\n\nD e") == ["A b.", "`ledger:x` c.", "D e"]


def valid_row(**kw):
    row = {"id": "x", "what": "w", "command": "python3 -c pass", "budget_s": 10, "lease": True, "needs": [],
           "priority": 1, "result": "never run", "measured_s": None, "device": None, "commit": None, "date": None,
           "figure": None, "table": None, "note": None}
    return row | kw


@pytest.mark.parametrize("bad, says", [
    ({"result": "ok"}, "result"), ({"budget_s": 0}, "budget_s"), ({"lease": True, "command": ""}, "command"),
    ({"lease": False}, "note"), ({"needs": ["cuda"]}, "needs"), ({"result": "pass"}, "device"),
])
def test_a_malformed_row_is_refused_naming_the_field(bad, says):
    with pytest.raises(gpu_ledger.LedgerError, match=says):
        gpu_ledger.validate([valid_row(**bad)])
    with pytest.raises(gpu_ledger.LedgerError, match="unique"):
        gpu_ledger.validate([valid_row(), valid_row()])
    extra = valid_row()
    extra["nonsense"] = 1
    with pytest.raises(gpu_ledger.LedgerError, match="nonsense"):
        gpu_ledger.validate([extra])


def test_merge_takes_the_rows_a_lease_ran_and_nothing_else(tmp_path):
    ledger = [valid_row(id="a"), valid_row(id="b"), valid_row(id="c")]
    before = copy.deepcopy(ledger)
    ran = valid_row(id="b", result="fail", measured_s=12.5, device="NVIDIA H100", date="2026-11-28", figure="exit 1")
    changed = gpu_ledger.merge(ledger, [valid_row(id="a"), ran], commit="abc1234")
    assert changed == ["b"] and ledger[0] == before[0] and ledger[2] == before[2]
    assert ledger[1]["result"] == "fail" and ledger[1]["commit"] == "abc1234" and ledger[1]["measured_s"] == 12.5
    with pytest.raises(gpu_ledger.LedgerError, match="not in the ledger"):
        gpu_ledger.merge(ledger, [valid_row(id="zz", result="pass")])
    path = tmp_path / "l.json"
    gpu_ledger.dump(ledger, path)
    assert gpu_ledger.load(path) == ledger and json.loads(path.read_text())["rows"][1]["id"] == "b"
