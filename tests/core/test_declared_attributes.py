"""The attributes core reads from plugins are declared in hookspecs, read through one helper and
checked like a misspelled hook."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest

from grpo_core import hookimpl, option
from grpo_core.errors import PluginError
from grpo_core.hookspecs import ATTRIBUTES, declared
from grpo_core.plugins_manager import catalog, plugin_problems


@attrs.define
class Reward:
    @hookimpl
    def reward(self, prompt, samples):
        return [1.0 for _ in samples]


def test_a_declared_attribute_of_another_type_is_a_problem_of_the_class():
    wrong = type("Wrong", (Reward,), {"needs_answer": "yes"})
    assert plugin_problems("reward", wrong, "reward.wrong") == [
        "attribute 'needs_answer' must be bool (declared in grpo_core.hookspecs), got 'yes'"
    ]
    right = type("Right", (Reward,), {"needs_answer": True, "needs_env": False})
    assert plugin_problems("reward", right, "reward.right") == []


def test_an_option_with_a_default_of_another_type_is_a_problem_and_a_property_is_read_on_the_instance():
    @attrs.define
    class Rollout:
        per_trajectory: str = option("no", help="wrongly typed")

        @property
        def long_prompts(self) -> str:
            return "skip"

        def encode(self, tokenizer, prompt):
            return [1]

        @hookimpl
        def rollout(self, prompts, num_samples, sampler, params):
            return []

    assert plugin_problems("rollout", Rollout, "rollout.r") == [
        "attribute 'per_trajectory' must be bool (declared in grpo_core.hookspecs), got 'no'"
    ]
    rollout = Rollout()
    assert declared(rollout, "rollout", "long_prompts") == "skip"
    assert declared(rollout, "rollout", "encode")(None, None) == [1]
    with pytest.raises(PluginError, match=r"Rollout.per_trajectory must be bool \(declared in grpo_core.hookspecs\), got 'no'"):
        declared(rollout, "rollout", "per_trajectory")


def test_an_attribute_not_set_reads_as_its_declared_default():
    nothing = SimpleNamespace()
    assert declared(nothing, "rollout", "per_trajectory") is False
    assert declared(nothing, "rollout", "long_prompts") == "error"
    assert declared(nothing, "backend", "default_sampler") == "local"
    assert declared(nothing, "sampler", "default_weight_sync") is None
    assert declared(nothing, "sampler object", "concurrent_samples") == 1
    assert declared(nothing, "sampler object", "own_weights") is True
    assert declared(nothing, "sampler object", "stateless") is False
    assert declared(nothing, "trainer object", "run_info") == {} and declared(nothing, "sampler object", "run_info") == {}
    assert declared(SimpleNamespace(run_info={"forward": "mine"}), "trainer object", "run_info") == {"forward": "mine"}
    with pytest.raises(PluginError, match=r"run_info must be dict\[str, str\]"):
        declared(SimpleNamespace(run_info={"padding_free": 1.0}), "trainer object", "run_info")
    assert declared(SimpleNamespace(concurrent_samples=4), "sampler object", "concurrent_samples") == 4
    with pytest.raises(PluginError, match="concurrent_samples must be int"):
        declared(SimpleNamespace(concurrent_samples=True), "sampler object", "concurrent_samples")


def test_every_built_in_plugin_keeps_the_contract_and_the_servers_say_they_keep_no_state():
    for entry in catalog():
        assert plugin_problems(entry.kind, entry.load(), entry.qualified_name) == [], entry.qualified_name
    from grpo_core.plugins.samplers.local import LocalSampler
    from grpo_core.plugins.samplers.openai import ServerSampler
    from grpo_core.plugins.samplers.tinker import TinkerSampler

    assert ServerSampler.stateless is True and TinkerSampler.stateless is True
    assert declared(LocalSampler, "sampler object", "stateless") is False and hasattr(LocalSampler, "load_state_dict")


def test_every_declared_attribute_is_documented():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "writing-plugins.md").read_text()
    for kind, attributes in ATTRIBUTES.items():
        for name, attribute in attributes.items():
            assert f"`{name}`" in page, (kind, name)
            assert attribute.accepts(attribute.default), (kind, name)
