"""The grpo-reward-math-verify distribution, installed (tests/packages/conftest.py), inside this process.

What every reward distribution must do is in test_reward_distributions.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_core.plugins.rewards import gsm8k
from grpo_core.plugins_manager import catalog


@pytest.fixture
def installed(math_verify_site: Path, monkeypatch: pytest.MonkeyPatch):
    """The installed package importable in this process, and in the catalog."""
    monkeypatch.syspath_prepend(str(math_verify_site))
    catalog.cache_clear()
    from grpo_core import make_plugin

    plugin = make_plugin("math_verify", timeout_s=30.0)  # generous: the machine may be loaded
    yield plugin
    plugin.close()
    catalog.cache_clear()


def gsm8k_pairs(path: Path) -> list[tuple[str, str]]:
    """(completion, reference) pairs from every row of the split: its own solution, the solutions of
    two other rows, and its solution ending in "The answer is N" instead of "#### N"."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    pairs = []
    for i, row in enumerate(rows):
        for other in (rows[i], rows[(i + 1) % len(rows)], rows[(i + 7) % len(rows)]):
            pairs.append((other["answer"], row["answer"]))
        body, _, number = row["answer"].rpartition("####")
        pairs.append((f"{body}The answer is {number.strip()}.", row["answer"]))
    return pairs


@pytest.mark.slow
def test_agrees_with_the_gsm8k_scorer_on_the_shipped_test_split(installed, gsm8k_test_split):
    pairs = gsm8k_pairs(gsm8k_test_split)
    assert len(pairs) == 4 * 1319
    disagree = [(c[-60:], r[-20:]) for c, r in pairs if installed.score(c, r) != gsm8k.score(c, r)]
    assert disagree == []
    assert sum(gsm8k.score(c, r) for c, r in pairs) > 2 * 1319  # right and wrong answers both


def test_a_hanging_parse_is_handled_within_its_timeout(math_verify_site, monkeypatch):
    import time

    monkeypatch.syspath_prepend(str(math_verify_site))
    catalog.cache_clear()
    from grpo_core import Prompt, Sample, make_plugin

    plugin = make_plugin("math_verify", timeout_s=1.0)
    prompt = Prompt(id="p", text="?", answer="#### 5")
    samples = [Sample(prompt, [1, 2], [0.0, 0.0], [0.0, 1.0], t, "stop", 0) for t in ("5", "\\boxed{9^{9^{9^{9}}}}", "5")]
    try:
        plugin.reward(prompt=prompt, samples=samples[:1])  # the worker is up
        started = time.perf_counter()
        assert plugin.reward(prompt=prompt, samples=samples) == [1.0, 0.0, 1.0]
        assert time.perf_counter() - started < 1.0 + 20.0  # the limit, then a fresh worker's start
    finally:
        plugin.close()
        catalog.cache_clear()
