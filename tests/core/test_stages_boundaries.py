"""Scoring and advantages at the boundaries their code draws (survivors of scripts/mutate.py)."""

from __future__ import annotations

import threading

import attrs

from grpo_core import hookimpl
from grpo_core.plugins.advantages.grpo import GRPOAdvantage
from grpo_core.plugins_manager import build_manager
from grpo_core.selection import WeightedReward
from grpo_core.stages import compute_advantages, score_groups, turn_contexts
from grpo_core.types import Turn
from tests.core.test_stages import group, selection_of


@attrs.define
class ThreadRecordingReward:
    threads: list = attrs.field(factory=list)

    @hookimpl
    def reward(self, prompt, samples):
        self.threads.append(threading.current_thread())
        return [1.0 for _ in samples]


def test_without_a_timeout_rewards_run_in_the_callers_thread():
    # timeout defaults to 0 = no limit: no worker thread, so a reward may use thread-bound state.
    reward = ThreadRecordingReward()
    score_groups(selection_of(WeightedReward("r", 1.0, reward)), [group(["x", "y"])], max_failures_in_a_row=10)
    assert reward.threads == [threading.current_thread()]


def test_truncated_frac_counts_the_samples_that_hit_max_tokens():
    samples = group(["x", "y", "x", "y"])
    samples[2].finish_reason = "length"
    reward = ThreadRecordingReward()
    metrics = score_groups(selection_of(WeightedReward("r", 1.0, reward)), [samples], max_failures_in_a_row=10)
    assert metrics["completion/truncated_frac"] == 0.25


def test_an_empty_group_is_counted_as_skipped_not_failed():
    scored = group(["x", "y"])
    scored[0].reward, scored[1].reward = 1.0, 0.0
    kept, metrics = compute_advantages(build_manager([GRPOAdvantage()]), [[], scored, []], drop_zero_variance=True)
    assert len(kept) == 1
    assert metrics["groups/skipped"] == 2.0 and metrics["groups/dropped_failed"] == 0.0 and metrics["groups/kept"] == 1.0


def test_two_turns_have_two_contexts_to_score():
    sample = group(["x"])[0]
    sample.tokens = list(range(12))
    sample.turns = [Turn(3, 6, 9), Turn(9, 12, 12)]
    assert turn_contexts(sample) == [3, 9]
