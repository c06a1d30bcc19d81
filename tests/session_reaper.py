"""A pytest plugin: nothing the test session started outlives pytest, however pytest ends.

The session's shared vLLM servers (`tests/conftest.py`) and the runs tests start lead their own sessions and are
stopped by fixture teardown. A pytest killed outright (SIGKILL, the OOM killer, a CI timeout) runs no teardown, and
they ran on for an hour once. At session start this starts `tidal.procs.reaper` on pytest itself, the product's
own rule for its launchers: when pytest exits, any exit, its remembered descendants get SIGTERM, then SIGKILL.
After a clean session nothing is left and the reaper just exits. Loaded by `tests/conftest.py`; usable alone as
`pytest -p tests.session_reaper`.
"""

from __future__ import annotations

import pytest

from tidal.procs.reaper import start_reaper


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the reaper on this pytest process (a no-op where the platform has no pidfd or /proc)."""
    session.config.stash[REAPER] = start_reaper()


REAPER = pytest.StashKey[object]()
"""Where the reaper's Popen is kept (only so that it is not garbage-collected with a ResourceWarning)."""
