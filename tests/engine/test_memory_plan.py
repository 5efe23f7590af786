from __future__ import annotations

import pytest
import torch

from grpo_core.config import RunConfig
from grpo_core.engine import memory_plan
from grpo_core.engine.memory_plan import activation_bytes, model_size, plan, ways_to_fit
from grpo_core.engine.optim import SLICE_ELEMENTS


def test_the_parameter_count_from_config_json_alone_is_the_loaded_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    size = model_size(tiny_model_dir)
    assert size.parameters == size.trained == sum(p.numel() for p in loaded.parameters())
    assert (size.hidden, size.layers, size.vocab) == (loaded.config.hidden_size, loaded.config.num_hidden_layers, loaded.config.vocab_size)
    lora = model_size(tiny_model_dir, lora_rank=4)
    # The adapters train; the base model is still held.
    assert 0 < lora.trained < size.parameters and lora.parameters == size.parameters + lora.trained


def test_the_peak_adds_what_each_phase_holds(tiny_model_dir):
    size = model_size(tiny_model_dir)
    p = size.parameters
    fp32 = plan(size, torch.float32, "fp32", 100, False, None, False)
    assert fp32.phase == "training"
    assert fp32.parts["weights"] == fp32.parts["gradients"] == 4 * p and fp32.parts["moments"] == 8 * p
    assert fp32.peak == sum(fp32.parts.values())
    bf16 = plan(size, torch.bfloat16, "8bit", 100, False, None, False)
    assert bf16.parts["weights"] == 2 * p and bf16.parts["moments"] == int(p * (2 + 8 / 256))
    # The packed step's float32 buffers (weights, gradients, two moments) and its noise table, kept
    # from step to step: in every phase, not only the step's.
    step = plan(size, torch.bfloat16, "bf16", 100, False, None, False)
    assert step.phase == "training" and step.parts["optimizer buffers"] == min(p, SLICE_ELEMENTS) * 16 + SLICE_ELEMENTS * 4
    assert step.peak == sum(step.parts.values())
    assert fp32.parts["optimizer buffers"] == 0  # torch's fused AdamW: no buffers
    # The compiled step updates bf16 weights in place: no buffers, no table; other moments still pack.
    assert plan(size, torch.bfloat16, "fp32", 100, False, None, False, optimizer_kernel="compiled").parts["optimizer buffers"] == 0
    eager = plan(size, torch.bfloat16, "fp32", 100, False, None, False, optimizer_kernel="eager")
    assert eager.parts["optimizer buffers"] == min(p, SLICE_ELEMENTS) * 8 + SLICE_ELEMENTS * 4
    # Float32 weights with 8-bit moments round nothing: no noise table.
    assert plan(size, torch.float32, "8bit", 100, False, None, False).parts["optimizer buffers"] == min(p, SLICE_ELEMENTS) * 16
    resident = plan(size, torch.float32, "fp32", 100, False, "memory", True)
    assert resident.peak - fp32.peak == 2 * 4 * p  # the reference and the sampler's copy
    assert resident.parts["reference"] == resident.parts["sampler copy"] == 4 * p
    # A background checkpoint's copy: the trained weights and the moments, as they are kept.
    writing = plan(size, torch.bfloat16, "8bit", 100, False, None, False, checkpoint_copy=True)
    assert writing.parts["checkpoint copy"] == 2 * p + bf16.parts["moments"]
    assert writing.peak - bf16.peak == writing.parts["checkpoint copy"]


@pytest.mark.parametrize(
    ("device", "checkpoint_every", "max_steps", "counted"),
    [("cpu", 50, None, True), ("cpu", 2, 3, True), ("cpu", 0, None, False), ("cpu", 5, 5, False), ("cuda", 2, None, False)],
    ids=["cpu-default", "cpu-periodic", "cpu-end-only", "cpu-no-step-before-the-end", "cuda-host-memory"],
)
def test_a_cpu_runs_periodic_checkpoints_count_their_copy(tiny_model_dir, monkeypatch, device, checkpoint_every, max_steps, counted):
    """Periodic checkpoints are written in the background from a copy; the end's is written in place."""
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 10**15)
    config = RunConfig(model=str(tiny_model_dir), checkpoint_every=checkpoint_every, max_steps=max_steps)
    memory = memory_plan.check_fits(config, str(tiny_model_dir), torch.float32, torch.device(device), None, False)
    assert (memory.parts["checkpoint copy"] == 12 * model_size(tiny_model_dir).parameters) is counted
    # A CPU process's own first forward and backward; CUDA's context is outside the free memory read.
    assert memory.parts["runtime"] == (memory_plan.CPU_RUNTIME_BYTES if device == "cpu" else 0)


def test_checkpointing_keeps_one_layer_of_activations_and_the_inputs(tiny_model_dir):
    size = model_size(tiny_model_dir)
    full, kept = activation_bytes(size, 1000, 4, False), activation_bytes(size, 1000, 4, True)
    assert full == 1000 * 4 * size.layers * (6 * size.hidden + 3 * size.q_width + 4 * size.kv_width + 4 * size.intermediate)
    assert kept == full // size.layers + 1000 * 4 * size.layers * size.hidden
    assert activation_bytes(size, 2000, 4, False) == 2 * full


def test_the_ways_to_fit_are_only_those_that_lower_the_estimate(tiny_model_dir):
    size = model_size(tiny_model_dir)
    cpu = torch.device("cpu")
    everything = ways_to_fit(RunConfig(model=str(tiny_model_dir)), size, torch.float32, cpu, checkpointing=False)
    assert [w.split(" (")[0] for w in everything] == [
        "--lora-rank 16", "--optimizer-state bf16/8bit", "--dtype bfloat16", "--gradient-checkpointing", "--backend fsdp",
    ]  # fmt: skip
    config = RunConfig(model=str(tiny_model_dir), lora_rank=8, optimizer_state="8bit", gradient_checkpointing=True)
    assert [w.split(" (")[0] for w in ways_to_fit(config, size, torch.bfloat16, cpu, checkpointing=True)] == ["--backend fsdp"]
    on_cuda = ways_to_fit(RunConfig(model=str(tiny_model_dir)), size, torch.bfloat16, torch.device("cuda"), checkpointing=True)
    assert "--optimizer-state bf16/8bit/offload (moments: 4, 2.03125, 0 B per parameter)" in on_cuda


def test_free_memory_on_a_cpu_is_memavailable(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemFree:  10 kB\nMemAvailable:  42 kB\n")
    real_path = memory_plan.Path
    monkeypatch.setattr(memory_plan, "Path", lambda p: meminfo if p == "/proc/meminfo" else real_path(p))
    assert memory_plan.free_memory(torch.device("cpu")) == 42 * 1024
    meminfo.write_text("MemTotal:  100 kB\n")
    with pytest.raises(OSError, match="no MemAvailable"):
        memory_plan.free_memory(torch.device("cpu"))
