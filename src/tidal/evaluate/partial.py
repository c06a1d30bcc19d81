"""`tidal eval`'s partial report: every row is written as it finishes, and `resume` keeps them.

While rows are scored, `<out>.partial` (temp + rename after each row) holds the rows finished so far, the settings
they were scored with (`settings`: the EvalConfig keys that change a score: every key but the rows to score, the
report's path, the server's port and the identity check) and each row's fingerprint (`fingerprint`: the base model,
or the adapter's path and the sha256 of its files). An invocation that dies (a vLLM crash, a connection lost, a
wrong policy: exit 4, ctrl-c) loses only the row it was scoring. The next one with `resume` (`tidal eval --resume`)
checks, before vLLM starts, that the partial report exists and was scored with the same settings (exit 2 naming
the keys that differ), keeps each row whose target has the same fingerprint (an adapter trained again is scored
again), and scores the rest; with every row kept it starts no server. The partial report is removed once the whole
report is written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tidal.config.evaluate import EvalConfig
from tidal.config.load import ConfigError
from tidal.evaluate.targets import Target
from tidal.paths import write_atomic

UNSCORED_KEYS = ("adapters", "base", "out", "resume", "port", "policy_check")
"""EvalConfig keys that change no row's score (which rows, where the report goes, the port, the identity check)."""


def partial_path(out: Path) -> Path:
    """Where the partial report of `out` lives: `<out>.partial` beside it."""
    return out.with_name(out.name + ".partial")


def settings(cfg: EvalConfig) -> dict[str, Any]:
    """The settings a row's scores depend on: `cfg` without `UNSCORED_KEYS`."""
    return {k: v for k, v in cfg.model_dump(mode="json").items() if k not in UNSCORED_KEYS}


def fingerprint(target: Target) -> str:
    """`base`, or the adapter directory's path and the sha256 of its files (name, size and bytes of each)."""
    if target.adapter is None:
        return "base"
    digest = hashlib.sha256()
    for f in sorted(p for p in target.adapter.iterdir() if p.is_file()):
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return f"{target.adapter.resolve()}@sha256:{digest.hexdigest()}"


def save(out: Path, cfg: EvalConfig, serve: str, rows: list[dict[str, Any]]) -> None:
    """The partial report of `out`: the rows finished so far (their dicts, each with its `fingerprint`)."""
    write_atomic(partial_path(out), json.dumps({"settings": settings(cfg), "serve": serve, "rows": rows}, indent=1))


def kept_rows(cfg: EvalConfig, targets: list[Target], out: Path) -> tuple[str | None, dict[int, dict[str, Any]]]:
    """With `cfg.resume`: (how the partial report's rows were served, target index -> its row of the same
    fingerprint, as a dict); ConfigError when there is no partial report, it cannot be read, or its settings
    differ. Without `resume`: (None, {})."""
    if not cfg.resume:
        return None, {}
    path = partial_path(out)
    if not path.is_file():
        raise ConfigError(f"resume: no partial report {path} (tidal eval writes it beside --out {out} as rows finish "
                          f"and removes it once the whole report is written): nothing to resume")
    try:
        data = json.loads(path.read_text())
        old, rows, serve = data["settings"], data["rows"], str(data["serve"])
        by_print = {r["fingerprint"]: r for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"resume: {path} is not a partial report of tidal eval ({exc!r})") from None
    now = settings(cfg)
    changed = [f"{k}: {old.get(k)!r} then, {now.get(k)!r} now" for k in sorted(set(old) | set(now))
               if old.get(k) != now.get(k)]
    if changed:
        raise ConfigError(f"resume: {path} was scored with other settings ({'; '.join(changed)}): give them as then, "
                          f"or drop --resume to score every row again")
    return serve, {i: by_print[fp] for i, t in enumerate(targets) if (fp := fingerprint(t)) in by_print}


def remove(out: Path) -> None:
    """The partial report of `out`, once the whole report is written."""
    partial_path(out).unlink(missing_ok=True)
