"""Advantages at the boundaries their code draws: groups of one and two, a std at the no-signal threshold."""

import math

import pytest

from grpo_core import make_plugin
from grpo_core.plugins_manager import build_manager


def advantages(name, rewards, **options):
    return build_manager([make_plugin(f"advantage.{name}", **options)]).hook.advantage(rewards_G=rewards, samples=[])


def test_grpo_group_of_two_divides_by_g_minus_one_or_g():
    # mean 0.5; unbiased var = 2·0.25/1 = 0.5, population var = 2·0.25/2 = 0.25
    unbiased = 0.5 / (math.sqrt(0.5) + 1e-8)
    assert advantages("grpo", [0.0, 1.0]) == pytest.approx([-unbiased, unbiased], abs=1e-12)
    population = 0.5 / (0.5 + 1e-8)
    assert advantages("grpo", [0.0, 1.0], std="population") == pytest.approx([-population, population], abs=1e-12)


def test_grpo_a_std_of_exactly_the_threshold_still_counts_as_signal():
    # population std of [0, 2e-8] is exactly 1e-8: only a std *below* 1e-8 means "no signal".
    rewards = [0.0, 2e-8]
    assert math.sqrt(sum((r - 1e-8) ** 2 for r in rewards) / 2) == 1e-8
    assert advantages("grpo", rewards, std="population") == pytest.approx([-0.5, 0.5])


def test_grpo_group_of_one_has_no_signal_with_either_std():
    assert advantages("grpo", [4.0]) == [0.0]
    assert advantages("grpo", [4.0], std="population") == [0.0]


def test_dr_grpo_group_of_one_and_empty_group():
    assert advantages("dr_grpo", [4.0]) == [0.0]
    assert advantages("dr_grpo", []) == []
    assert advantages("dr_grpo", [1.0, 4.0]) == [-1.5, 1.5]


def test_rloo_group_of_two_uses_the_other_sample_as_baseline():
    assert advantages("rloo", [1.0, 4.0]) == [-3.0, 3.0]
    assert advantages("rloo", [4.0]) == [0.0]
