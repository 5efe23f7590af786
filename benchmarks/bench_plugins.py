"""grpo-core plugins used by the benchmark: the shared reward and a step timer.

``run_grpo_core.py`` registers them as the entry points ``reward.bench_chars`` and
``logger.bench_timer`` of a throwaway distribution (a dist-info folder put on ``sys.path``):
exactly how a pip-installed third-party plugin is found.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
from bench_common import current_rss_mb, peak_rss_mb, reward_of_text

from grpo_core import hookimpl

RUN: dict[str, float] = {}
"""``rss_start_mb``: resident memory when the run starts (model, sampler and data loaded)."""
STEPS: list[dict[str, Any]] = []
"""One entry per finished step: the wall clock when on_step ran, and the step's metrics."""
ON_STEP: list = []
"""Callables ``f(step)`` run after a step is recorded (profile_step.py starts its profiler here)."""
_lengths: list[int] = []


@attrs.define
class CharReward:
    """The benchmark's reward (a hash of the completion's characters in [0, 1])."""

    @hookimpl
    def reward(self, prompt: Any, samples: Any) -> list[float]:
        _lengths.extend(s.num_completion_tokens for s in samples)
        return [reward_of_text(s.text) for s in samples]


@attrs.define
class StepTimer:
    """Record the wall clock at the end of every step, with the step's metrics."""

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Any, total_steps: Any) -> None:
        RUN["rss_start_mb"] = current_rss_mb()

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        t = time.perf_counter()
        record = {"t": t, "cpu": time.process_time(), "peak_rss_mb": peak_rss_mb(), "step": step}
        STEPS.append({**record, "completion_lengths": list(_lengths), **metrics})
        _lengths.clear()
        for callback in ON_STEP:
            callback(step)
