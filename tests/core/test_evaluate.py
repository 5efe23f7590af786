from __future__ import annotations

import json

import pytest

from grpo_core.evaluate import pass_at_k
from tests.test_cli import TEMPLATE, grpo_core


@pytest.mark.parametrize(
    ("n", "correct", "k", "expected"),
    [(1, 1, 1, 1.0), (1, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 4, 1.0), (4, 0, 4, 0.0), (5, 2, 2, 1 - 3 / 10)],
)
def test_pass_at_k_is_the_unbiased_estimator(n, correct, k, expected):
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


def test_greedy_sampling_is_a_point_mass(tiny_model_dir):
    from grpo_core import SamplingParams
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend

    config = RunConfig(model=str(tiny_model_dir))
    backend = LocalBackend()
    sampler = backend.make_sampler(config=config, trainer=backend.make_trainer(config=config))
    a, b = sampler.sample([[5, 6, 7]], 2, SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert a.tokens == b.tokens and a.logprobs == [0.0] * len(a.tokens)


def test_eval_cli_reports_reward_and_pass_at_k(tiny_model_dir, tiny_dataset, tmp_path):
    args = ["eval", "--model", str(tiny_model_dir), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE,
            "--max-completion-tokens", "3", "--max-rows", "5", "--reward", "format", "--json"]  # fmt: skip
    always = grpo_core(*args, "--reward-opt", r"pattern=[\s\S]*")
    assert always.returncode == 0, always.stderr
    assert json.loads(always.stdout.strip().splitlines()[-1]) == {
        "prompts": 5.0, "samples_per_prompt": 1.0, "reward/mean": 1.0, "reward/failed": 0.0, "pass@1": 1.0,
    }  # fmt: skip
    never = grpo_core(*args, "--reward-opt", "pattern=(?!)", "-n", "3")
    assert json.loads(never.stdout.strip().splitlines()[-1]) == {
        "prompts": 5.0, "samples_per_prompt": 3.0, "reward/mean": 0.0, "reward/failed": 0.0, "pass@1": 0.0, "pass@3": 0.0,
    }  # fmt: skip
    bad = grpo_core("eval", "--model", str(tiny_model_dir), "--dataset", str(tmp_path / "none.jsonl"))
    assert bad.returncode != 0 and "dataset file not found" in bad.stderr
