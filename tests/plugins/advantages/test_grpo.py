import math

import pytest

from grpo_core import PluginError, make_plugin
from grpo_core.plugins_manager import build_manager


def advantages(plugin, rewards):
    return build_manager([plugin]).hook.advantage(rewards_G=rewards, samples=[])


def test_unbiased_std_by_default():
    # mean 0.5; unbiased std = sqrt(4·0.25/3) = 1/sqrt(3)
    a = advantages(make_plugin("advantage.grpo"), [1.0, 0.0, 0.0, 1.0])
    expected = 0.5 / (1 / math.sqrt(3) + 1e-8)
    assert a == pytest.approx([expected, -expected, -expected, expected], abs=1e-12)
    assert expected == pytest.approx(0.8660254, abs=1e-6)


def test_population_std():
    a = advantages(make_plugin("advantage.grpo", std="population"), [1.0, 0.0, 0.0, 1.0])
    assert a == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-7)
    a = advantages(make_plugin("advantage.grpo", std="population"), [3.0, 1.0, 2.0])
    std = math.sqrt(2 / 3)
    assert a == pytest.approx([1 / std, -1 / std, 0.0], abs=1e-7)


@pytest.mark.parametrize("rewards", [[0.5, 0.5, 0.5], [1.0], [2.0, 2.0 + 1e-10]])
def test_no_signal_gives_zeros(rewards):
    for std in ("unbiased", "population"):
        assert advantages(make_plugin("advantage.grpo", std=std), rewards) == [0.0] * len(rewards)


def test_bad_std_option():
    with pytest.raises(PluginError):
        make_plugin("advantage.grpo", std="sample")
