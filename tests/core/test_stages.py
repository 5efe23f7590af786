from __future__ import annotations

import math

import attrs
import pytest

from grpo_core import Prompt, Sample, hookimpl
from grpo_core.plugins.advantages.grpo import GRPOAdvantage
from grpo_core.plugins_manager import build_manager
from grpo_core.selection import WeightedReward
from grpo_core.stages import RewardError, compute_advantages, score_groups
from grpo_core.types import RewardFailures
from tests.core.table_rewards import TableReward, group, selection_of


def test_weighted_sum_and_per_reward_metrics():
    sel = selection_of(
        WeightedReward("a", 1.0, TableReward({"x": 1.0, "y": 0.0})),
        WeightedReward("b", 0.5, TableReward({"x": 0.0, "y": 1.0})),
    )
    groups = [group(["x", "y", "x", "y"])]
    metrics = score_groups(sel, groups, max_failures_in_a_row=10)
    assert [s.reward for s in groups[0]] == [1.0, 0.5, 1.0, 0.5]
    assert groups[0][1].rewards == {"a": 0.0, "b": 1.0}
    assert metrics["reward/total"] == 0.75 and metrics["reward/a"] == 0.5 and metrics["reward/b"] == 0.5
    assert metrics["reward/std"] == pytest.approx(0.25)
    assert metrics["tokens/completion"] == 8.0 and metrics["reward/failed"] == 0.0


def test_none_nan_and_exceptions_fail_samples_and_groups_keep_the_scored():
    sel = selection_of(WeightedReward("a", 1.0, TableReward({"x": 1.0, "y": 0.0, "nan": math.nan})))
    groups = [group(["x", "y", "none", "nan"], "g1"), group(["boom", "x"], "g2")]
    failures = RewardFailures()
    metrics = score_groups(sel, groups, max_failures_in_a_row=10, failures=failures)
    assert metrics["reward/failed"] == 4.0 and metrics["reward/errors"] == 1.0
    assert failures.last_error == "reward 'a' raised RuntimeError: scorer crashed"
    kept, adv_metrics = compute_advantages(build_manager([GRPOAdvantage()]), groups, drop_zero_variance=True)
    assert [[s.text for s in g] for g in kept] == [["x", "y"]]
    assert adv_metrics == {"groups/kept": 1.0, "groups/dropped_zero_variance": 0.0, "groups/dropped_failed": 1.0, "groups/skipped": 0.0}
    assert kept[0][0].advantages == [pytest.approx(0.5 / math.sqrt(0.5))] * 3


def test_an_unscored_sample_cut_at_its_token_budget_is_said_to_be_cut_not_a_broken_reward():
    from types import SimpleNamespace

    from grpo_core.outcome import nothing_trained
    from grpo_core.types import RunState

    sel = selection_of(WeightedReward("env", 1.0, TableReward({"x": 1.0})))
    cut = group(["none", "none"], "g1")
    for sample in cut:
        sample.finish_reason = "length"  # a conversation the budget ended before its environment scored it
    failures = RewardFailures()
    score_groups(sel, [cut], max_failures_in_a_row=10, failures=failures)
    assert (failures.last_error, failures.last_was_cut) == ("reward 'env' gave no score to a completion cut at its token budget", True)
    state = RunState(run_dir=".", step=1, groups_dropped={"failed": 1.0}, reward_failures=failures)
    assert nothing_trained(SimpleNamespace(state=state, config=SimpleNamespace(max_completion_tokens=64))) == (
        "nothing was trained: every group was dropped, 1 of them because their reward failed (last: reward 'env' gave no score "
        "to a completion cut at its token budget); raise --max-completion-tokens (64: the budget they ran out of) or allow fewer turns"
    )
    # A None of a sample that ended on its own is the reward's: the advice is to fix it.
    score_groups(sel, [group(["none"], "g2")], max_failures_in_a_row=10, failures=failures)
    assert not failures.last_was_cut and nothing_trained(SimpleNamespace(state=state)).endswith("fix the reward and start again")


def test_run_stops_after_too_many_failures_in_a_row():
    sel = selection_of(WeightedReward("a", 1.0, TableReward({"x": 1.0})))
    with pytest.raises(RewardError, match="rewards failed on 3 samples in a row; last: reward 'a' raised RuntimeError"):
        score_groups(sel, [group(["x", "boom", "boom"]), group(["boom", "x"])], max_failures_in_a_row=3)
    # A success resets the count.
    sel = selection_of(WeightedReward("a", 1.0, TableReward({"x": 1.0})))
    score_groups(sel, [group(["y", "y", "x", "y", "y"])], max_failures_in_a_row=3)


def test_zero_variance_groups_are_dropped_or_kept_with_zero_advantage():
    groups = [group(["x", "x"]), group(["x", "y"])]
    for g, rewards in zip(groups, ([1.0, 1.0], [1.0, 0.0])):
        for s, r in zip(g, rewards):
            s.reward = r
    pm = build_manager([GRPOAdvantage()])
    kept, metrics = compute_advantages(pm, groups, drop_zero_variance=True)
    assert len(kept) == 1 and metrics["groups/dropped_zero_variance"] == 1.0
    kept, metrics = compute_advantages(pm, groups, drop_zero_variance=False)
    assert len(kept) == 2 and kept[0][0].advantages == [0.0, 0.0, 0.0]


def test_advantage_with_wrong_length_is_an_error():
    @attrs.define
    class Bad:
        @hookimpl
        def advantage(self, rewards_G, samples):
            return [[1.0]] * len(samples)

    g = group(["x", "y"])
    g[0].reward, g[1].reward = 1.0, 0.0
    with pytest.raises(ValueError, match="advantage returned 1 values for a sample of 3 tokens"):
        compute_advantages(build_manager([Bad()]), [g], drop_zero_variance=True)


def test_turn_contexts_are_the_prompt_then_each_turns_context_but_the_last():
    from grpo_core.plugins.advantages.igpo import turn_contexts
    from grpo_core.types import Turn

    prompt = Prompt(id="p", text="q", answer="1")
    sample = Sample(
        prompt=prompt,
        tokens=list(range(20)),
        sampling_logprobs=[0.0] * 20,
        loss_mask=[0.0] * 20,
        text="",
        finish_reason="stop",
        policy_version=0,
    )
    assert turn_contexts(sample) == []
    sample.turns = [Turn(3, 6, 9)]
    assert turn_contexts(sample) == []  # a single turn: nothing to score
    sample.turns = [Turn(3, 6, 9), Turn(9, 12, 15), Turn(15, 20, 20)]
    assert turn_contexts(sample) == [3, 9, 15]


def test_a_group_is_dropped_when_every_advantage_is_zero():
    """Not only equal rewards: rewards a hair apart give GRPO's all-zero advantages too."""
    g = group(["x", "y"])
    g[0].reward, g[1].reward = 1.0, 1.0 + 1e-12
    kept, metrics = compute_advantages(build_manager([GRPOAdvantage()]), [g], drop_zero_variance=True)
    assert kept == [] and metrics["groups/dropped_zero_variance"] == 1.0


def perf_of(step: dict, trainer) -> dict:
    from grpo_core.metrics import Metrics
    from grpo_core.stages import record_perf

    metrics = Metrics()
    metrics.update(step, "sum")
    record_perf(metrics, trainer)
    return {k: v for k, v in metrics.as_dict().items() if k.startswith("perf/")}


STEP = {"tokens/completion": 400.0, "time/sample": 2.0, "train/forward_tokens": 1000.0, "time/train": 0.5}


def test_perf_metrics_are_rates_of_the_steps_tokens_and_the_trainers_counters():
    from types import SimpleNamespace

    counters = {"parameters": 1e6, "peak_flops": 1e11, "peak_memory_gib": 1.5}
    assert perf_of(STEP, SimpleNamespace(perf_counters=lambda: counters)) == {
        "perf/sample_tokens_per_s": 200.0,
        "perf/train_tokens_per_s": 2000.0,
        "perf/mfu": pytest.approx(6 * 1e6 * 1000 / 0.5 / 1e11),
        "perf/peak_memory_gib": 1.5,
    }
    # A trainer that counts the tokens it ran (a group's shared prompt once): the rates are of those.
    ran = {**counters, "forward_tokens": 250.0}
    assert perf_of(STEP, SimpleNamespace(perf_counters=lambda: ran)) == {
        "perf/sample_tokens_per_s": 200.0,
        "perf/train_tokens_per_s": 500.0,
        "perf/mfu": pytest.approx(6 * 1e6 * 250 / 0.5 / 1e11),
        "perf/peak_memory_gib": 1.5,
    }
    # A trainer without counters (tinker, a server's): the rates only, which any trainer has.
    assert perf_of(STEP, SimpleNamespace()) == {"perf/sample_tokens_per_s": 200.0, "perf/train_tokens_per_s": 2000.0}
    # Counters it lacks are left out, not made up.
    assert perf_of(STEP, SimpleNamespace(perf_counters=lambda: {"peak_memory_gib": 2.0}))["perf/peak_memory_gib"] == 2.0
    assert "perf/mfu" not in perf_of(STEP, SimpleNamespace(perf_counters=lambda: {"parameters": 1e6}))


def test_a_step_that_trained_or_sampled_nothing_has_no_rate_of_it():
    from types import SimpleNamespace

    counters = SimpleNamespace(perf_counters=lambda: {"parameters": 1e6, "peak_flops": 1e11})
    assert perf_of({**STEP, "train/forward_tokens": 0.0}, counters) == {"perf/sample_tokens_per_s": 200.0}
    assert perf_of({"tokens/completion": 0.0, "time/sample": 0.0}, counters) == {}


def test_perf_counters_of_another_type_are_refused_naming_the_trainer():
    from types import SimpleNamespace

    from grpo_core.errors import PluginError

    with pytest.raises(PluginError, match=r"SimpleNamespace.perf_counters must be callable \| None"):
        perf_of(STEP, SimpleNamespace(perf_counters={"parameters": 1.0}))
