from __future__ import annotations

import pytest

from grpo_core import PluginError
from grpo_core.config import RunConfig, load, parse_reward_spec
from grpo_core.stages import learning_rate


def test_toml_then_cli_overrides_and_plugin_tables(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("max_steps = 7\nlearning_rate = 0.001\n[loss.grpo]\neps_high = 0.3\n[reward.gsm8k]\nstrict = true\nweight = 2.0\n")
    config = load(str(path), {"max_steps": 3}, {"loss": ["kl_beta=0"]})
    assert config.max_steps == 3 and config.learning_rate == 0.001
    assert config.loss == ["grpo"] and config.reward == ["gsm8k:2.0"]
    assert config.plugin_options["loss"]["grpo"] == {"eps_high": 0.3, "kl_beta": "0"}
    assert config.plugin_options["reward"]["gsm8k"] == {"strict": True}


def test_toml_selection_without_options_and_cli_selection_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('loss = "grpo"\nreward = ["gsm8k", "format:0.1"]\n[advantage.rloo]\n')
    config = load(str(path), {}, {})
    assert config.loss == ["grpo"] and config.reward == ["gsm8k", "format:0.1"] and config.advantage == "rloo"
    assert load(str(path), {"advantage": "grpo"}, {}).advantage == "grpo"


def test_plugin_opt_needs_a_name_when_several_are_selected():
    with pytest.raises(PluginError, match="several reward plugins are selected"):
        load(None, {"reward": ["gsm8k", "format:0.1"]}, {"reward": ["strict=true"]})
    config = load(None, {"reward": ["gsm8k", "format:0.1"]}, {"reward": ["gsm8k.strict=true"]})
    assert config.plugin_options["reward"] == {"gsm8k": {"strict": "true"}}
    with pytest.raises(PluginError, match="'cispo' is not selected"):
        load(None, {}, {"loss": ["cispo.eps_high=1"]})
    with pytest.raises(PluginError, match="expected key=value"):
        load(None, {}, {"loss": ["eps_high"]})


def test_bad_values_are_clear_errors(tmp_path):
    with pytest.raises(PluginError, match="config 'max_steps': expected an integer"):
        load(None, {"max_steps": "many"}, {})
    with pytest.raises(PluginError, match="max_steps must be positive"):
        load(None, {"max_steps": 0}, {})
    with pytest.raises(PluginError, match="unknown config key 'max_stepz'"):
        load(None, {"max_stepz": 1}, {})
    with pytest.raises(PluginError, match="config file not found"):
        load(str(tmp_path / "nope.toml"), {}, {})
    bad = tmp_path / "bad.toml"
    bad.write_text("max_steps = = 3")
    with pytest.raises(PluginError, match="invalid TOML"):
        load(str(bad), {}, {})
    with pytest.raises(PluginError, match="top_p"):
        load(None, {"top_p": 1.5}, {})


def test_reward_spec_weights():
    assert parse_reward_spec("gsm8k") == ("gsm8k", 1.0)
    assert parse_reward_spec("format:0.1") == ("format", 0.1)
    with pytest.raises(PluginError, match="is not a number"):
        parse_reward_spec("format:x")


def test_learning_rate_warmup_then_decay():
    config = RunConfig(learning_rate=1.0, warmup_steps=2, lr_schedule="linear")
    assert [learning_rate(config, i, 6) for i in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cosine = RunConfig(learning_rate=1.0, lr_schedule="cosine")
    assert learning_rate(cosine, 0, 4) == 1.0
    assert learning_rate(cosine, 2, 4) == pytest.approx(0.5)
    assert learning_rate(RunConfig(learning_rate=0.3), 50, 60) == 0.3


def test_default_threads_follow_omp_num_threads_else_half_the_cpus(monkeypatch):
    import os

    from grpo_core.config import default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert default_threads() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_threads() == 1


def test_a_run_sets_the_threads_it_is_given(monkeypatch):
    import torch

    from grpo_core.lifecycle import seed_everything

    before = torch.get_num_threads()
    try:
        seed_everything(0, 1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        seed_everything(0, None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_env_and_tools_are_selected_by_flags_and_tables(tmp_path):
    config = load(None, {"env": "retry_math", "tool": ["calculator"]}, {"env": ["max_turns=2"], "tool": ["decimals=2"]})
    assert config.env == "retry_math" and config.tool == ["calculator"]
    assert config.plugin_options["env"] == {"retry_math": {"max_turns": "2"}} and config.plugin_options["tool"] == {
        "calculator": {"decimals": "2"}
    }
    path = tmp_path / "run.toml"
    path.write_text("[env.retry_math]\nmax_turns = 2\n[tool.calculator]\n")
    from_file = load(str(path), {}, {})
    assert (
        from_file.env == "retry_math"
        and from_file.tool == ["calculator"]
        and from_file.plugin_options == {"env": {"retry_math": {"max_turns": 2}}}
    )


def test_the_default_reward_is_the_environments_when_one_is_selected():
    assert RunConfig().reward == ["gsm8k"]
    assert RunConfig(env="retry_math").reward == ["env"]
    assert RunConfig(env="retry_math", reward=["gsm8k"]).reward == ["gsm8k"]
    assert load(None, {"env": "retry_math"}, {}).reward == ["env"]
    assert load(None, {"env": "retry_math", "reward": ["gsm8k", "env:0.5"]}, {}).reward == ["gsm8k", "env:0.5"]
