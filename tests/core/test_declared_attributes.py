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


def test_a_weight_sync_reaches_a_sampler_only_through_its_declared_attributes():
    from grpo_core.plugins.samplers.tinker import TinkerSampler
    from grpo_core.plugins.weight_sync.in_process import InProcessWeightSync
    from grpo_core.plugins.weight_sync.vllm import VLLMWeightSync

    trainer = SimpleNamespace(version=3)
    loaded = []
    sampler = SimpleNamespace(version=0, load_weights_from=lambda t: (loaded.append(t), setattr(sampler, "version", t.version)))
    assert InProcessWeightSync().weight_sync(trainer, sampler, 1) == 3 and loaded == [trainer]
    with pytest.raises(PluginError, match=r"--weight-sync in_process hands weights to a sampler in this process; a SimpleNamespace needs"):
        InProcessWeightSync().weight_sync(trainer, SimpleNamespace(version=0), 1)
    with pytest.raises(
        PluginError, match=r"SimpleNamespace.load_weights_from must be callable \| None \(declared in grpo_core.hookspecs\)"
    ):
        InProcessWeightSync().weight_sync(trainer, SimpleNamespace(load_weights_from="weights"), 1)
    # The tinker sampler holds a sampling client of its own: no server client for vllm to reload.
    tinker = TinkerSampler(tokenizer=[0, 1, 2])
    with pytest.raises(PluginError, match=r"weight sync 'vllm' needs a server sampler \(--sampler openai\): a TinkerSampler's client"):
        VLLMWeightSync().weight_sync(trainer, tinker, 1)
    with pytest.raises(PluginError, match="weight sync 'vllm' needs a server sampler"):
        VLLMWeightSync().weight_sync(trainer, SimpleNamespace(client=object()), 1)


def test_a_sampler_reaches_the_trainer_only_through_its_declared_attributes():
    from grpo_core.engine.trainer import local_policy
    from grpo_core.plugins.samplers.tinker import TinkerSamplerPlugin

    inner = SimpleNamespace()
    assert local_policy(SimpleNamespace(local_policy=lambda: inner)) is inner
    alone = SimpleNamespace()
    assert local_policy(alone) is alone
    with pytest.raises(PluginError, match=r"SimpleNamespace.local_policy must be callable \| None"):
        local_policy(SimpleNamespace(local_policy=inner))
    with pytest.raises(PluginError, match="the tinker sampler samples the tinker trainer's weights, not a SimpleNamespace's"):
        TinkerSamplerPlugin().make_sampler(None, SimpleNamespace(tokenizer=[0]))
    with pytest.raises(PluginError, match=r"SimpleNamespace.sampling_client must be callable \| None"):
        TinkerSamplerPlugin().make_sampler(None, SimpleNamespace(tokenizer=[0], sampling_client="tinker://weights"))


def test_core_decides_whether_sampling_runs_ahead_so_no_sampler_reads_the_loop():
    from pathlib import Path

    from grpo_core.config import RunConfig

    assert RunConfig().sampling_runs_ahead is False
    assert RunConfig(weight_sync_interval=2).sampling_runs_ahead is True
    assert RunConfig(loop="async").sampling_runs_ahead is True
    samplers = Path(__file__).resolve().parents[2] / "plugins" / "samplers"
    assert not [path.name for path in samplers.glob("*.py") if ".loop" in path.read_text()]


def test_no_plugin_probes_another_for_an_undeclared_attribute():
    """The plugin-to-plugin contracts are declared: no hasattr/getattr on them anywhere in plugins/."""
    import re
    from pathlib import Path

    plugins = Path(__file__).resolve().parents[2] / "plugins"
    contract = ["load_weights_from", "client", "sampling_client", "local_policy", "kl_beta", "eps_low", "eps_high", "needs_reference"]
    probe = re.compile(r"(hasattr|getattr)\([^)]*[\"'](" + "|".join(contract) + r")[\"']")
    assert [f"{path.name}:{m.group(0)}" for path in plugins.rglob("*.py") for m in probe.finditer(path.read_text())] == []
