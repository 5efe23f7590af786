import pytest
from grpo_plugins_example.brevity import BrevityReward

from grpo_core import PluginError, Prompt, Sample, make_plugin


def sample(prompt_tokens: int, completion_tokens: int) -> Sample:
    n = prompt_tokens + completion_tokens
    return Sample(
        prompt=Prompt(id="p0", text="What is 2 plus 3?"),
        tokens=list(range(n)),
        sampling_logprobs=[0.0] * prompt_tokens + [-1.0] * completion_tokens,
        loss_mask=[0.0] * prompt_tokens + [1.0] * completion_tokens,
        text="x" * completion_tokens,
        finish_reason="stop",
        policy_version=0,
    )


def test_scores_fall_linearly_with_completion_tokens_and_floor_at_zero():
    reward = make_plugin("brevity", limit=4)
    scores = reward.reward(prompt=Prompt(id="p0", text="q"), samples=[sample(3, k) for k in (0, 1, 2, 4, 9)])
    assert scores == [1.0, 0.75, 0.5, 0.0, 0.0]


def test_prompt_tokens_do_not_count():
    reward = make_plugin("brevity", limit=10)
    assert reward.reward(prompt=Prompt(id="p0", text="q"), samples=[sample(0, 5), sample(50, 5)]) == [0.5, 0.5]


def test_default_limit_is_256_tokens():
    reward = make_plugin("reward.brevity")
    assert reward.limit == 256
    assert reward.reward(prompt=Prompt(id="p0", text="q"), samples=[sample(2, 64)]) == [0.75]


def test_needs_no_reference_answer():
    assert BrevityReward.needs_answer is False
    assert make_plugin("brevity").reward(prompt=Prompt(id="p0", text="q", answer=None), samples=[sample(1, 0)]) == [1.0]


@pytest.mark.parametrize("limit", [0, -5])
def test_a_limit_that_is_not_positive_is_refused(limit):
    with pytest.raises(PluginError, match="limit must be > 0"):
        make_plugin("brevity", limit=limit)
