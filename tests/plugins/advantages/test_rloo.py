import pytest

from grpo_core import make_plugin
from grpo_core.plugins_manager import build_manager


def advantages(rewards):
    return build_manager([make_plugin("rloo")]).hook.advantage(rewards_G=rewards, samples=[])


def test_leave_one_out_baseline():
    # 1 − mean(0, 0, 1) = 2/3 ; 0 − mean(1, 0, 1) = −2/3
    assert advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # 3 − mean(1, 2) = 1.5 ; 1 − mean(3, 2) = −1.5 ; 2 − mean(3, 1) = 0
    assert advantages([3.0, 1.0, 2.0]) == pytest.approx([1.5, -1.5, 0.0])
    assert advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0])


def test_equals_scaled_dr_grpo():
    rewards = [0.3, 1.7, -2.0, 0.0, 5.5]
    g = len(rewards)
    mean = sum(rewards) / g
    assert advantages(rewards) == pytest.approx([g / (g - 1) * (r - mean) for r in rewards])


def test_group_of_one_and_no_signal():
    assert advantages([3.0]) == [0.0]
    assert advantages([]) == []
    assert advantages([1.0, 1.0, 1.0]) == pytest.approx([0.0, 0.0, 0.0])
