import pytest

from grpo_core import make_plugin
from grpo_core.plugins_manager import build_manager


def advantages(rewards):
    return build_manager([make_plugin("dr_grpo")]).hook.advantage(rewards_G=rewards, samples=[])


def test_mean_centered_without_std():
    assert advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert advantages([3.0, 1.0, 2.0]) == pytest.approx([1.0, -1.0, 0.0])
    assert advantages([10.0, 0.0]) == pytest.approx([5.0, -5.0])  # not divided by the std


def test_no_signal_and_edge_groups():
    assert advantages([0.7, 0.7, 0.7]) == pytest.approx([0.0, 0.0, 0.0])
    assert advantages([4.0]) == [0.0]
    assert advantages([]) == []
