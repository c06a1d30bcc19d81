"""The live board: what a terminal user sees while `tidal grpo` runs (rendered to text with rich)."""

from __future__ import annotations

from rich.console import Console

from tidal.monitor.metrics import progress_line
from tidal.monitor.progress import Board, format_eta


def render_text(board: Board) -> str:
    console = Console(record=True, width=140, color_system=None)
    console.print(board.render())
    return console.export_text()


def test_board_shows_progress_metrics_time_left_and_waiting_states():
    board = Board(max_steps=20)
    board.note_line("train", "01:02:03 [train] waiting for batch 4 from the orchestrator for 40 s\n")
    board.note_line("orch", "01:02:03 [orch] batch 4 written: reward 0.512, policy 2, 800 tokens in 3.1 s\n")
    for step in (1, 2, 3):
        board.note_metrics({"step": step, "reward/mean": 0.5, "reward/std": 0.25, "kl": 0.002, "masked": 0.031,
                            "mismatch_kl": 1e-4, "rollout_tokens_per_s": 812.0, "trainer_tokens_per_s": 2400.0,
                            "step_time_s": 4.0})
    text = render_text(board)
    assert "step 3/20" in text and "time left 1m08s" in text  # 17 steps x 4 s
    assert "reward 0.500 ± 0.250" in text and "kl 2.00e-03" in text and "masked 3.1%" in text
    assert "rollout 812 tok/s" in text and "trainer 2400 tok/s" in text
    assert "waiting for batch 4 from the orchestrator for 40 s" in text
    assert "batch 4 written; sampling the next one" in text
    board.note_line("train", "01:05:00 [train] trainer finished after 20 steps; metrics in x\n")
    assert "finished" in render_text(board)


def test_eta_formatting_and_plain_progress_line():
    assert (format_eta(None), format_eta(42), format_eta(125), format_eta(7322)) == ("?", "42s", "2m05s", "2h02m")
    line = progress_line({"step": 3, "reward/mean": 0.5, "reward/std": 0.1, "kl": 0.01}, 10, eta_s=70)
    assert line.startswith("step 3/10 | reward 0.500") and "kl 1.00e-02" in line and line.endswith("time left 70 s")
