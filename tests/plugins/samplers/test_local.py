"""The sampler is chosen apart from the trainer: --sampler, else the backend's default."""

from __future__ import annotations

import pytest

from grpo_core.config import RunConfig
from grpo_core.plugins.samplers.local import LocalSampler, LocalSamplerPlugin
from grpo_core.plugins_manager import PluginError
from grpo_core.selection import select_plugins


def test_the_backend_names_the_default_sampler_and_sampler_options_reach_it(tiny_model_dir):
    config = RunConfig(model=str(tiny_model_dir), plugin_options={"sampler": {"local": {"batch_size": "16"}}})
    selection = select_plugins(config)
    (plugin,) = selection.plugins["sampler"]
    assert isinstance(plugin, LocalSamplerPlugin) and plugin.batch_size == 16
    trainer = selection.manager.hook.make_trainer(config=config)
    sampler = selection.manager.hook.make_sampler(config=config, trainer=trainer)
    assert isinstance(sampler, LocalSampler) and sampler.batch_size == 16 and sampler.model is trainer.model


def test_sampling_ahead_uses_a_copy_of_its_own(tiny_model_dir):
    config = RunConfig(model=str(tiny_model_dir), weight_sync_interval=2)
    selection = select_plugins(config)
    trainer = selection.manager.hook.make_trainer(config=config)
    sampler = selection.manager.hook.make_sampler(config=config, trainer=trainer)
    assert sampler.own_weights and sampler.model is not trainer.model
    assert "model" in sampler.state_dict()


def test_an_unknown_sampler_and_a_trainer_it_cannot_use_are_clear_errors(tiny_model_dir):
    with pytest.raises(PluginError, match="unknown sampler 'vlm'"):
        select_plugins(RunConfig(model=str(tiny_model_dir), sampler="vlm"))
    with pytest.raises(PluginError, match="the local sampler needs the local trainer's model, not a object"):
        LocalSamplerPlugin().make_sampler(config=RunConfig(), trainer=object())
