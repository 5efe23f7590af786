"""The sampler is chosen apart from the trainer: --sampler, else the backend's default."""

from __future__ import annotations

import pytest

from grpo_core.config import RunConfig
from grpo_core.errors import PluginError
from grpo_core.plugins.samplers.local import LocalSampler, LocalSamplerPlugin
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


def test_a_lora_samplers_own_copy_checkpoints_and_syncs_the_adapters_only(tiny_model_dir):
    import torch

    from grpo_core.plugins.backends.local import LocalBackend

    cfg = RunConfig(model=str(tiny_model_dir), lora_rank=4, weight_sync_interval=2)
    trainer = LocalBackend().make_trainer(config=cfg)
    sampler = LocalSamplerPlugin().make_sampler(config=cfg, trainer=trainer)
    state = sampler.state_dict()
    assert state["model"] and all("lora_" in k for k in state["model"])
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(1.0)
    sampler.load_weights_from(trainer)
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), sampler.model.parameters()))
    sampler.load_state_dict(state)
    assert all(float(p.abs().max()) == 0 for n, p in sampler.model.named_parameters() if "lora_B" in n)
