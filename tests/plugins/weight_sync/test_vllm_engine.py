"""Weight sync vllm_engine without vLLM: a real local trainer, a fake engine sampler that keeps
what it is given and scores with the trainer's model (the real engine: tests/integration/test_vllm_in_process.py)."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
import tinker
import torch

from grpo_core import PluginError, Prompt, Sample
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.engine.lora import merged_state_dict
from grpo_core.metrics import scope
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.weight_sync.vllm import WeightSyncMismatch
from grpo_core.plugins.weight_sync.vllm_engine import VLLMEngineWeightSync, module_group, policy_weights


@attrs.define
class FakeEngineSampler:
    """What the sync reads of the vllm sampler: load_weights, prompt_logprobs, version, max_context."""

    trainer: object
    offset: float = 0.0
    """Added to every engine logprob: a stale engine."""
    offsets: list[float] = attrs.field(factory=list)
    """Per load, replacing ``offset`` (a repair that helps)."""
    version: int = 0
    max_context: int | None = 256
    loads: list[dict[str, torch.Tensor]] = attrs.field(factory=list)
    given: list = attrs.field(factory=list)
    """Each ``weights`` callable, which the vllm sampler keeps to load again after a level-2 sleep."""

    def load_weights(self, weights, max_staged_bytes):
        self.given.append(weights)
        loaded = {name: tensor.detach().clone() for name, tensor in weights()}
        self.loads.append(loaded)
        if self.offsets:
            self.offset = self.offsets.pop(0)
        return sum(t.numel() * t.element_size() for t in loaded.values())

    def prompt_logprobs(self, tokens):
        sample = Sample(Prompt(id="p", text=""), tokens, [0.0] * len(tokens), [1.0] * len(tokens), "", "length", 0)
        return [0.0] + [x + self.offset for x in self.trainer.forward([sample_to_datum(sample)])[0].tolist()]


def optimizer_step(trainer) -> None:
    tokens = trainer.tokenizer.encode("Question: what is 2 plus 3?\nAnswer: 2 + 3 = 5")
    sample = Sample(Prompt(id="p", text=""), tokens, [0.0] * len(tokens), [1.0] * len(tokens), "", "length", trainer.version)
    trainer.forward_backward_custom([sample_to_datum(sample)], lambda datums, logprobs: (-logprobs[0].mean(), {}))
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-2))


@pytest.fixture
def trainer(tiny_model_dir):
    return LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir)))


@pytest.fixture
def lora_trainer(tiny_model_dir):
    return LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir), lora_rank=4))


def test_a_full_sync_loads_every_weight_from_memory_and_records_bytes_and_seconds(trainer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    optimizer_step(trainer)
    sampler = FakeEngineSampler(trainer)
    with scope() as recorded:
        assert VLLMEngineWeightSync().weight_sync(trainer=trainer, sampler=sampler, step=1) == 1
    state = trainer.model.state_dict()
    (loaded,) = sampler.loads
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert recorded["sync/bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert recorded["sync/seconds"] > 0 and recorded["time/weight_sync"] >= recorded["sync/seconds"]
    assert recorded["sync/logprob_max_abs_diff"] < 1e-6 and recorded["sync/repairs"] == 0.0
    assert sampler.version == 1
    assert list(tmp_path.iterdir()) == []  # no file written


def test_a_tied_output_layer_is_sent_under_its_own_name(tmp_path):
    from transformers import AutoConfig, Qwen3ForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    config.update({"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True})
    model = Qwen3ForCausalLM(config)
    names = dict(policy_weights(SimpleNamespace(model=model)))
    assert names["lm_head.weight"].data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_lora_sync_sends_the_merged_modules_that_hold_adapters_and_nothing_else(lora_trainer):
    optimizer_step(lora_trainer)
    sampler = FakeEngineSampler(lora_trainer)
    VLLMEngineWeightSync().weight_sync(trainer=lora_trainer, sampler=sampler, step=1)
    (loaded,) = sampler.loads
    merged = merged_state_dict(lora_trainer.model)
    adapted_groups = {module_group(k) for k in merged if any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj"))}
    assert adapted_groups <= {module_group(k) for k in loaded}
    # Whole modules: every weight of a group the adapters touch, merged where adapted.
    for group in {module_group(k) for k in loaded}:
        assert {k for k in merged if module_group(k) == group} <= loaded.keys()
    assert all(torch.equal(loaded[k], merged[k]) for k in loaded)
    assert "model.embed_tokens.weight" not in loaded and "lm_head.weight" not in loaded
    # The merged weights moved with training: the adapters are in them.
    base_q = next(k for k in loaded if k.endswith("self_attn.q_proj.weight"))
    assert not torch.equal(loaded[base_q], lora_trainer.model.state_dict()[base_q.replace("q_proj.weight", "q_proj.base_layer.weight")])


def test_a_mismatch_is_repaired_once_then_stops_the_run(trainer):
    optimizer_step(trainer)
    repaired = FakeEngineSampler(trainer, offset=0.5, offsets=[0.5, 0.0])
    with scope() as recorded:
        VLLMEngineWeightSync().weight_sync(trainer=trainer, sampler=repaired, step=1)
    assert len(repaired.loads) == 2 and recorded["sync/repairs"] == 1.0 and recorded["sync/logprob_max_abs_diff"] < 1e-6
    assert recorded["sync/bytes"] == 2 * sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())

    stale = FakeEngineSampler(trainer, offset=0.5)
    with pytest.raises(WeightSyncMismatch, match=r"differ from the trainer's by up to 0\.5 .*also after loading the weights again"):
        VLLMEngineWeightSync().weight_sync(trainer=trainer, sampler=stale, step=1)
    assert len(stale.loads) == 2 and stale.version == 0

    stopped = FakeEngineSampler(trainer, offset=0.5)
    with pytest.raises(WeightSyncMismatch, match="tolerance 0.001"):
        VLLMEngineWeightSync(on_mismatch="stop").weight_sync(trainer=trainer, sampler=stopped, step=1)
    assert len(stopped.loads) == 1


def test_weights_kept_for_a_reload_refuse_a_trainer_that_moved_on(trainer):
    sampler = FakeEngineSampler(trainer)
    VLLMEngineWeightSync().weight_sync(trainer=trainer, sampler=sampler, step=0)
    (kept,) = sampler.given
    assert dict(kept()).keys() == trainer.model.state_dict().keys()  # the same version: loaded again
    optimizer_step(trainer)
    with pytest.raises(PluginError, match="weights of version 0 .* now holds version 1"):
        kept()


def test_a_sampler_without_an_engine_in_this_process_is_refused(trainer):
    with pytest.raises(PluginError, match="--sampler vllm"):
        VLLMEngineWeightSync().weight_sync(trainer=trainer, sampler=SimpleNamespace(version=0), step=1)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"chunk_mib": 0}, "chunk_mib must be >= 1"), ({"tolerance": 0.0}, "tolerance must be > 0"), ({"probe_tokens": 1}, "probe_tokens")],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        VLLMEngineWeightSync(**options)
