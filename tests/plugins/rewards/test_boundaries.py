"""GSM8K answer parsing at the boundaries its code draws (survivors of scripts/mutate.py)."""

from grpo_core.plugins.rewards.gsm8k import extract_answer


def test_a_fraction_over_one_is_its_numerator_and_over_zero_is_no_number():
    assert extract_answer("#### 3/1") == "3"
    assert extract_answer("#### 3/0") is None


def test_every_leading_sign_counts():
    # A number may carry a sign before and after its currency sign ("+$-5"): each one is read.
    assert extract_answer("#### +-5") == "-5"
