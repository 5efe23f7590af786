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
    assert config.loss == ["grpo"] and config.reward == {"gsm8k": 2.0}
    assert config.plugin_options["loss"]["grpo"] == {"eps_high": 0.3, "kl_beta": "0"}
    assert config.plugin_options["reward"]["gsm8k"] == {"strict": True}


def test_toml_selection_without_options_and_cli_selection_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('loss = "grpo"\nreward = ["gsm8k", "format:0.1"]\n[advantage.rloo]\n')
    config = load(str(path), {}, {})
    assert config.loss == ["grpo"] and config.reward == {"gsm8k": 1.0, "format": 0.1} and config.advantage == "rloo"
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
    assert RunConfig().reward == {"gsm8k": 1.0}
    assert RunConfig(env="retry_math").reward == {"env": 1.0}
    assert RunConfig(env="retry_math", reward=["gsm8k"]).reward == {"gsm8k": 1.0}
    assert load(None, {"env": "retry_math"}, {}).reward == {"env": 1.0}
    assert load(None, {"env": "retry_math", "reward": ["gsm8k", "env:0.5"]}, {}).reward == {"gsm8k": 1.0, "env": 0.5}


def test_every_setting_names_a_help_section_and_says_whether_resume_may_change_it():
    from grpo_core.config import SECTIONS, cli_fields

    for field in cli_fields():
        assert field.metadata.get("section") in SECTIONS, f"{field.name}: declare it with _field(default, help, SECTION)"
        assert field.metadata["help"] and isinstance(field.metadata["resumable"], bool), field.name


def test_the_settings_resume_may_change_are_those_marked_resumable():
    from grpo_core.config import resumable_fields

    assert resumable_fields() == [
        "max_steps", "fetch_timeout", "max_reward_failures_in_a_row", "reward_timeout",
        "eval_every", "eval_dataset", "eval_mix", "eval_prompts", "eval_samples", "eval_pass_threshold",
        "max_nonfinite_steps_in_a_row", "max_concurrent",
        "rollout_retries", "rollout_retry_backoff", "max_rollout_failures_in_a_row", "max_rollout_failure_rate",
        "rollout_failure_window", "checkpoint_every", "keep_checkpoints", "allow_low_disk", "memory_check", "threads",
    ]  # fmt: skip


def stored_run(tmp_path, **values):
    """A run directory holding the config.json of a run made with these values."""
    from grpo_core.plugins_manager import write_config

    write_config(load(None, values, {}), tmp_path / "config.json")
    return str(tmp_path)


def test_resume_changes_only_resumable_settings_and_compares_the_rest_as_typed(tmp_path):
    from grpo_core.resume import load_resumed

    run_dir = stored_run(tmp_path, reward=["gsm8k", "format:0.5"], prompt_template=r"Q: {prompt}\nA:", max_steps=3)
    resumed = load_resumed(run_dir, {"max_steps": "8", "keep_checkpoints": 4}, {})
    assert (resumed.max_steps, resumed.keep_checkpoints, resumed.run_dir) == (8, 4, run_dir)
    assert resumed.reward == {"gsm8k": 1.0, "format": 0.5} and resumed.prompt_template == "Q: {prompt}\nA:"
    # The stored values given again, as typed on a command line, are no change.
    again = load_resumed(run_dir, {"reward": ["gsm8k", "format:0.5"], "prompt_template": r"Q: {prompt}\nA:"}, {})
    assert again.reward == {"gsm8k": 1.0, "format": 0.5} and again.prompt_template == "Q: {prompt}\nA:"
    with pytest.raises(PluginError, match=r"--reward, --learning-rate cannot change \(allowed: --max-steps, "):
        load_resumed(run_dir, {"reward": ["gsm8k", "format:0.6"], "learning_rate": "0.5"}, {})
    with pytest.raises(PluginError, match="--prompt-template cannot change"):
        load_resumed(run_dir, {"prompt_template": r"Q: {prompt}\\nA:"}, {})
    with pytest.raises(PluginError, match="config 'max_steps': expected an integer"):
        load_resumed(run_dir, {"max_steps": "many"}, {})


def test_a_stored_template_is_read_as_saved_not_decoded_again(tmp_path):
    from grpo_core.resume import load_resumed

    run_dir = stored_run(tmp_path, prompt_template=r"a\\nb {prompt}")
    assert load(None, {"prompt_template": r"a\\nb {prompt}"}, {}).prompt_template == "a\\nb {prompt}"
    assert load_resumed(run_dir, {}, {}).prompt_template == "a\\nb {prompt}"


def test_a_template_from_a_toml_file_has_its_escapes_read_once(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("prompt_template = 'Q: {prompt}\\n\"A\\\\t\":'\n")
    assert load(str(path), {}, {}).prompt_template == 'Q: {prompt}\n"A\\t":'


def test_reward_weights_from_a_toml_table_a_toml_list_and_flags_are_the_same_typed_value(tmp_path):
    tables = tmp_path / "tables.toml"
    tables.write_text("[reward.gsm8k]\nstrict = true\n[reward.format]\nweight = 0.1\n")
    listed = tmp_path / "list.toml"
    listed.write_text('reward = ["gsm8k", "format:0.1"]\n')
    from_tables, from_list = load(str(tables), {}, {}), load(str(listed), {}, {})
    from_flags = load(None, {"reward": ["gsm8k", "format:0.1"]}, {})
    assert from_tables.reward == from_list.reward == from_flags.reward == {"gsm8k": 1.0, "format": 0.1}
    assert list(from_tables.reward) == ["gsm8k", "format"]  # the order given is the order scored and logged
    assert from_tables.plugin_options == {"reward": {"gsm8k": {"strict": True}}}  # the weight is no plugin option
    assert load(None, {"reward": "format:2"}, {}).reward == {"format": 2.0}
    assert load(str(tables), {"reward": ["format:3"]}, {}).reward == {"format": 3.0}  # flags win


@pytest.mark.parametrize(
    ("given", "error"),
    [
        (["format:x"], "reward 'format:x': weight 'x' is not a number"),
        (["gsm8k", "gsm8k:2"], "reward 'gsm8k' is selected twice"),
        ([":2"], r"reward ':2': no name \(use NAME\[:WEIGHT\]\)"),
        (["format:nan"], "reward 'format': weight must be a finite number, got nan"),
        (["format:inf"], "reward 'format': weight must be a finite number, got inf"),
        ({"format": "heavy"}, "reward 'format': weight 'heavy' is not a number"),
        ({"format": True}, "reward 'format': weight True is not a number"),
        ([3], "reward 3: expected NAME"),
    ],
)
def test_bad_reward_weights_are_clear_errors(given, error):
    with pytest.raises(PluginError, match=error):
        load(None, {"reward": given}, {})


def test_a_bad_weight_in_a_toml_table_is_a_clear_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[reward.format]\nweight = "a lot"\n')
    with pytest.raises(PluginError, match="reward 'format': weight 'a lot' is not a number"):
        load(str(path), {}, {})


def test_resuming_a_run_stored_before_a_setting_existed_refuses_that_setting_clearly(tmp_path):
    import json

    from grpo_core.resume import load_resumed

    run_dir = stored_run(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    del stored["lora_rank"], stored["threads"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    with pytest.raises(PluginError, match=r"--lora-rank cannot change"):
        load_resumed(run_dir, {"lora_rank": "8"}, {})
    resumed = load_resumed(run_dir, {"threads": "2"}, {})
    assert (resumed.threads, resumed.lora_rank) == (2, 0)


def test_options_of_the_default_sampler_reach_it_and_a_kind_with_none_selected_says_so():
    from grpo_core.selection import select_plugins

    # --sampler not given: the backend's default (local) takes them, and says which it has.
    config = load(None, {}, {"sampler": ["batch_size=4"]})
    select_plugins(config)
    assert config.plugin_options["sampler"] == {"local": {"batch_size": 4}}
    with pytest.raises(PluginError, match=r"^unknown option 'concurrency' for sampler.local options: batch_size, decode, check_every$"):
        select_plugins(load(None, {}, {"sampler": ["concurrency=auto"]}))
    with pytest.raises(PluginError, match=r"options given for plugins that are not selected: sampler.openai"):
        select_plugins(load(None, {}, {"sampler": ["openai.concurrency=auto"]}))
    for kind, flag in (("env", "--env"), ("tool", "--tool"), ("group_filter", "--group-filter")):
        with pytest.raises(
            PluginError, match=rf"^--{kind}-opt 'x=1': no {kind} plugin is selected, so it would do nothing; select one with {flag} NAME$"
        ):
            load(None, {}, {kind: ["x=1"]})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"loop": "async", "synchronous_training": True, "max_concurrent": 4},
            "--max-concurrent bounds the rollouts that overlap training",
        ),
        ({"loop": "async", "synchronous_training": True, "max_head_offpolicy_versions": 2}, "--max-head-offpolicy-versions bounds the"),
        ({"min_samples_per_fwd_bwd": 2}, "--min-samples-per-fwd-bwd joins a short last forward/backward call to the one before; without"),
    ],
)
def test_settings_that_do_nothing_with_the_rest_are_refused(given, message):
    with pytest.raises(PluginError, match=f"^{message}.* it would do nothing$"):
        load(None, given, {})
    # Where they do something, they are taken.
    taken = {**given, "max_samples_per_fwd_bwd": 4} | ({"synchronous_training": False} if "loop" in given else {})
    load(None, taken, {})


def test_gradient_checkpointing_is_auto_unless_a_flag_turns_it_on_or_off(monkeypatch):
    from tests.helpers import captured_run_config

    assert RunConfig().gradient_checkpointing is None
    for flags, expected in (([], None), (["--gradient-checkpointing"], True), (["--no-gradient-checkpointing"], False)):
        code, output, config = captured_run_config(monkeypatch, *flags)
        assert code == 0, output
        assert config.gradient_checkpointing is expected
