"""Advantages at the boundaries their code draws: groups of one and two, a std at the no-signal threshold."""

import math

import pytest
import torch

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


def turns_sample(turn_count, answer="xy"):
    """12 tokens 0..11 with turns of 2 tokens each at 2, 5, 8 (context ends 5, 8, 11)."""
    from grpo_core import Prompt, Sample
    from grpo_core.types import Turn

    turns = [Turn(2 + 3 * k, 4 + 3 * k, 5 + 3 * k) for k in range(turn_count)]
    return Sample(prompt=Prompt(id="p", text="q", answer=answer), tokens=list(range(12)), sampling_logprobs=[0.0] * 12,
                  loss_mask=[0.0] * 12, text="", finish_reason="stop", policy_version=0, turns=turns)  # fmt: skip


class ScriptedPolicy:
    """Encodes a character as its code point (after a BOS of 1000 with special tokens); datum k's
    logprobs are 100 but for its last two, −k−1 and −k−3."""

    class tokenizer:
        @staticmethod
        def encode(text, add_special_tokens=True):
            return [1000] * add_special_tokens + [ord(c) for c in text]

    def __init__(self):
        self.datums = []

    def forward(self, datums):
        self.datums += datums
        out = []
        for k, datum in enumerate(datums):
            n = len(datum.loss_fn_inputs["target_tokens"].data)
            out.append(torch.tensor([100.0] * (n - 2) + [-k - 1.0, -k - 3.0]))
        return out


def test_igpo_turn_contexts_start_at_the_prompt_and_skip_the_last_turn():
    from grpo_core.plugins.advantages.igpo import turn_contexts

    assert turn_contexts(turns_sample(3)) == [2, 5, 8]
    assert turn_contexts(turns_sample(2)) == [2, 5]
    assert turn_contexts(turns_sample(1)) == []
    assert turn_contexts(turns_sample(0)) == []


def test_igpo_score_turns_averages_exactly_the_answer_tokens_after_context_and_lead():
    from grpo_core.plugins.advantages.igpo import score_turns

    policy = ScriptedPolicy()
    groups = [[turns_sample(3), turns_sample(2), turns_sample(1)], [turns_sample(1)], []]
    scores, metrics = score_turns(policy, groups, "A{answer}.")
    # Datum k scores (−k−1 − k−3)/2 = −k−2; sample 0 owns datums 0..2, sample 1 datums 3..4.
    assert scores == [[[-2.0, -3.0, -4.0], [-5.0, -6.0], []], [[]], []]
    assert metrics == {"igpo/scored_sequences": 5.0, "igpo/first_scores": 2.0, "igpo/answer_logprob_t0": -3.5}
    lead, answer = [ord("A")], [ord("x"), ord("y")]
    for datum, end in zip(policy.datums, [2, 5, 8, 2, 5]):
        ids = list(range(end)) + lead + answer
        assert datum.model_input.to_ints() == ids[:-1]
        assert datum.loss_fn_inputs["target_tokens"].data == ids[1:]
        assert datum.loss_fn_inputs["weights"].data == [0.0] * end + [1.0, 1.0]
    # No template lead, and nothing to score: no forward, no first-turn mean.
    policy = ScriptedPolicy()
    scores, metrics = score_turns(policy, [[turns_sample(2)]], "{answer}")
    assert [d.model_input.to_ints() for d in policy.datums] == [[0, 1, ord("x")], [0, 1, 2, 3, 4, ord("x")]]
    assert policy.datums[0].loss_fn_inputs["weights"].data == [0.0, 1.0, 1.0]
    assert scores == [[[-2.0, -3.0]]]
    # The lead is what comes before the first {answer}, however often the template repeats it.
    policy = ScriptedPolicy()
    score_turns(policy, [[turns_sample(2)]], "A{answer}={answer}")
    assert policy.datums[0].model_input.to_ints() == [0, 1, ord("A"), ord("x")]
    assert score_turns(ScriptedPolicy(), [[turns_sample(1)]], "{answer}") == (
        [[[]]],
        {"igpo/scored_sequences": 0.0, "igpo/first_scores": 0.0},
    )
