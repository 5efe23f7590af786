"""grpo-reward-math-verify: scores, the worker, its time and memory limits, any thread, any input."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from grpo_reward_math_verify.reward import MathVerifyReward, answer_region

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.plugins_manager import catalog

HANGS = "\\boxed{9^{9^{9^{9}}}}"
"""Math-Verify does not come back from this one (it tries to evaluate the tower)."""


def sample(prompt: Prompt, text: str) -> Sample:
    return Sample(
        prompt=prompt, tokens=[1, 2], sampling_logprobs=[0.0, 0.0], loss_mask=[0.0, 1.0], text=text, finish_reason="stop", policy_version=0
    )


@pytest.fixture(scope="module")
def reward():
    plugin = make_plugin("math_verify", timeout_s=30.0)  # generous: the machine may be loaded
    yield plugin
    plugin.close()


def scores(plugin: MathVerifyReward, answer: str, *texts: str) -> list[float | None]:
    prompt = Prompt(id="p", text="?", answer=answer)
    return plugin.reward(prompt=prompt, samples=[sample(prompt, t) for t in texts])


def test_answer_region() -> None:
    assert answer_region("9 * 2 = 18\n#### 18") == " 18"
    assert answer_region("#### 1 then #### 2") == " 2"
    assert answer_region("\\boxed{3}") == "\\boxed{3}"


def test_catalog_lists_the_plugin_from_its_distribution() -> None:
    entries = [e for e in catalog() if e.kind == "reward" and e.name == "math_verify"]
    assert len(entries) == 1
    assert (entries[0].distribution, entries[0].version) == ("grpo-reward-math-verify", "0.1.0")
    assert isinstance(make_plugin("math_verify"), MathVerifyReward)


def test_latex_answers(reward: MathVerifyReward) -> None:
    texts = [
        "So the answer is $\\boxed{\\frac{1}{\\sqrt{2}}}$.",
        "The final answer is $\\frac{\\sqrt{2}}{2}$.",
        "$\\boxed{0.5}$",
        "$\\boxed{\\sqrt{2}}$",
        "I give up.",
    ]
    assert scores(reward, "$\\frac{\\sqrt{2}}{2}$", *texts) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_gsm8k_answers(reward: MathVerifyReward) -> None:
    answer = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
    texts = [
        "#### 18",
        "so 3 + 4 = 7 more, and 18 in all\n#### 18",
        "The answer is $\\boxed{18}$",
        "#### 17",
        "9 * 2 = 18",
        "2 + 2 = 4\n#### 4",
    ]
    assert scores(reward, answer, *texts) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]


def test_the_worker_is_reused(reward: MathVerifyReward) -> None:
    scores(reward, "#### 1", "1")
    pid = reward._worker.process.proc.pid
    scores(reward, "#### 2", "2", "3")
    assert reward._worker.process.proc.pid == pid


def test_a_hanging_parse_scores_zero_within_the_timeout_and_replaces_the_worker() -> None:
    plugin = make_plugin("math_verify", timeout_s=1.5)
    try:
        assert scores(plugin, "#### 5", "5") == [1.0]
        first = plugin._worker.process.proc
        started = time.perf_counter()
        assert scores(plugin, "#### 5", HANGS) == [0.0]
        assert time.perf_counter() - started < 1.5 + 5.0  # the limit, and the kill
        assert plugin._worker.process is None and first.poll() is not None
        assert scores(plugin, "#### 5", "5") == [1.0]  # a fresh worker
    finally:
        plugin.close()


def test_it_works_from_any_thread(reward: MathVerifyReward) -> None:
    """Math-Verify's own SIGALRM limits raise outside the main thread; a run scores from worker threads."""
    results: list[object] = []

    def score() -> None:
        try:
            results.append(scores(reward, "$\\frac{1}{2}$", "$\\boxed{0.5}$", "$\\boxed{\\frac{2}{4}}$", "$\\boxed{3}$"))
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=score) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [[1.0, 1.0, 0.0]] * 3


@pytest.mark.parametrize(
    "text",
    ["", "\\boxed{", "\\frac{1}{", "}}}{{{", "$$$$", "\\begin{matrix} 1 & \\end{pmatrix}", "\x00\x01", "\\boxed{x" * 200,
     "1/0", "\\boxed{\\infty - \\infty}", "\\sqrt{-1}^{\\sqrt{-1}}", "é∑🙂" * 1000, "\\boxed{" + "(" * 500 + "}"],
)  # fmt: skip
def test_model_output_never_makes_it_raise(reward: MathVerifyReward, text: str) -> None:
    assert scores(reward, "#### 5", text) == [0.0]


@pytest.mark.parametrize("answer", [None, "", "   "])
def test_a_prompt_without_answer_names_the_prompt(reward: MathVerifyReward, answer: str | None) -> None:
    with pytest.raises(ValueError, match="math_verify reward: prompt 'p' has no reference answer"):
        scores(reward, answer, "5")


def test_a_reference_without_an_answer_names_the_prompt(reward: MathVerifyReward) -> None:
    with pytest.raises(ValueError, match="math_verify reward: prompt 'p': no answer in the reference 'no answer here'"):
        scores(reward, "no answer here", "5")


def test_memory_limit_mb_limits_the_worker() -> None:
    for limit, expected in ((1536, str(1536 * 1024 * 1024)), (0, "unlimited")):
        plugin = make_plugin("math_verify", memory_limit_mb=limit)
        try:
            scores(plugin, "#### 1", "1")
            limits = Path(f"/proc/{plugin._worker.process.proc.pid}/limits").read_text()
            row = next(line for line in limits.splitlines() if line.startswith("Max address space"))
            assert row.split()[3] == expected, row
        finally:
            plugin.close()


def test_startup_timeout_s() -> None:
    plugin = make_plugin("math_verify", startup_timeout_s=0.001)
    with pytest.raises(RuntimeError, match="did not start within 0.001 s"):
        scores(plugin, "#### 1", "1")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"startup_timeout_s": -1}, "startup_timeout_s must be > 0"),
        ({"memory_limit_mb": -1}, "memory_limit_mb must be >= 0"),
    ],
)
def test_bad_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        make_plugin("math_verify", **options)


def test_close_stops_the_worker() -> None:
    plugin = make_plugin("math_verify")
    scores(plugin, "#### 1", "1")
    proc = plugin._worker.process.proc
    plugin.on_run_end(summary={}, run_dir=Path("."))
    assert plugin._worker.process is None and proc.poll() is not None
