"""GSM8K answer parsing at the boundaries its code draws (survivors of scripts/mutate.py)."""

import pytest

from grpo_core.plugins.rewards.gsm8k import extract_answer, parse_reference, score


def test_a_fraction_over_one_is_its_numerator_and_over_zero_is_no_number():
    assert extract_answer("#### 3/1") == "3"
    assert extract_answer("#### 3/0") is None


def test_every_leading_sign_counts():
    # A number may carry a sign before and after its currency sign ("+$-5"): each one is read.
    assert extract_answer("#### +-5") == "-5"


def test_a_tag_is_found_in_any_case_and_over_lines_when_lower_casing_moves_positions():
    # "İ".lower() is two characters, so the tag is searched case-insensitively in the text itself.
    assert extract_answer("İ <Answer>The sum\nis 7</Answer> then 9") == "7"
    assert extract_answer("<Answer>The sum\nis 7</Answer> then 9") == "7"


def test_a_last_number_longer_than_the_fallback_window_is_read_whole():
    digits = "1" * 300
    assert extract_answer("the total is " + digits) == digits
    assert extract_answer(digits + " apples") == digits


def test_the_fallback_reads_a_number_before_the_window_when_none_in_it_converts():
    # The last digit is in "1/0" (no value); the number before it is 300 characters further back.
    assert extract_answer("I have 5 apples" + " " * 300 + "and 1/0") == "5"
    assert extract_answer("1/0" + " " * 300 + "and 1/0") is None


def test_a_box_head_may_be_followed_by_spaces_but_needs_a_closed_brace():
    assert extract_answer("\\boxed {7} and 9") == "7"
    assert extract_answer("\\boxed{7} and {9}") == "7"  # the box ends at its own closing brace
    assert extract_answer("\\boxed  {7} and 9") == "7"
    assert extract_answer("so 5 \\boxed") == "5"  # a head at the very end
    assert extract_answer("so 5 \\boxed   ") == "5"
    assert extract_answer("\\boxed{7") == "7"  # unclosed: no box, the last number
    assert extract_answer("\\boxed{7", strict=True) is None
    assert extract_answer("\\boxed 7 or 8", strict=True) is None  # no brace: no box


def test_an_a_marker_counts_only_at_the_start_of_a_line():
    assert extract_answer("Q: x\nA: 18 apples, 20 pears") == "18"
    assert extract_answer("Q: x\nxA: 18 apples, 20 pears") == "20"
    assert extract_answer("\nA: 18 apples, 20 pears") == "18"  # a newline at position 0


def test_a_letter_that_lower_cases_to_two_characters_does_not_shift_a_tags_content():
    assert extract_answer("İ <answer>7</answer> then 9") == "7"


def test_a_reference_is_the_number_after_its_last_hash_line_or_read_like_a_completion():
    assert parse_reference("#### 5\nThe answer is 6") == "5"
    assert parse_reference("3 apples and 4 pears") == "4"
    assert score("4", "3 apples and 4 pears") == 1.0


def test_a_blank_reference_answer_is_refused_as_missing():
    from grpo_core import Prompt
    from grpo_core.plugins.rewards.gsm8k import GSM8KReward

    with pytest.raises(ValueError, match="prompt 'p' has no reference answer"):
        GSM8KReward().reward(prompt=Prompt(id="p", text="q", answer="  "), samples=[])
