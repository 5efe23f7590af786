"""The fsdp backend's memory plan, per rank (rank 0: the widest), and its check before any rank starts."""

from __future__ import annotations

import attrs
import pytest
import torch

from grpo_core.config import RunConfig
from grpo_core.engine import memory_plan
from grpo_core.engine.memory_plan import activation_bytes, model_size
from grpo_core.errors import PluginError

SIZE = memory_plan.ModelSize(parameters=1001, trained=1001, hidden=8, layers=2, intermediate=16, q_width=8, kv_width=4, vocab=50)


def test_a_ranks_plan_shards_the_float32_state_and_gathers_the_root_and_two_layers():
    fp32 = memory_plan.sharded_plan(SIZE, 300, 2, torch.float32, 10, False, reference=True, sampler_copy=True, runtime=7)
    shard = 501  # 1001 over 2 ranks, rounded up
    assert fp32.parts == {
        "runtime": 7,
        "weights": 4 * shard,
        "gradients": 4 * shard,
        "moments": 8 * shard,
        "gathered weights": (401 + 2 * 300) * 4,  # the root (1001 - 2 layers of 300) and two layers
        "unsharded gradients": (401 + 300) * 4,
        "activations": activation_bytes(SIZE, 10, 4, False),
        "logits chunk": 10 * 50 * 4 * 4,
        "reference": shard * 4,
        "sampler copy": 1001 * 4,
    }
    assert fp32.peak == sum(fp32.parts.values()) and fp32.phase == "training"
    # bf16 computes in bf16 over float32 master weights, gradients and moments.
    bf16 = memory_plan.sharded_plan(SIZE, 300, 2, torch.bfloat16, 10, True, reference=False, sampler_copy=False)
    assert (bf16.parts["weights"], bf16.parts["gradients"], bf16.parts["moments"]) == (4 * shard, 4 * shard, 8 * shard)
    assert bf16.parts["gathered weights"] == (401 + 600) * 2 and bf16.parts["unsharded gradients"] == (401 + 300) * 4
    assert bf16.parts["activations"] == activation_bytes(SIZE, 10, 2, True)
    assert bf16.parts["reference"] == bf16.parts["sampler copy"] == bf16.parts["runtime"] == 0
    four = memory_plan.sharded_plan(SIZE, 300, 4, torch.float32, 10, False, reference=True, sampler_copy=False)
    assert four.parts["moments"] == 8 * 251 and four.parts["reference"] == 4 * 251
    offloaded = memory_plan.sharded_plan(SIZE, 300, 2, torch.bfloat16, 10, False, True, False, offload=True)
    assert offloaded.parts["weights"] == offloaded.parts["gradients"] == offloaded.parts["moments"] == 0


def test_a_layer_is_the_loaded_models_decoder_layer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    layer = loaded.model.layers[0]
    assert memory_plan.layer_parameters(tiny_model_dir) == sum(p.numel() for p in layer.parameters()) > 0


@pytest.mark.parametrize(("device", "ranks_here", "shared"), [("cpu", 2, 2), ("cpu", 3, 3), ("cuda", 2, 1)])
def test_the_ranks_that_share_a_devices_memory_are_checked_together(tiny_model_dir, monkeypatch, device, ranks_here, shared):
    """On a CPU every rank of this host is in its memory (rank 0 also holds the sampler's copy); on
    CUDA each rank has its GPU."""
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 10**15)
    config = RunConfig(model=str(tiny_model_dir), prompt_groups_per_step=2, completions_per_prompt=4, max_completion_tokens=16)
    fit = memory_plan.check_sharded_fits(config, str(tiny_model_dir), 3, ranks_here, torch.float32, torch.device(device), False, True)
    rank0 = fit.rank0
    copy = rank0.parts["sampler copy"]
    assert copy == 4 * model_size(tiny_model_dir).parameters
    assert fit.needed == rank0.peak + (shared - 1) * (rank0.peak - copy)
    # A minibatch's 8 rows over 3 ranks: 3 rows of 128 + 16 tokens on the widest.
    assert rank0.parts["activations"] == activation_bytes(model_size(tiny_model_dir), 3 * 144, 4, False)
    assert rank0.parts["runtime"] == (memory_plan.CPU_RUNTIME_BYTES if device == "cpu" else 0)
    assert fit.line().startswith(f"memory plan: peak {rank0.peak / 1e9:.2f} GB in training (")
    assert rank0.parts["reference"] == 4 * -(-model_size(tiny_model_dir).parameters // 3)
    # A loss without a KL term makes no reference (the core passes needs_reference).
    args = (str(tiny_model_dir), 3, ranks_here, torch.float32, torch.device(device), False, True)
    assert memory_plan.check_sharded_fits(config, *args, reference=False).rank0.parts["reference"] == 0


def test_an_fsdp_run_that_cannot_fit_names_what_would_and_no_memory_check_runs_it(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 1000)
    config = RunConfig(model=str(tiny_model_dir), prompt_groups_per_step=2)
    args = (str(tiny_model_dir), 2, 2, torch.float32, torch.device("cpu"), False, True)
    with pytest.raises(PluginError) as refused:
        memory_plan.check_sharded_fits(config, *args)
    said = str(refused.value)
    assert "on rank 0 (2 ranks on this host need" in said and ": cpu has 0.00 GB free. To fit, try --sampler openai" in said
    assert "--dtype bfloat16" in said and "--gradient-checkpointing" in said and "--minibatches-per-step 2" in said
    assert "more ranks" not in said  # on a CPU more ranks share the same host memory
    assert said.endswith("--no-memory-check runs it anyway")
    fit = memory_plan.check_sharded_fits(attrs.evolve(config, memory_check=False), *args)
    assert fit.needed > fit.free == 1000
    on_cuda = memory_plan.sharded_ways_to_fit(config, 2, torch.bfloat16, torch.device("cuda"), True, False, False)
    assert [w.split(" (")[0] for w in on_cuda] == ["more ranks than 2", "--backend-opt cpu_offload=true", "--minibatches-per-step 2"]
    everything_used = attrs.evolve(config, prompt_groups_per_step=1)
    assert memory_plan.sharded_ways_to_fit(everything_used, 2, torch.bfloat16, torch.device("cpu"), True, False, False) == [
        "a cpu with more free memory (every setting that lowers the plan is in use)"
    ]


def test_an_sft_steps_examples_are_shared_over_the_ranks_and_no_minibatches_are_suggested(tiny_model_dir, monkeypatch):
    from grpo_core.config import SFTConfig

    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 1000)
    config = SFTConfig(model=str(tiny_model_dir), examples_per_step=6, max_completion_tokens=16)
    assert memory_plan.rank_tokens(config, 2) == 3 * 144 and memory_plan.rank_tokens(config, 4) == 2 * 144
    with pytest.raises(PluginError) as refused:
        memory_plan.check_sharded_fits(config, str(tiny_model_dir), 2, 2, torch.float32, torch.device("cpu"), False, False)
    assert "--minibatches-per-step" not in str(refused.value) and "--gradient-checkpointing" in str(refused.value)
