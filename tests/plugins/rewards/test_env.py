from __future__ import annotations

from grpo_core import Prompt, Sample, make_plugin


def sample(env_reward):
    return Sample(Prompt(id="p", text="q"), [1, 2], [0.0, -0.5], [0.0, 1.0], "a", "stop", 0, env_reward=env_reward)


def test_the_env_reward_is_what_the_environment_gave():
    reward = make_plugin("reward.env")
    assert reward.reward(prompt=Prompt(id="p", text="q"), samples=[sample(0.25), sample(0.0), sample(None)]) == [0.25, 0.0, None]
    assert reward.needs_env is True
