"""`tidal.rewards.code_exec:unit_tests` — reward a completion's Python code by running tests against it.

The code (the last ```python fenced block of the completion, else the whole completion) is concatenated with
the example's `tests` column and run by `tidal.rewards.sandbox.run_python`: a subprocess with time and memory limits
and no network. Reward 1.0 when it exits 0 within the limits, else 0.0; None for an example without tests
(TRL's "not applicable"). Use as
`reward_funcs: [{import_path: "tidal.rewards.code_exec:unit_tests", kwargs: {timeout_s: 5, memory_mb: 256}}]`.
"""

from __future__ import annotations

import re
from typing import Any

from tidal.rewards.sandbox import run_python

FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def unit_tests(completions: list[Any], tests: list[str | None] | None = None,
               timeout_s: float = 5.0, memory_mb: int = 256, **_: Any) -> list[float | None]:
    """1.0 per completion whose code passes its example's `tests`, 0.0 otherwise, None without tests.
    `completions`: strings (standard prompts) or assistant-message lists (conversational)."""
    out: list[float | None] = []
    for i, comp in enumerate(completions):
        test = tests[i] if tests is not None else None
        if not test:
            out.append(None)
            continue
        text = comp if isinstance(comp, str) else comp[-1]["content"]  # standard or conversational
        code = f"{extract_code(text)}\n\n{test}\n"
        out.append(1.0 if run_python(code, timeout_s=timeout_s, memory_mb=memory_mb).ok else 0.0)
    return out
