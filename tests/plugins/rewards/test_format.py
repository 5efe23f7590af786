from __future__ import annotations

import pytest

from grpo_core import PluginError, Prompt, Sample, make_plugin


def samples(*texts):
    prompt = Prompt(id="p", text="q", answer="1")
    return [
        Sample(prompt=prompt, tokens=[1], sampling_logprobs=[0.0], loss_mask=[1.0], text=t, finish_reason="stop", policy_version=0)
        for t in texts
    ]


def test_default_pattern_wants_a_final_gsm8k_line():
    reward = make_plugin("format")
    texts = ["3 + 4 = 7\n#### 7", "#### -1,200.5", "The answer is 7", "#### seven", "7 #### 7"]
    assert reward.reward(prompt=None, samples=samples(*texts)) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_custom_pattern_and_bad_pattern():
    reward = make_plugin("format", pattern=r"<answer>.*</answer>")
    assert reward.reward(prompt=None, samples=samples("<answer>3</answer>", "3")) == [1.0, 0.0]
    with pytest.raises(PluginError, match="is not a regular expression"):
        make_plugin("format", pattern="(")


def test_format_needs_no_reference_answer():
    reward = make_plugin("format")
    assert reward.needs_answer is False
    assert "needs_answer" in type(reward).__doc__
    no_answer = Sample(
        prompt=None, tokens=[1], sampling_logprobs=[0.0], loss_mask=[1.0], text="#### 7", finish_reason="stop", policy_version=0
    )
    assert reward.reward(prompt=None, samples=[no_answer]) == [1.0]
