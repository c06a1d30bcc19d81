"""`tidal.api.callbacks`: TRL users' transformers `TrainerCallback`s get a run's events from its metrics.jsonl
(real files, appended by another thread as a run does), with TRL 1.16's metric names, transformers' own
`TrainerState` / `TrainerControl`, and a clean stop on `should_training_stop`. The end-to-end path (a real run)
is tests/e2e/test_trl_script_run.py."""

from __future__ import annotations

import json
import threading
import time

from transformers import TrainerCallback

from tidal.api.callbacks import RunCallbacks, trl_logs


class Recorder(TrainerCallback):
    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict[str, float]] = []
        self.stop_at = stop_at

    def on_init_end(self, args, state, control, **kw):
        self.events.append(("init_end", state.global_step))

    def on_train_begin(self, args, state, control, **kw):
        self.events.append(("train_begin", state.global_step))

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step_end", state.global_step))
        if state.global_step == self.stop_at:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append(("log", state.global_step))
        self.logs.append(dict(logs))

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, **kw):
        self.events.append(("train_end", state.global_step))


def row(step: int) -> dict:
    return {"step": step, "reward/mean": 0.5 + step, "reward/std": 0.1, "reward/acc/mean": 1.0 * step,
            "reward/acc/std": 0.0, "lr": 1e-6, "loss": -0.1 * step, "grad_norm": 0.3, "completions/mean_length": 9.0,
            "progress/total_tokens": 100 * step, "masked": 0.0, "note": "text"}


def test_trl_names():
    logs = trl_logs(row(2))
    assert logs["reward"] == 2.5 and logs["reward_std"] == 0.1 and logs["learning_rate"] == 1e-6
    assert logs["rewards/acc/mean"] == 2.0 and logs["rewards/acc/std"] == 0.0 and logs["num_tokens"] == 200
    assert logs["loss"] == -0.2 and logs["completions/mean_length"] == 9.0 and logs["masked"] == 0.0
    assert "step" not in logs and "note" not in logs and "reward/mean" not in logs


def test_events_follow_a_run_and_a_callback_stops_it(tmp_path):
    metrics, saved_steps = tmp_path / "metrics.jsonl", {2, 3}  # 3: complete, not yet logged
    first, second = Recorder(), Recorder(stop_at=2)
    cbs = RunCallbacks([first, second], args=object(), processing_class=None, max_steps=3)
    cbs.begin(metrics, lambda: sorted(saved_steps))

    def run() -> None:  # the run appends a row per step, a half-written line first
        for n in (1, 2):
            with open(metrics, "a") as f:
                text = json.dumps(row(n)) + "\n"
                f.write(text[:10])
                f.flush()
                time.sleep(0.3)
                f.write(text[10:])
            time.sleep(0.7)
            if n == 2:
                assert cbs.stop.wait(5), "stop asked at step 2"

    t = threading.Thread(target=run)
    t.start()
    t.join(20)
    cbs.end(metrics, lambda: sorted(saved_steps))
    expected = [("init_end", 0), ("train_begin", 0), ("step_end", 1), ("log", 1), ("step_end", 2), ("log", 2),
                ("save", 2), ("train_end", 2)]
    assert first.events == second.events == expected
    assert [lg["reward"] for lg in first.logs] == [1.5, 2.5]
    assert cbs.state.max_steps == 3 and [h["step"] for h in cbs.state.log_history] == [1, 2]
    assert cbs.control.should_training_stop and cbs.stop.is_set()
