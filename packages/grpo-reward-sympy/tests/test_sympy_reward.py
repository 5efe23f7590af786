"""grpo-reward-sympy: parsing, equivalence, extraction, the time limit, and the installed plugin."""

from __future__ import annotations

import time

import attrs
import pytest
from grpo_reward_sympy.equivalence import is_equivalent
from grpo_reward_sympy.parse import NotMath, plain_number, to_sympy_text
from grpo_reward_sympy.reward import SympyReward, extract_final_answer, last_boxed, reference_answer

from grpo_core import Prompt, Sample, make_plugin
from grpo_core.plugins_manager import catalog


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


@pytest.fixture(scope="module")
def reward():
    plugin = make_plugin("sympy", timeout_s=20.0)  # generous: the machine may be loaded
    yield plugin
    plugin.close()


# --------------------------------------------------------------------------------------------
# Parsing to sympy syntax (pure Python)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "text"),
    [
        ("\\frac{1}{2}", "((1)/(2))"),
        ("\\dfrac12", "((1)/(2))"),
        ("\\sqrt{2}", "sqrt(2)"),
        ("\\sqrt[3]{8}", "((8)**(1/(3)))"),
        ("2\\pi", "2 pi"),
        ("2^{10}", "2**(10)"),
        ("x = \\frac{1}{2}", "((1)/(2))"),
        ("18 \\text{ dollars}", "18"),
        ("\\$18.50", "18.50"),
        ("50\\%", "50"),
        ("90^\\circ", "90"),
        ("1,000", "1000"),
        ("$2x+1$.", "2x+1"),
        ("\\left(\\frac{1}{2}\\right)", "(((1)/(2)))"),
    ],
)
def test_to_sympy_text(answer: str, text: str) -> None:
    assert to_sympy_text(answer).strip() == text


@pytest.mark.parametrize(
    "answer",
    ["18 dollars", "(1, 2)", "\\unknowncommand{3}", "\\frac{1}{2", "x_1", "__import__('os')", "", "a; b"],
)
def test_not_math(answer: str) -> None:
    with pytest.raises(NotMath):
        to_sympy_text(answer)


def test_plain_number() -> None:
    assert plain_number("-3") == -3
    assert plain_number("3/4") == plain_number("0.75")
    assert plain_number("1/0") is None
    assert plain_number("sqrt(2)") is None


# --------------------------------------------------------------------------------------------
# Equivalence (sympy, in this process)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "ref"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("1/2", "\\frac{1}{2}"),
        ("\\sqrt{8}", "2\\sqrt{2}"),
        ("\\frac{\\sqrt{3}}{2}", "\\sin(\\pi/3)"),
        ("2\\pi", "2*pi"),
        ("2*x+1", "1+2x"),
        ("(x-1)(x+1)", "x^2-1"),
        ("\\sqrt[3]{8}", "2"),
        ("e^{i\\pi}", "-1"),
        ("x = 5", "5"),
        ("1,000", "1000"),
    ],
)
def test_equivalent(pred: str, ref: str) -> None:
    assert is_equivalent(pred, ref)


@pytest.mark.parametrize(
    ("pred", "ref"),
    [
        ("\\frac{1}{3}", "0.333"),
        ("\\sqrt{2}", "1.4142"),
        ("2x+1", "2x-1"),
        ("2\\pi", "6.28"),
        ("1/0", "1"),
        ("18 dollars", "18"),  # prose is not an expression (extraction turns it into 18 first)
    ],
)
def test_not_equivalent(pred: str, ref: str) -> None:
    assert not is_equivalent(pred, ref)


# --------------------------------------------------------------------------------------------
# Final-answer extraction
# --------------------------------------------------------------------------------------------


def test_last_boxed_matches_nested_braces() -> None:
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{\\sqrt{3}}{2}} done") == "\\frac{\\sqrt{3}}{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unclosed


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Thus \\boxed{\\frac{\\sqrt{3}}{2}}.", "\\frac{\\sqrt{3}}{2}"),
        ("The answer is $2x+1$.", "2x+1"),
        ("The answer is \\(\\sqrt{2}\\), since ...", "\\sqrt{2}"),
        ("Answer: 1+2x", "1+2x"),
        ("#### 18", "18"),
        ("<answer>\\frac{1}{2}</answer>", "\\frac{1}{2}"),
        ("The answer is 18 dollars.", "18"),  # prose after the marker: gsm8k's number
        ("She makes 9 * 2 = 18", "18"),  # no marker: the last number
        ("The answer is \\boxed{7}. Check: 3 + 4 = 7, 2 more", "7"),
        ("\\boxed{5} Wait, no. The answer is 6.", "6"),  # the last marker wins
    ],
)
def test_extract_final_answer(text: str, answer: str) -> None:
    assert extract_final_answer(text) == answer


def test_extract_strict() -> None:
    assert extract_final_answer("9 * 2 = 18", strict=True) is None
    assert extract_final_answer("\\boxed{18}", strict=True) == "18"


def test_reference_answer() -> None:
    assert reference_answer("9 * 2 = 18\n#### 18") == "18"
    assert reference_answer("so the result is $\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"
    assert reference_answer(" 2\\pi ") == "2\\pi"


# --------------------------------------------------------------------------------------------
# The plugin, installed through the entry point
# --------------------------------------------------------------------------------------------


def test_catalog_lists_the_plugin_from_its_distribution() -> None:
    entries = [e for e in catalog() if e.kind == "reward" and e.name == "sympy"]
    assert len(entries) == 1
    assert entries[0].distribution == "grpo-reward-sympy"
    assert entries[0].version == "0.1.0"
    assert isinstance(make_plugin("sympy"), SympyReward)


def test_plugin_scores_a_group(reward: SympyReward) -> None:
    prompt = Prompt(id="p1", text="?", answer="\\frac{\\sqrt{2}}{2}")
    texts = [
        "So the answer is \\boxed{\\frac{1}{\\sqrt{2}}}.",
        "The answer is $\\frac{\\sqrt{2}}{2}$.",
        "\\boxed{0.7071}",
        "\\boxed{\\sqrt{2}}",
        "I give up.",
    ]
    assert reward.reward(prompt=prompt, samples=[sample(prompt, t) for t in texts]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_plugin_symbolic_expressions(reward: SympyReward) -> None:
    prompt = Prompt(id="p2", text="?", answer="2*x+1")
    texts = ["\\boxed{1+2x}", "The answer is $x + x + 1$.", "\\boxed{2x-1}"]
    assert reward.reward(prompt=prompt, samples=[sample(prompt, t) for t in texts]) == [1.0, 1.0, 0.0]


def test_plugin_gsm8k_reference_and_plain_numbers_skip_sympy() -> None:
    plugin = make_plugin("sympy")
    prompt = Prompt(id="g1", text="?", answer="9 * 2 = <<9*2=18>>18\n#### 18")
    texts = ["#### 18", "The answer is $18.00.", "\\boxed{\\frac{36}{2}}", "The answer is 17", "9 * 2 = 18"]
    assert plugin.reward(prompt=prompt, samples=[sample(prompt, t) for t in texts[:2] + texts[3:]]) == [1.0, 1.0, 0.0, 1.0]
    assert plugin._worker.process is None  # numbers are compared exactly, without starting sympy
    plugin.timeout_s = 20.0
    assert plugin.reward(prompt=prompt, samples=[sample(prompt, texts[2])]) == [1.0]
    plugin.close()


def test_plugin_strict_option() -> None:
    plugin = make_plugin("sympy", strict="true")
    prompt = Prompt(id="s1", text="?", answer="18")
    assert plugin.reward(prompt=prompt, samples=[sample(prompt, "9 * 2 = 18"), sample(prompt, "A: 18")]) == [0.0, 1.0]


def test_plugin_declares_that_it_needs_the_reference_answer() -> None:
    assert SympyReward.needs_answer is True
    assert make_plugin("sympy").needs_answer is True
    # a class attribute, not an option: it cannot be switched off from the command line
    assert "needs_answer" not in {f.name for f in attrs.fields(SympyReward)}


@pytest.mark.parametrize("answer", [None, "", "  "])
def test_plugin_prompt_without_answer_names_the_prompt(answer: str | None) -> None:
    plugin = make_plugin("sympy")
    prompt = Prompt(id="row-9", text="?", answer=answer)
    with pytest.raises(ValueError, match="row-9"):
        plugin.reward(prompt=prompt, samples=[sample(prompt, "\\boxed{1}")])


def test_plugin_unusable_reference_names_the_prompt() -> None:
    plugin = make_plugin("sympy")
    prompt = Prompt(id="row-3", text="?", answer="eighteen dollars")
    with pytest.raises(ValueError, match="row-3"):
        plugin.reward(prompt=prompt, samples=[sample(prompt, "\\boxed{18}")])


def test_worker_is_reused(reward: SympyReward) -> None:
    assert reward.score("\\boxed{\\sqrt{4}}", "2\\cdot 1") == 1.0
    worker = reward._worker.process
    assert worker is not None and worker.alive()
    assert reward.score("\\boxed{\\sqrt{9}}", "3\\cdot 1") == 1.0
    assert reward._worker.process is worker


def test_timeout_scores_zero_and_replaces_the_worker() -> None:
    plugin = make_plugin("sympy", timeout_s=0.5)
    plugin.startup_timeout_s = 120.0
    assert plugin.score("\\boxed{\\sqrt{4}}", "2\\cdot 1") == 1.0  # starts the worker
    worker = plugin._worker.process
    assert worker is not None
    start = time.monotonic()
    # 10^(10^7) takes sympy many seconds (an exact 10-million-digit integer)
    assert plugin.score("\\boxed{10^{10^{7}} - 10^{10^{7}} + 2}", "2\\cdot 1") == 0.0
    assert time.monotonic() - start < 10.0
    assert plugin._worker.process is None and not worker.alive()
    plugin.timeout_s = 20.0
    assert plugin.score("\\boxed{\\sqrt{4}}", "2\\cdot 1") == 1.0  # a fresh worker
    plugin.close()


def test_in_process_mode_without_limit() -> None:
    plugin = make_plugin("sympy", timeout_s="0")
    assert plugin.score("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}\\cdot 1") == 1.0
    assert plugin._worker.process is None


def test_close_stops_the_worker() -> None:
    plugin = make_plugin("sympy", timeout_s=20.0)
    assert plugin.score("\\boxed{\\pi}", "\\pi\\cdot 1") == 1.0
    worker = plugin._worker.process
    assert worker is not None
    plugin.on_run_end(summary={}, run_dir=None)
    assert plugin._worker.process is None and not worker.alive()
