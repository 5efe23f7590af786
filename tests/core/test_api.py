"""grpo_core.run: train from Python with rows in memory and plugin instances, as the CLI does."""

from __future__ import annotations

import json

import attrs
import pytest

import grpo_core
from grpo_core import PluginError, hookimpl
from grpo_core.api import plugin_name
from grpo_core.config import RunConfig
from grpo_core.metrics import computed_only
from grpo_core.plugins.rollouts.single_turn import SingleTurnRollout
from grpo_core.train import run as run_loop
from tests.core.tiny_runs import LengthReward, length_reward  # noqa: F401  (the fixture registers reward 'length')

ROWS = [{"question": f"what is {a} plus {b}?", "answer": str(a + b)} for a in range(3) for b in range(3)]


@attrs.define
class CountingRollout(SingleTurnRollout):
    """The single-turn rollout, counting its calls."""

    calls: int = attrs.field(default=0, init=False)

    @hookimpl
    def rollout(self, prompts, num_samples, sampler, params):
        self.calls += 1
        return super().rollout(prompts, num_samples, sampler, params)


@attrs.define
class NotAPlugin:
    """Implements no hook."""


def settings(tiny_model_dir, run_dir, **kw):
    return {"model": str(tiny_model_dir), "prompt_template": "Q: {prompt}\nA:", "max_steps": 2, "prompt_groups_per_step": 2,
            "completions_per_prompt": 4, "max_completion_tokens": 6, "learning_rate": 1e-2, "logger": ["jsonl"],
            "run_dir": str(run_dir), "drop_zero_variance_groups": False, **kw}  # fmt: skip


def metrics_of(run_dir):
    return [computed_only(json.loads(line)) for line in (run_dir / "metrics.jsonl").open()]


def test_rows_and_instances_train_as_the_cli_trains_on_the_same_file(tiny_model_dir, tmp_path):
    api_dir, cli_dir = tmp_path / "api", tmp_path / "cli"
    rollout = CountingRollout()
    summary = grpo_core.run(settings(tiny_model_dir, api_dir), rows=ROWS, reward=[LengthReward()], rollout=rollout)
    assert summary["steps"] == 2 and rollout.calls == 2
    stored = json.loads((api_dir / "config.json").read_text())
    assert stored["reward"] == {"length_reward": 1.0} and stored["rollout"] == "counting_rollout"
    rows_file = tmp_path / "rows" / (stored["dataset"].rsplit("/", 1)[1])
    assert stored["dataset"] == str(rows_file) and [json.loads(line) for line in rows_file.open()] == ROWS
    assert {p.name for p in api_dir.iterdir()} >= {"config.json", "metrics.jsonl", "summary.json", "final", "checkpoints"}

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run_loop(RunConfig(**{**settings(tiny_model_dir, cli_dir), "dataset": str(data), "reward": ["length"]}))
    assert [{k.replace("length_reward", "length"): v for k, v in m.items()} for m in metrics_of(api_dir)] == metrics_of(cli_dir)


def test_a_run_config_and_plugin_options_are_taken_as_given(tiny_model_dir, tmp_path):
    config = RunConfig(**{**settings(tiny_model_dir, tmp_path / "r"), "max_steps": 1, "loss": ["grpo"]})
    config.plugin_options = {"loss": {"grpo": {"kl_beta": 0.25}}}
    grpo_core.run(config, rows=ROWS, reward=[(LengthReward(), 0.5)])
    stored = json.loads((tmp_path / "r" / "config.json").read_text())
    assert stored["reward"] == {"length_reward": 0.5} and stored["plugin_options"] == {"loss": {"grpo": {"kl_beta": 0.25}}}
    mapping = settings(tiny_model_dir, tmp_path / "m", max_steps=1, plugin_options={"loss": {"grpo": {"kl_beta": 0.25}}})
    grpo_core.run(mapping, rows=ROWS, reward=[LengthReward()])
    assert json.loads((tmp_path / "m" / "config.json").read_text())["plugin_options"] == {"loss": {"grpo": {"kl_beta": 0.25}}}


def test_a_python_run_resumes_with_the_same_instances(tiny_model_dir, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    grpo_core.run(settings(tiny_model_dir, whole, max_steps=4), rows=ROWS, reward=[LengthReward()])
    grpo_core.run(settings(tiny_model_dir, resumed, max_steps=2, checkpoint_every=2), rows=ROWS, reward=[LengthReward()])
    summary = grpo_core.run({"max_steps": 4}, resume=resumed, reward=[LengthReward()])
    assert summary["steps"] == 4
    assert metrics_of(resumed) == metrics_of(whole)
    assert len(list((tmp_path / "rows").iterdir())) == 1  # the same rows are saved once


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rows=[]), "rows= takes a non-empty list of rows"),
        (dict(rows=["what is 1?"]), r"rows\[0\] is a str, not a mapping"),
        (dict(rows=ROWS, reward=[NotAPlugin()]), "reward 'not_a_plugin' .*must implement"),
        (
            dict(
                rows=ROWS,
                reward=[LengthReward],
            ),
            "pass an instance",
        ),
        (dict(rows=ROWS, rollout=[CountingRollout()]), "one instance"),
        (dict(rows=ROWS, optimizer=LengthReward()), "unknown plugin kind 'optimizer'"),
        (dict(rows=ROWS, reward=[LengthReward(), LengthReward()]), "both named 'length_reward'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tiny_model_dir, tmp_path, kwargs, message):
    with pytest.raises(PluginError, match=message):
        grpo_core.run(settings(tiny_model_dir, tmp_path / "r"), **kwargs)
    assert not (tmp_path / "r").exists()


def test_settings_are_validated_as_the_cli_validates_them(tiny_model_dir, tmp_path):
    with pytest.raises(PluginError, match="max_steps must be positive"):
        grpo_core.run(settings(tiny_model_dir, tmp_path / "r", max_steps=0), rows=ROWS, reward=[LengthReward()])
    with pytest.raises(PluginError, match="unknown config key 'max_step'"):
        grpo_core.run({**settings(tiny_model_dir, tmp_path / "r"), "max_step": 3}, rows=ROWS, reward=[LengthReward()])
    with pytest.raises(PluginError, match="do not name a dataset in the config too"):
        grpo_core.run(settings(tiny_model_dir, tmp_path / "r", dataset="x.jsonl"), rows=ROWS)
    with pytest.raises(PluginError, match="set its options on the instance"):
        grpo_core.run(settings(tiny_model_dir, tmp_path / "r", plugin_options={"reward": {"length_reward": {"x": 1}}}), rows=ROWS,
                      reward=[LengthReward()])  # fmt: skip
    with pytest.raises(PluginError, match="give no rows"):
        grpo_core.run(resume=tmp_path / "r", rows=ROWS)


def test_instances_are_named_after_their_class():
    assert plugin_name(CountingRollout()) == "counting_rollout" and plugin_name(LengthReward()) == "length_reward"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(temperature=0.0), "--temperature must be > 0"),  # refused by the loop, before anything loads
        (dict(max_step=3), "unknown config key 'max_step'"),  # refused as the config is read
        (dict(reward={"reward_model": 1.0}), "reward_model: cannot load"),  # refused at the plugins' start, once models loaded
    ],
)
def test_a_refused_python_run_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch, change, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    config = {**settings(tiny_model_dir, "unused"), "plugin_options": {"reward": {"reward_model": {"model": str(tmp_path / "empty")}}}}
    del config["run_dir"]  # the default: runs/<time>, rows in runs/rows
    with pytest.raises(PluginError, match=message):
        grpo_core.run({**config, **change}, rows=ROWS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_rows_a_run_names_stay_when_another_run_on_them_is_refused(tiny_model_dir, tmp_path):
    grpo_core.run(settings(tiny_model_dir, tmp_path / "a", max_steps=1), rows=ROWS, reward=[LengthReward()])
    saved = json.loads((tmp_path / "a" / "config.json").read_text())["dataset"]
    with pytest.raises(PluginError, match="--temperature must be > 0"):
        grpo_core.run(settings(tiny_model_dir, tmp_path / "b", temperature=0.0), rows=ROWS, reward=[LengthReward()])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "rows"] and json.loads(open(saved).readline()) == ROWS[0]
