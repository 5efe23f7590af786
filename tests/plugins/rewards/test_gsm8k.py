"""The gsm8k reward: answer extraction, normalization, strict mode, format shaping, the plugin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.plugins.rewards.gsm8k import extract_answer, find_answer, parse_reference, score


def sample(prompt: Prompt, text: str) -> Sample:
    return Sample(
        prompt=prompt,
        tokens=[1, 2],
        sampling_logprobs=[0.0, 0.0],
        loss_mask=[0.0, 1.0],
        text=text,
        finish_reason="stop",
        policy_version=0,
    )


# --------------------------------------------------------------------------------------------
# Answer forms: each right, each with a wrong counterpart
# --------------------------------------------------------------------------------------------

ANSWER_FORMS = [
    "She makes 9 * 2 = 18 dollars.\n#### 18",
    "####18",
    "So the total is 18. The answer is 18.",
    "The final answer is 18",
    "the answer is: 18",
    "Answer: 18",
    "Final Answer: 18",
    "**Answer:** 18",
    "ANSWER:\n\n18",
    "Q: how much?\nA: 18",
    "  A : 18",
    "We get \\boxed{18}.",
    "The final answer is $\\boxed{18}$.",
    "\\fbox{18}",
    "<answer>18</answer>",
    "<think>9 * 2</think>\n<ANSWER> 18 </ANSWER>",
    "<answer>18",  # unclosed tag at the end of a truncated completion
    "9 * 2 = 18",  # last-number fallback
]


@pytest.mark.parametrize("text", ANSWER_FORMS)
def test_answer_forms(text: str) -> None:
    assert extract_answer(text) == "18"
    assert score(text, "#### 18") == 1.0
    assert score(text, "18") == 1.0
    assert score(text, "#### 19") == 0.0
    wrong = text.replace("18", "17")
    assert score(wrong, "#### 18") == 0.0
    assert score(wrong, "17") == 1.0


def test_boxed_with_nested_braces_and_latex() -> None:
    assert extract_answer("\\boxed{\\frac{3}{4}}") == "3/4"
    assert extract_answer("\\boxed{\\dfrac{3}{4}}") == "3/4"
    assert extract_answer("\\boxed{18 \\text{ dollars}}") == "18"
    assert extract_answer("\\boxed{x = 18}") == "18"
    assert extract_answer("\\boxed{1{,}000}") == "1000"
    assert extract_answer("\\boxed{\\$18}") == "18"
    assert extract_answer("\\boxed{50\\%}") == "50"
    assert score("\\boxed{\\frac{3}{4}}", "0.75") == 1.0
    assert score("\\boxed{\\frac{3}{5}}", "0.75") == 0.0


def test_no_answer() -> None:
    assert extract_answer("I do not know.") is None
    assert extract_answer("") is None
    assert score("I do not know.", "18") == 0.0
    assert score("", "0") == 0.0


# --------------------------------------------------------------------------------------------
# Normalization, each with a wrong counterpart
# --------------------------------------------------------------------------------------------

NORMALIZATION = [
    # (completion, reference, normalized answer, a wrong completion)
    ("The answer is 1,000", "1000", "1000", "The answer is 1,001"),
    ("#### 1,450,000", "#### 1,450,000", "1450000", "#### 1,450,001"),
    ("The answer is 1000", "#### 1,000", "1000", "The answer is 100"),
    ("The answer is $18", "18", "18", "The answer is $81"),
    ("The answer is \\$18", "18", "18", "The answer is \\$17"),
    ("The answer is €18.", "18", "18", "The answer is €19."),
    ("The answer is £ 18", "18", "18", "The answer is £ 19"),
    ("The answer is 25%", "25", "25", "The answer is 26%"),
    ("The answer is 18.0", "18", "18", "The answer is 18.5"),
    ("The answer is 18.00", "#### 18", "18", "The answer is 18.01"),
    ("The answer is 18.", "18", "18", "The answer is 19."),
    ("The answer is 18 dollars.", "18", "18", "The answer is 81 dollars."),
    ("Answer: 5 apples", "5", "5", "Answer: 6 apples"),
    ("#### 3 km", "3", "3", "#### 4 km"),
    ("#### -10", "#### -10", "-10", "#### 10"),
    ("The answer is -$5", "-5", "-5", "The answer is $5"),
    ("The answer is $-5", "-5", "-5", "The answer is $-6"),
    ("The answer is −3", "-3", "-3", "The answer is 3"),  # unicode minus
    ("The answer is 3/4", "0.75", "3/4", "The answer is 4/3"),
    ("The answer is 6/8", "3/4", "3/4", "The answer is 6/9"),
    ("The answer is 0.75", "3/4", "0.75", "The answer is 0.7"),
    ("The answer is .5", "1/2", "0.5", "The answer is .6"),
    ("The answer is 1.50", "1.5", "1.5", "The answer is 1.05"),
    ("The answer is 007", "7", "7", "The answer is 0.07"),
    ("The answer is \\frac{1}{2}", "0.5", "1/2", "The answer is \\frac{1}{3}"),
]


@pytest.mark.parametrize(("text", "reference", "normalized", "wrong"), NORMALIZATION)
def test_normalization(text: str, reference: str, normalized: str, wrong: str) -> None:
    assert extract_answer(text) == normalized
    assert score(text, reference) == 1.0
    assert score(wrong, reference) == 0.0


def test_fractions_compare_exactly_not_as_floats() -> None:
    assert score("The answer is 1/3", "0.333333333333333333") == 0.0
    assert score("The answer is 0.1", "1/10") == 1.0
    assert score("#### 0.30000000000000004", "0.3") == 0.0


def test_minus_between_numbers_is_not_a_sign() -> None:
    assert extract_answer("16-3") == "3"
    assert extract_answer("so 20 - 2 is what is left") == "2"
    assert extract_answer("x2 and v1.5") is None  # numbers glued to words are not answers


def test_division_by_zero_is_no_answer() -> None:
    assert extract_answer("The answer is 5/0") is None
    assert score("The answer is 5/0", "5") == 0.0


# --------------------------------------------------------------------------------------------
# Which number is the answer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "#### 18\nThat is 3 more than 15.",
        "The answer is 18. Check: 9 + 9 = 18, and 2 * 9 = 18, so 4 eggs remain.",
        "Answer: 18 (from 16 - 3 - 4 = 9 eggs at 2 each, 7 days)",
        "\\boxed{18} since 9 * 2 = 18 and 7 > 3",
        "<answer>18</answer>\nI used 3 steps.",
    ],
)
def test_marker_wins_over_later_numbers(text: str) -> None:
    assert extract_answer(text) == "18"
    assert score(text, "18") == 1.0


def test_last_marker_wins_among_markers() -> None:
    text = "The answer is 17.\nWait, I made a mistake. 9 * 2 = 18.\n#### 18\nSo 3 steps."
    assert extract_answer(text) == "18"
    assert extract_answer("#### 18\nHmm, no: the answer is 17, not 5") == "17"
    assert extract_answer("\\boxed{17} ... actually <answer>18</answer> then 3") == "18"
    assert extract_answer("<answer>17</answer> Final answer: \\boxed{18}") == "18"
    marker = find_answer("The answer is 17. #### 18")
    assert marker is not None and marker.kind == "hash" and marker.answer == "18"


def test_markers_need_a_number() -> None:
    # a marker with no number after it does not count; the last number is the fallback
    assert extract_answer("The answer is below: we get 18") == "18"
    assert extract_answer("The answer is below: we get 18", strict=True) is None


def test_a_colon_counts_only_at_line_start() -> None:
    assert extract_answer("Plan A: 5 apples, plan B: 7 apples") == "7"
    assert extract_answer("Plan A: 5 apples, plan B: 7 apples", strict=True) is None


def test_answer_words_inside_other_words_are_not_markers() -> None:
    assert extract_answer("The answer isn't 5, it is 6") == "6"


# --------------------------------------------------------------------------------------------
# Strict mode
# --------------------------------------------------------------------------------------------


def test_strict_requires_an_explicit_marker() -> None:
    assert score("9 * 2 = 18", "18") == 1.0
    assert score("9 * 2 = 18", "18", strict=True) == 0.0
    assert extract_answer("9 * 2 = 18", strict=True) is None
    for text in ANSWER_FORMS[:-1]:
        assert score(text, "18", strict=True) == 1.0, text


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def test_parse_reference() -> None:
    assert parse_reference("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18") == "18"
    assert parse_reference("#### 70,000") == "70000"
    assert parse_reference("#### -3") == "-3"
    assert parse_reference("18") == "18"
    assert parse_reference(" $1,000 ") == "1000"
    assert parse_reference("3/4") == "3/4"
    assert parse_reference("0.50") == "0.5"
    # The number right after the last "####" is the reference, not the last number of the text.
    assert parse_reference("#### 18 (3 boxes)") == "18"
    assert parse_reference("6 boxes of 3 = 18\n#### 18 (3 boxes of 6)") == "18"
    assert score("The answer is 18", "#### 18 (3 boxes)") == 1.0
    assert score("The answer is 3", "#### 18 (3 boxes)") == 0.0
    with pytest.raises(ValueError, match="no number"):
        parse_reference("eighteen")
    with pytest.raises(ValueError, match="no number"):
        score("18", "#### ")


# --------------------------------------------------------------------------------------------
# The plugin
# --------------------------------------------------------------------------------------------


def test_plugin_scores_a_group() -> None:
    reward = make_plugin("gsm8k")
    prompt = Prompt(id="q1", text="How much?", answer="9 * 2 = <<9*2=18>>18\n#### 18")
    texts = ["#### 18", "The answer is 17.", "9 * 2 = 18", "no idea", "\\boxed{18.00}"]
    scores = reward.reward(prompt=prompt, samples=[sample(prompt, t) for t in texts])
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_plugin_is_registered_as_reward() -> None:
    reward = make_plugin("gsm8k", kind="reward")
    assert type(reward).__name__ == "GSM8KReward"
    assert type(reward).__doc__ and "####" in type(reward).__doc__


def test_plugin_declares_that_it_needs_a_reference_answer() -> None:
    # The data loader reads this class attribute to reject rows without an answer up front.
    assert make_plugin("gsm8k").needs_answer is True
    assert "needs_answer" in type(make_plugin("gsm8k")).__doc__


def test_plugin_scores_a_reference_with_text_after_the_marker() -> None:
    reward = make_plugin("gsm8k")
    prompt = Prompt(id="q1", text="?", answer="6 boxes of 3 = 18\n#### 18 (3 boxes)")
    assert reward.reward(prompt=prompt, samples=[sample(prompt, "#### 18"), sample(prompt, "#### 3")]) == [1.0, 0.0]


def test_plugin_strict_option_from_cli_string() -> None:
    reward = make_plugin("gsm8k", strict="true")
    prompt = Prompt(id="q1", text="?", answer="18")
    assert reward.reward(prompt=prompt, samples=[sample(prompt, "9 * 2 = 18"), sample(prompt, "A: 18")]) == [0.0, 1.0]


def test_plugin_format_bonus_and_penalty() -> None:
    reward = make_plugin("gsm8k", format_bonus="0.1", format_penalty=0.5)
    prompt = Prompt(id="q1", text="?", answer="#### 18")
    texts = [
        "9 * 2 = 18\n#### 18",  # right, #### format: 1 + 0.1
        "#### 17",  # wrong, #### format: 0 + 0.1
        "The answer is 18",  # right, other marker: 1
        "The answer is 17",  # wrong, other marker: 0
        "9 * 2 = 18",  # right, no marker: 1 - 0.5
        "no idea",  # wrong, no marker: -0.5
    ]
    scores = reward.reward(prompt=prompt, samples=[sample(prompt, t) for t in texts])
    assert scores == pytest.approx([1.1, 0.1, 1.0, 0.0, 0.5, -0.5])


def test_plugin_format_defaults_change_nothing() -> None:
    reward = make_plugin("gsm8k")
    assert (reward.strict, reward.format_bonus, reward.format_penalty) == (False, 0.0, 0.0)
    prompt = Prompt(id="q1", text="?", answer="18")
    assert reward.reward(prompt=prompt, samples=[sample(prompt, "#### 18"), sample(prompt, "no")]) == [1.0, 0.0]


def test_plugin_rejects_negative_format_magnitudes() -> None:
    with pytest.raises(PluginError, match="format_penalty must be >= 0"):
        make_plugin("gsm8k", format_penalty=-0.5)
    with pytest.raises(PluginError, match="format_bonus must be >= 0"):
        make_plugin("gsm8k", format_bonus=-0.1)


@pytest.mark.parametrize("answer", [None, "", "   "])
def test_plugin_prompt_without_answer_names_the_prompt(answer: str | None) -> None:
    reward = make_plugin("gsm8k")
    prompt = Prompt(id="row-42", text="?", answer=answer)
    with pytest.raises(ValueError, match="row-42"):
        reward.reward(prompt=prompt, samples=[sample(prompt, "#### 1")])


def test_plugin_unparsable_answer_names_the_prompt() -> None:
    reward = make_plugin("gsm8k")
    prompt = Prompt(id="row-7", text="?", answer="#### eighteen")
    with pytest.raises(ValueError, match="row-7.*no number"):
        reward.reward(prompt=prompt, samples=[sample(prompt, "#### 18")])


# --------------------------------------------------------------------------------------------
# Acceptance: the GSM8K test split's gold answers
# --------------------------------------------------------------------------------------------


def test_gsm8k_test_split_ships_in_the_repository_with_its_license(gsm8k_test_split: Path) -> None:
    repo = Path(__file__).resolve().parents[3]
    assert gsm8k_test_split.is_relative_to(repo / "tests" / "data")
    license_text = (gsm8k_test_split.parent / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in license_text
    rows = [json.loads(line) for line in gsm8k_test_split.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319 and all(set(r) == {"question", "answer"} for r in rows)
    assert rows[0]["question"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert parse_reference(rows[0]["answer"]) == "18"


def test_gsm8k_gold_answers_score_themselves_and_not_others(gsm8k_test_split: Path) -> None:
    # Fails (does not skip) when the data is missing: this is the acceptance test.
    assert gsm8k_test_split.is_file(), f"GSM8K test split missing: {gsm8k_test_split}"
    answers = [json.loads(line)["answer"] for line in gsm8k_test_split.read_text().splitlines() if line.strip()]
    assert len(answers) == 1319
    self_fail = [i for i, a in enumerate(answers) if score(a, a) != 1.0 or score(a, a, strict=True) != 1.0]
    assert not self_fail, f"{len(self_fail)} gold answers do not score 1.0 against themselves: {self_fail[:10]}"
    compared, cross_pass = 0, []
    for i, answer in enumerate(answers):
        other = answers[(i + 1) % len(answers)]
        if parse_reference(other) != parse_reference(answer):
            compared += 1
            if score(other, answer) != 0.0:
                cross_pass.append(i)
    assert compared > 1200
    assert not cross_pass, f"another question's answer scored 1.0: {cross_pass[:10]}"
