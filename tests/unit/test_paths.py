"""The run directory's one durability rule (`tidal.paths`): atomic files and directories, STABLE last, temps of
dead writers swept, failed writes leave what was there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tidal.paths import STABLE, atomic_dir, atomic_file, stable_steps, step_files, sweep_temps, write_atomic
from tidal.transport import weights


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    write_atomic(path, "one")
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "one"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt"], "the temp file is gone"
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two"


def test_atomic_dir_marks_stable_last_and_a_failure_keeps_the_old_directory(tmp_path):
    final = tmp_path / "step_1"
    with atomic_dir(final, marker="1") as tmp:
        (tmp / "a").write_text("old")
        assert not final.exists(), "nothing is visible before the directory is complete"
    assert (final / STABLE).read_text() == "1" and (final / "a").read_text() == "old"
    with pytest.raises(OSError), atomic_dir(final, marker="1") as tmp:
        (tmp / "a").write_text("new")
        raise OSError(28, "No space left on device")
    assert (final / "a").read_text() == "old" and (final / STABLE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]
    with atomic_dir(final, marker="1") as tmp:
        (tmp / "b").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == [STABLE, "b"], "a rewrite replaces the whole directory"


def test_keep_complete_leaves_an_entry_another_writer_completed_and_replaces_an_incomplete_one(tmp_path):
    final = tmp_path / "entry"
    with atomic_dir(final, keep_complete=True) as tmp:
        (tmp / "w").write_text("mine")
        with atomic_dir(final, keep_complete=True) as other:  # a second writer finishes first
            (other / "w").write_text("theirs")
    assert (final / "w").read_text() == "theirs" and (final / STABLE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["entry"], "the late writer's temp is gone"
    (final / STABLE).unlink()  # a leftover without its marker is replaced, as without keep_complete
    with atomic_dir(final, keep_complete=True) as tmp:
        (tmp / "w").write_text("new")
    assert (final / "w").read_text() == "new" and (final / STABLE).is_file()
    with atomic_dir(final) as tmp:  # without it, a complete entry is replaced
        (tmp / "w").write_text("newer")
    assert (final / "w").read_text() == "newer"


def test_temps_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".step_3.tmp.{dead_pid}").mkdir()
    (tmp_path / f".x.safetensors.tmp.{dead_pid}").write_text("torn")
    live = tmp_path / f".step_4.tmp.{os.getppid()}"  # a running process (pytest's parent)
    live.mkdir()
    sweep_temps(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [live.name]


def test_only_stable_directories_count(tmp_path):
    root = tmp_path / "broadcasts"
    for s in (1, 2, 10):
        with atomic_dir(root / f"step_{s}", marker=str(s)):
            pass
    (root / "step_5").mkdir()  # no STABLE: a writer died before finishing
    (root / "step_x").mkdir()
    assert step_files(root) == [1, 2, 5, 10]
    assert stable_steps(root) == [1, 2, 10] == weights.stable_steps(tmp_path)
    assert weights.newest_policy(tmp_path) == 10 and weights.policy_stamp(tmp_path, 10) > 0
    assert weights.policy_stamp(tmp_path, 5) == 0
    weights.prune(tmp_path, keep=2)
    assert weights.stable_steps(tmp_path) == [2, 10]
    assert weights.drop_after(tmp_path, 2) == [10] and weights.stable_steps(tmp_path) == [2]


def test_push_requests_round_trip(tmp_path):
    assert weights.push_requested(tmp_path) is None
    weights.request_push(tmp_path, 7, "behind: {'http://a': 0}")
    assert weights.push_requested(tmp_path) == 7
    weights.clear_push_request(tmp_path)
    assert weights.push_requested(tmp_path) is None
