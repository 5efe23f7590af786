from __future__ import annotations

import json

import pytest

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.config import RunConfig
from grpo_core.plugins.rewards.overlong import overlong_punishment


def samples(*lengths):
    prompt = Prompt(id="p", text="q")
    return [
        Sample(prompt=prompt, tokens=[1] * (n + 2), sampling_logprobs=[0.0] * (n + 2), loss_mask=[0.0, 0.0] + [1.0] * n, text="",
               finish_reason="stop", policy_version=0)
        for n in lengths
    ]  # fmt: skip


@pytest.mark.parametrize(("length", "expected"), [(0, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0), (25, -1.0)])
def test_the_punishment_is_0_then_linear_over_the_buffer_then_whole(length, expected):
    assert overlong_punishment(length, max_tokens=20, buffer=4) == pytest.approx(expected)


def test_the_run_sets_max_tokens_and_the_buffer_defaults_to_a_fifth(tmp_path):
    reward = make_plugin("reward.overlong")
    reward.on_run_start(config=RunConfig(max_completion_tokens=20), run_dir=tmp_path, total_steps=1, start_step=0)
    assert reward.reward(prompt=None, samples=samples(16, 17, 20)) == [0.0, -0.25, -1.0]
    scaled = make_plugin("reward.overlong", max_tokens=10, buffer=2, penalty=0.5)
    assert scaled.reward(prompt=None, samples=samples(8, 9, 10, 12)) == [0.0, -0.25, -0.5, -0.5]


def test_bad_settings_are_refused():
    with pytest.raises(PluginError, match="set --reward-opt overlong.max_tokens=N"):
        make_plugin("reward.overlong").reward(prompt=None, samples=samples(3))
    with pytest.raises(PluginError, match="buffer 8 is longer than max_tokens 4"):
        make_plugin("reward.overlong", max_tokens=4, buffer=8).reward(prompt=None, samples=samples(3))
    with pytest.raises(PluginError, match="must be >= 0"):
        make_plugin("reward.overlong", penalty=-1)


def test_a_buffer_past_the_runs_limit_is_refused_before_the_data_loads(tiny_model_dir, monkeypatch):
    from grpo_core import lifecycle
    from tests.helpers import grpo_core_in_process

    monkeypatch.setattr(lifecycle, "load_dataset", lambda *a, **k: pytest.fail("loaded the data"))
    args = ("--reward", "gsm8k", "--reward", "overlong", "--reward-opt", "overlong.buffer=64", "--max-completion-tokens", "32")
    result = grpo_core_in_process("run", "--model", str(tiny_model_dir), *args, "--max-steps", "1")
    assert result.returncode == 1, result.stderr
    assert "reward overlong: buffer 64 is longer than max_tokens 32" in result.stderr and "Traceback" not in result.stderr


def test_a_run_scores_completions_that_reach_the_limit(tiny_model_dir, tiny_dataset, tmp_path):
    from grpo_core.train import run

    r = tmp_path / "r"
    run(RunConfig(model=str(tiny_model_dir), dataset=str(tiny_dataset), prompt_template="Q: {prompt}\nA:", max_steps=1,
                  prompt_groups_per_step=2, completions_per_prompt=4, max_completion_tokens=5, reward={"format": 1.0, "overlong": 1.0},
                  logger=["jsonl"], run_dir=str(r), drop_zero_variance_groups=False,
                  plugin_options={"logger": {"jsonl": {"samples_every": 1}}}))  # fmt: skip
    rows = [json.loads(line) for line in (r / "samples.jsonl").read_text().splitlines()]
    # buffer 1 of 5: a completion of 5 tokens (cut at the limit) gets -1, a shorter one 0.
    assert rows and all(row["reward/overlong"] == (-1.0 if row["tokens"] == 5 else 0.0) for row in rows)
    assert any(row["reward/overlong"] == -1.0 for row in rows)


def conversation(*turn_lengths, observation=3):
    """A multi-turn sample: a 2-token prompt, then each policy turn followed by an observation."""
    from grpo_core.types import Turn

    tokens, mask, turns = [1, 1], [0.0, 0.0], []
    for n in turn_lengths:
        turns.append(Turn(start=len(tokens), end=len(tokens) + n, context_end=len(tokens) + n + observation))
        tokens += [1] * (n + observation)
        mask += [1.0] * n + [0.0] * observation
    return Sample(prompt=Prompt(id="p", text="q"), tokens=tokens, sampling_logprobs=[0.0] * len(tokens), loss_mask=mask, text="",
                  finish_reason="stop", policy_version=0, turns=turns)  # fmt: skip


def test_each_turn_is_limited_not_the_conversation(tmp_path):
    # --max-completion-tokens limits each turn: three turns of 8 within 10 are not overlong, though
    # 24 policy tokens in all; a conversation gets its longest turn's penalty.
    reward = make_plugin("reward.overlong")
    reward.on_run_start(config=RunConfig(max_completion_tokens=10), run_dir=tmp_path, total_steps=1, start_step=0)
    scored = [conversation(8, 8, 8), conversation(8, 9, 2), conversation(3, 10), conversation(9), *samples(9)]
    assert reward.reward(prompt=None, samples=scored) == [0.0, -0.5, -1.0, -0.5, -0.5]
