"""What a training run reports while it runs: one JSON line per optimizer step in RUN/log.jsonl, and a progress bar.

A line of log.jsonl:

    {"step": 3, "reward": 0.41, "reward_std": 0.32, "rewards": {"reasoning_gym_reward": 0.38, "format_reward": 0.6},
     "frac_reward_zero_std": 0.25, "loss": 0.01, "kl": 0.0004, "completion_length": 41.2, "step_seconds": 21.7,
     "trainer_step_seconds": 19.9, "recorded": true, "record_seconds": 0.31, "verifier_failures": {},
     "rss_mb": 1830.2, "peak_rss_mb": 2101.5, "learning_rate": 1e-05, "grad_norm": 0.8}

`step_seconds` is wall time from the previous step's log to this one (generation, update, recording, checkpoint
saving and logging included); `trainer_step_seconds` is TRL's own measure (generation and backward passes only).
`on_step_end` fires once per optimizer step before that step's `on_log`, so lines are keyed by `state.global_step`
in `on_log`. A resumed run drops the lines of steps after the checkpoint it resumes from, then appends.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from transformers import TrainerCallback

from relex.util import read_log
from relex.verifiers.failures import count_failures

LOG = logging.getLogger(__name__)

# TRL's log keys -> log.jsonl keys
TRL_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "loss": "loss",
    "kl": "kl",
    "entropy": "entropy",
    "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "clipped_ratio",
    "step_time": "trainer_step_seconds",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
}


def peak_rss_mb() -> float:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


REWARD_SLOPE_WINDOW = 4  # GRPO steps over which log.jsonl's `reward_slope` is taken


def reward_slope(rewards, window: int = REWARD_SLOPE_WINDOW) -> float | None:
    """The least-squares slope per step of the last `window` rewards (None until there are `window` of them: a
    slope over fewer steps is noise): at or below zero, the reward has stopped rising, which is where extrapolation
    stops paying (relex.accelerate.warning)."""
    import numpy as np

    values = [r for r in list(rewards)[-window:] if r is not None]
    if len(values) < max(2, window):
        return None
    return float(np.polyfit(np.arange(len(values), dtype=np.float64), np.asarray(values, dtype=np.float64), 1)[0])


class StepLogger(TrainerCallback):
    """Writes RUN/log.jsonl and shows a progress bar with the step, the reward and the time left."""

    def __init__(self, path: str | Path, recorder=None, show_progress: bool = True):
        self.path = Path(path)
        self.recorder = recorder
        self.show_progress = show_progress
        self.lines: list[dict] = []
        self._bar = None
        self._last = None
        self._failures = None  # count_failures() held open while training
        self._counted = None  # its counts: the failures since the last line

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        kept = [line for line in read_log(self.path) if line["step"] <= state.global_step]
        self.path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        self.lines = kept
        self.close()  # a second train() call on the same logger starts counting afresh
        self._failures = ExitStack()
        self._counted = self._failures.enter_context(count_failures())
        self._last = time.perf_counter()
        if self.show_progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step", dynamic_ncols=True,
                             disable=None)  # drawn only on a terminal

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return  # the end-of-training summary, or an evaluation
        now = time.perf_counter()
        line = {"step": state.global_step}
        line.update({ours: logs[theirs] for theirs, ours in TRL_KEYS.items() if theirs in logs})
        line["rewards"] = {k.split("/")[1]: v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean")}
        line["step_seconds"] = now - self._last
        line["reward_slope"] = reward_slope([*(entry.get("reward") for entry in self.lines), line.get("reward")])
        line.update(self._recording(state.global_step))
        line["verifier_failures"] = self._new_failures()
        line["rss_mb"] = rss_mb()
        line["peak_rss_mb"] = peak_rss_mb()
        self._last = now
        self.lines.append(line)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(line) + "\n")
        if self._bar is not None:
            self._bar.update(state.global_step - self._bar.n)
            self._bar.set_postfix(reward=f"{line['reward']:.3f}" if line["reward"] is not None else "n/a", refresh=False)

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of work done between two steps (a jump decision) out of the next step's step_seconds."""
        if self._last is not None:
            self._last += seconds

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Close the progress bar (also when training stopped with an error)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._failures is not None:
            self._failures.close()
            self._failures = None

    def _recording(self, step: int) -> dict:
        timings = self.recorder.timings if self.recorder is not None else []
        if timings and timings[-1].step == step:
            return {"recorded": True, "record_seconds": timings[-1].seconds}
        return {"recorded": False, "record_seconds": 0.0}

    def _new_failures(self) -> dict[str, int]:
        if self._failures is None:
            return {}
        new = dict(self._counted)
        self._counted.clear()
        return new
