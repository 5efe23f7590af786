"""A reward that hangs fails its samples after --reward-timeout, counted, and never hangs the run."""

from __future__ import annotations

import threading
import time

import attrs
import pytest

from grpo_core import Prompt, Sample
from grpo_core.selection import Selection, WeightedReward
from grpo_core.stages import CallTimeout, RewardError, call_with_timeout, score_groups
from grpo_core.types import RewardFailures


def test_call_with_timeout_returns_raises_and_gives_up():
    assert call_with_timeout(lambda: 7, 1.0) == 7
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["x"], 1.0)
    release = threading.Event()
    started = time.perf_counter()
    with pytest.raises(CallTimeout, match="did not return within 0.2 s"):
        call_with_timeout(release.wait, 0.2)
    assert time.perf_counter() - started < 2.0
    release.set()
    assert call_with_timeout(lambda: 3, 0) == 3  # 0 = no limit, called in this thread


@attrs.define
class HangsOnSecondGroup:
    release: threading.Event
    calls: int = 0

    def reward(self, prompt, samples):
        self.calls += 1
        if self.calls == 2:
            self.release.wait()
        return [1.0 if s.text == "a" else 0.0 for s in samples]


def group(n: int, prompt_id: str) -> list[Sample]:
    prompt = Prompt(id=prompt_id, text="q")
    return [Sample(prompt, [1, 2], [0.0, -0.5], [0.0, 1.0], "a" if i % 2 else "b", "stop", 0) for i in range(n)]


def test_a_hung_reward_fails_its_group_only_and_is_counted_with_its_name():
    release = threading.Event()
    selection = Selection(manager=None, plugins={}, rewards=[WeightedReward("slow", 1.0, HangsOnSecondGroup(release))], loss=None)
    groups = [group(4, "p1"), group(4, "p2"), group(4, "p3")]
    failures = RewardFailures()
    metrics = score_groups(selection, groups, max_failures_in_a_row=100, timeout=0.3, failures=failures)
    release.set()
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/failed"] == 4.0 and metrics["reward/errors"] == 0.0
    assert [s.reward for s in groups[1]] == [None] * 4
    assert [s.reward for s in groups[0]] == [0.0, 1.0, 0.0, 1.0] == [s.reward for s in groups[2]]
    assert failures.last_error == "reward 'slow' did not return within 0.3 s"


def test_timeouts_count_towards_failures_in_a_row():
    release = threading.Event()
    plugin = HangsOnSecondGroup(release)
    plugin.calls = 1  # the next call hangs
    selection = Selection(manager=None, plugins={}, rewards=[WeightedReward("slow", 1.0, plugin)], loss=None)
    with pytest.raises(RewardError, match="rewards failed on 4 samples in a row; last: reward 'slow' did not return within 0.2 s"):
        score_groups(selection, [group(4, "p1")], max_failures_in_a_row=4, timeout=0.2)
    release.set()
