"""--dynamic-sampling fills each step with groups that pass the filters; group filter plugins compose."""

from __future__ import annotations

import json
import re

import attrs
import pytest
import torch

from grpo_core import PluginError, hookimpl, selection
from grpo_core.lifecycle import RunFailed
from grpo_core.metrics import computed_only
from grpo_core.plugins_manager import PluginEntry
from grpo_core.train import run
from tests.core.tiny_runs import config, metrics_of, weights_of


def line_of(prompt) -> int:
    """The prompt's line in the test dataset (its id is ``add.jsonl:LINE``)."""
    return int(prompt.id.rsplit(":", 1)[1])


@attrs.define
class HalfFlatReward:
    """Prompts on even lines score every completion 1 (zero variance); the others by length."""

    @hookimpl
    def reward(self, prompt, samples):
        return [1.0] * len(samples) if line_of(prompt) % 2 == 0 else [len(s.text) / 10 + 0.01 * i for i, s in enumerate(samples)]


@attrs.define
class FlatReward:
    """Every completion scores 1: no group carries signal."""

    @hookimpl
    def reward(self, prompt, samples):
        return [1.0] * len(samples)


@attrs.define
class NoMultiplesOfThree:
    """A custom group filter: drops the groups of prompts on lines divisible by 3."""

    @hookimpl
    def keep_group(self, prompt, samples):
        return line_of(prompt) % 3 != 0


@attrs.define
class NotABool:
    @hookimpl
    def keep_group(self, prompt, samples):
        return 1


TRAINED: list = []


@attrs.define
class TrainedPrompts:
    """Records the lines of the prompts each step trained on (groups with advantages)."""

    @hookimpl
    def on_step(self, step, metrics, state, groups):
        TRAINED.append(sorted(line_of(g[0].prompt) for g in groups if g and g[0].advantages is not None))


@pytest.fixture(autouse=True)
def test_plugins(monkeypatch):
    original = selection.find
    ours = {
        ("reward", "half_flat"): "HalfFlatReward",
        ("reward", "flat"): "FlatReward",
        ("group_filter", "no_threes"): "NoMultiplesOfThree",
        ("group_filter", "not_a_bool"): "NotABool",
        ("logger", "trained"): "TrainedPrompts",
    }

    def find(name, kind=None):
        if (kind, name) in ours:
            return PluginEntry(kind=kind, name=name, target=f"{__name__}:{ours[kind, name]}", distribution="tests", version="0")
        return original(name, kind)

    monkeypatch.setattr(selection, "find", find)
    TRAINED.clear()


def ds_config(tiny_model_dir, tiny_dataset, run_dir, **kw):
    base = dict(
        reward=["half_flat"], drop_zero_variance_groups=True, dynamic_sampling=True, prompt_groups_per_step=2,
        max_steps=4, max_sampling_rounds=10, logger=["jsonl", "trained"],
    )  # fmt: skip
    return config(tiny_model_dir, tiny_dataset, run_dir, **{**base, **kw})


def test_every_step_trains_prompt_groups_per_step_groups_with_signal(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(ds_config(tiny_model_dir, tiny_dataset, r))
    metrics = metrics_of(r)
    assert [m["groups/kept"] for m in metrics] == [2, 2, 2, 2]
    assert all(len(lines) == 2 and all(line % 2 == 1 for line in lines) for lines in TRAINED)
    # Half the prompts have no signal: some step needed a second round, and each round asked for what was missing.
    assert any(m["sampling/rounds"] > 1 for m in metrics)
    assert all(m["sampling/prompts"] == 2 + m["groups/dropped_zero_variance"] for m in metrics)
    taken = sum(m["sampling/prompts"] for m in metrics)
    # Without it, the same reward leaves steps short.
    TRAINED.clear()
    plain = tmp_path / "plain"
    run(ds_config(tiny_model_dir, tiny_dataset, plain, dynamic_sampling=False, max_sampling_rounds=4))
    assert any(m["groups/kept"] < 2 for m in metrics_of(plain))
    assert all("sampling/rounds" not in m for m in metrics_of(plain))
    assert taken > 8


def test_max_sampling_rounds_bounds_a_step(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    # Every prompt is flat: no round ever keeps a group, and a step gives up after 3 rounds; a run
    # that trained nothing ends in an error, once its metrics and summary are written.
    with pytest.raises(PluginError, match=r"nothing was trained: all 2 steps dropped every group \(12 had equal rewards: no signal\)"):
        run(ds_config(tiny_model_dir, tiny_dataset, r, reward=["flat"], max_sampling_rounds=3, max_steps=2))
    assert json.loads((r / "summary.json").read_text())["steps"] == 2
    metrics = metrics_of(r)
    assert [m["sampling/rounds"] for m in metrics] == [3, 3]
    assert [m["sampling/prompts"] for m in metrics] == [6, 6]
    assert [m["groups/kept"] for m in metrics] == [0, 0]


def test_a_custom_group_filter_drops_what_it_should_and_filters_compose(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    run(ds_config(tiny_model_dir, tiny_dataset, r, group_filter=["no_threes"], max_steps=3))
    metrics = metrics_of(r)
    assert all(lines and all(line % 2 == 1 and line % 3 != 0 for line in lines) for lines in TRAINED)
    assert [m["groups/kept"] for m in metrics] == [2, 2, 2]
    assert sum(m["groups/dropped_no_threes"] for m in metrics) > 0
    # The zero-variance filter is asked first: a flat group on a line divisible by 3 counts there.
    assert all(
        m["sampling/prompts"] == m["groups/kept"] + m["groups/dropped_zero_variance"] + m["groups/dropped_no_threes"] for m in metrics
    )


def test_a_group_filter_in_the_async_loop(tiny_model_dir, tiny_dataset, tmp_path):
    r = tmp_path / "r"
    settings = dict(loop="async", dynamic_sampling=False, max_sampling_rounds=4, group_filter=["no_threes"], max_steps=2)
    run(ds_config(tiny_model_dir, tiny_dataset, r, **settings))
    assert all(lines and all(line % 2 == 1 and line % 3 != 0 for line in lines) for lines in TRAINED)
    assert [m["groups/kept"] for m in metrics_of(r)] == [2, 2]


def test_a_resumed_dynamic_run_takes_up_the_prompts_where_it_stopped(tiny_model_dir, tiny_dataset, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(ds_config(tiny_model_dir, tiny_dataset, whole, checkpoint_every=2))
    run(ds_config(tiny_model_dir, tiny_dataset, resumed, checkpoint_every=2, max_steps=2))
    run(ds_config(tiny_model_dir, tiny_dataset, resumed, checkpoint_every=2), resume=True)
    wa, wb = weights_of(whole), weights_of(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    drop_time = [computed_only(m) for m in metrics_of(whole)]
    assert drop_time == [computed_only(m) for m in metrics_of(resumed)]


def test_bad_settings_and_filters_are_refused(tiny_model_dir, tiny_dataset, tmp_path):
    with pytest.raises(PluginError, match="--dynamic-sampling is the async loop's own rule"):
        run(ds_config(tiny_model_dir, tiny_dataset, tmp_path / "a", loop="async"))
    with pytest.raises(RunFailed, match="keep_group must return True or False, got 1"):
        run(ds_config(tiny_model_dir, tiny_dataset, tmp_path / "b", group_filter=["not_a_bool"]))
    with pytest.raises(PluginError, match="unknown group_filter 'nope'"):
        run(ds_config(tiny_model_dir, tiny_dataset, tmp_path / "c", group_filter=["nope"]))
    with pytest.raises(ValueError, match="max_sampling_rounds must be positive"):
        ds_config(tiny_model_dir, tiny_dataset, tmp_path / "d", max_sampling_rounds=0)


@pytest.mark.parametrize(("loop", "extra"), [("sync", {}), ("async", {"synchronous_training": True})])
def test_max_sampling_rounds_where_it_bounds_nothing_is_refused(tiny_model_dir, tiny_dataset, tmp_path, loop, extra):
    with pytest.raises(PluginError, match="--max-sampling-rounds would do nothing"):
        run(ds_config(tiny_model_dir, tiny_dataset, tmp_path / "r", loop=loop, dynamic_sampling=False, **extra))


def test_the_async_loop_bounds_the_prompts_a_step_without_signal_takes_and_says_so(tiny_model_dir, tiny_dataset, tmp_path, capsys):
    r = tmp_path / "r"
    # Every prompt is flat: without the bound, step 1 would roll out the whole dataset waiting for signal.
    settings = dict(loop="async", dynamic_sampling=False, reward=["flat"], max_sampling_rounds=3, max_steps=2)
    with pytest.raises(PluginError, match=r"nothing was trained: all 2 steps dropped every group"):
        run(ds_config(tiny_model_dir, tiny_dataset, r, **settings))
    metrics = metrics_of(r)
    assert [m["groups/kept"] for m in metrics] == [0, 0]
    assert all(6 <= m["groups/dropped_zero_variance"] < 20 for m in metrics), metrics  # the dataset has 50 prompts
    err = capsys.readouterr().err
    said = r"step 1: \d prompts rolled out, 0 groups with signal of 2; sampling on, up to 6 prompts \(--max-sampling-rounds 3\)"
    assert re.search(said, err), err
