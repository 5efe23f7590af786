from __future__ import annotations

import json

import attrs
import pytest

from grpo_core import PluginError, hookimpl, plugins_manager
from grpo_core.config import load
from grpo_core.plugins_manager import PluginEntry, catalog
from grpo_core.selection import select_plugins
from tests.helpers import grpo_core_in_process, small_run_args


def test_options_are_stored_typed_whether_from_flags_or_toml(tmp_path):
    from_flags = load(None, {"loss": ["cispo"]}, {"loss": ["eps_high=0.3"], "rollout": ["chat_template=false", "long_prompts=skip"]})
    toml = tmp_path / "run.toml"
    toml.write_text("[loss.cispo]\neps_high = 0.3\n[rollout.single_turn]\nchat_template = false\nlong_prompts = 'skip'\n")
    from_file = load(str(toml), {}, {})
    assert from_flags.plugin_options["loss"]["cispo"]["eps_high"] == "0.3"  # as typed, before selection
    select_plugins(from_flags)
    select_plugins(from_file)
    expected = {"loss": {"cispo": {"eps_high": 0.3}}, "rollout": {"single_turn": {"chat_template": False, "long_prompts": "skip"}}}
    assert from_flags.plugin_options == from_file.plugin_options == expected
    assert json.loads(json.dumps(from_flags.to_dict()))["plugin_options"] == expected
    # An integer in TOML for a float option is stored as the float it is.
    toml.write_text("[loss.cispo]\neps_high = 1\n")
    config = load(str(toml), {}, {})
    select_plugins(config)
    assert type(config.plugin_options["loss"]["cispo"]["eps_high"]) is float


def test_config_json_of_a_run_holds_typed_options(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--max-steps", "1", "--loss-opt", "kl_beta=0.01"))
    assert out.returncode == 0, out.stderr
    assert json.loads((run_dir / "config.json").read_text())["plugin_options"] == {"loss": {"grpo": {"kl_beta": 0.01}}}


def test_two_losses_are_named_as_typed():
    with pytest.raises(PluginError, match=r"^exactly one loss plugin must be selected, got 2 \(cispo, grpo\)$"):
        select_plugins(load(None, {"loss": ["cispo", "grpo"]}, {}))
    with pytest.raises(PluginError, match=r"^exactly one loss plugin must be selected, got 0 \(none; tis only wraps one\)$"):
        select_plugins(load(None, {"loss": ["tis"]}, {}))


@attrs.define
class Silent:
    """A reward that says nothing about answers (so needs none)."""

    @hookimpl
    def reward(self, prompt, samples):
        return [1.0 for _ in samples]


@attrs.define
class NeedsAnswer(Silent):
    needs_answer = True


@attrs.define
class NoAnswer(Silent):
    needs_answer = False


@pytest.fixture
def test_rewards(monkeypatch):
    extra = tuple(
        PluginEntry("reward", name, target, "grpo-test-rewards", "0.1")
        for name, target in [
            ("misspelled", "tests.core.test_plugins_manager:_Misspelled"),
            ("exact", "tests.core.test_selection:NeedsAnswer"),
            ("shape", "tests.core.test_selection:NoAnswer"),
            ("silent", "tests.core.test_selection:Silent"),
        ]
    )
    builtins = catalog()
    monkeypatch.setattr(plugins_manager, "catalog", lambda: builtins + extra)


def test_an_invalid_plugin_is_refused_before_anything_is_made(test_rewards):
    with pytest.raises(PluginError) as err:
        select_plugins(load(None, {"reward": ["misspelled"], "model": "/no/such/model"}, {}))
    assert str(err.value) == (
        "reward plugin 'misspelled' from grpo-test-rewards 0.1 (tests.core.test_plugins_manager:_Misspelled) cannot be used: "
        "method 'rewards' is marked @hookimpl but no hook has that name (did you mean 'reward'?); "
        "a reward plugin must implement @hookimpl def reward(self, prompt, samples) (missing: reward)"
    )


def test_rewards_needing_an_answer_are_those_that_say_so(test_rewards):
    selection = select_plugins(load(None, {"reward": ["exact", "shape:0.1", "silent"]}, {}))
    assert selection.rewards_needing_answer == ["exact"]
    assert select_plugins(load(None, {"reward": ["shape", "silent"]}, {})).rewards_needing_answer == []


def test_an_environment_and_tools_reach_the_rollout():
    selection = select_plugins(load(None, {"rollout": "multi_turn", "env": "retry_math", "tool": ["calculator"]}, {"env": ["max_turns=2"]}))
    assert [r.name for r in selection.rewards] == ["env"]
    assert selection.rewards_needing_answer == ["retry_math (environment)"]
    args = selection.rollout_args
    assert list(args["tools"]) == ["calculator"] and args["tools"]["calculator"] is selection.plugins["tool"][0]
    from grpo_core import Prompt

    episode = args["env"](Prompt(id="p", text="Question: 1 + 1?\nAnswer:", answer="2"))
    assert episode.messages == [{"role": "user", "content": "Question: 1 + 1?\nAnswer:"}]
    assert episode.step(" 3", []).done is False and episode.step(" 3", []).done is True  # max_turns=2 reached the episode
    plain = select_plugins(load(None, {}, {}))
    assert plain.rollout_args == {"env": None, "tools": {}} and plain.rewards_needing_answer == ["gsm8k"]


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"env": "retry_math"},
            "rollout 'single_turn' does not take an environment, so --env would do nothing: choose a multi-turn rollout",
        ),
        ({"tool": ["calculator"]}, "rollout 'single_turn' does not take tools, so --tool would do nothing"),
        ({"rollout": "multi_turn", "reward": ["env"]}, "reward env scores what an environment gave: select one with --env NAME"),
        ({"rollout": "multi_turn", "env": "retry_mat"}, "unknown env 'retry_mat'; did you mean 'retry_math'?"),
    ],
)
def test_an_environment_or_tools_that_could_not_work_are_refused(values, message):
    with pytest.raises(PluginError, match=message):
        select_plugins(load(None, values, {}))


@attrs.define
class NamedTool:
    """A tool whose spec says its name."""

    name: str = "calculator"

    @hookimpl
    def tool_spec(self):
        return {"name": self.name} if self.name else {"description": "no name"}

    @hookimpl
    def tool_call(self, arguments):
        return "ok"


@attrs.define
class NamelessTool(NamedTool):
    name: str = ""


def test_tools_are_known_by_the_names_in_their_specs(monkeypatch):
    extra = (
        PluginEntry("tool", "calc2", "tests.core.test_selection:NamedTool", "grpo-test-tools", "0.1"),
        PluginEntry("tool", "nameless", "tests.core.test_selection:NamelessTool", "grpo-test-tools", "0.1"),
    )
    builtins = catalog()
    monkeypatch.setattr(plugins_manager, "catalog", lambda: builtins + extra)
    with pytest.raises(PluginError, match="tools 'calc2' and another selected tool are both called 'calculator'"):
        select_plugins(load(None, {"rollout": "multi_turn", "tool": ["calculator", "calc2"]}, {}))
    with pytest.raises(
        PluginError, match=r"tool 'nameless': tool_spec\(\) must return a dict with a non-empty 'name', got \{'description': 'no name'\}"
    ):
        select_plugins(load(None, {"rollout": "multi_turn", "tool": ["nameless"]}, {}))
    assert list(
        select_plugins(load(None, {"rollout": "multi_turn", "tool": ["calc2", "nameless"]}, {"tool": ["nameless.name=other"]})).tools
    ) == [
        "calculator",
        "other",
    ]


@pytest.mark.parametrize(
    ("loop", "mode"), [(["--loop", "sync"], "--loop sync"), (["--loop", "async", "--synchronous-training"], "--synchronous-training")]
)
def test_per_trajectory_is_refused_where_a_step_rolls_out_its_batch_in_one_call(
    tiny_model_dir, tiny_dataset, tmp_path, monkeypatch, loop, mode
):
    from grpo_core.plugins.backends import local

    monkeypatch.setattr(local, "load_model", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    args = small_run_args(
        tiny_model_dir, tiny_dataset, tmp_path / "r", "--rollout", "multi_turn", "--rollout-opt", "per_trajectory=true", *loop
    )
    out = grpo_core_in_process(*args)
    assert out.returncode == 1
    assert (
        f"error: --rollout-opt per_trajectory=true makes the async loop roll out each conversation as its own task; {mode} rolls out a "
        "step's batch in one call, so it would do nothing: drop it, or use --loop async without --synchronous-training"
    ) in out.stderr
    # false, or the async loop's own scheduling, is taken.
    config = load(None, {"rollout": "multi_turn"}, {"rollout": ["per_trajectory=false"]})
    select_plugins(config)
    config = load(None, {"rollout": "multi_turn", "loop": "async"}, {"rollout": ["per_trajectory=true"]})
    assert select_plugins(config).plugins["rollout"][0].per_trajectory is True
