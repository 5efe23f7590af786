from __future__ import annotations

import re

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
    memory = memory_plan.check_fits(config, str(tiny_model_dir), torch.float32, torch.device(device), None, False).plan
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
    everything = ways_to_fit(RunConfig(model=str(tiny_model_dir), optimizer_state="fp32"), size, torch.float32, cpu, checkpointing=False)
    assert [w.split(" (")[0] for w in everything] == [
        "--lora-rank 16", "--optimizer-state bf16/8bit", "--dtype bfloat16", "--gradient-checkpointing", "--backend fsdp",
    ]  # fmt: skip
    config = RunConfig(model=str(tiny_model_dir), lora_rank=8, optimizer_state="8bit", gradient_checkpointing=True)
    assert [w.split(" (")[0] for w in ways_to_fit(config, size, torch.bfloat16, cpu, checkpointing=True)] == ["--backend fsdp"]
    fp32 = RunConfig(model=str(tiny_model_dir), optimizer_state="fp32")
    on_cuda = ways_to_fit(fp32, size, torch.bfloat16, torch.device("cuda"), checkpointing=True)
    assert "--optimizer-state bf16/8bit/offload (moments: 4, 2.03125, 0 B per parameter)" in on_cuda
    # auto has tried every form of the moments before it refuses.
    auto = ways_to_fit(RunConfig(model=str(tiny_model_dir)), size, torch.bfloat16, torch.device("cuda"), checkpointing=True)
    assert not any(w.startswith("--optimizer-state") for w in auto) and auto[0].startswith("--lora-rank 16")


def test_free_memory_on_a_cpu_is_memavailable(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemFree:  10 kB\nMemAvailable:  42 kB\n")
    real_path = memory_plan.Path
    monkeypatch.setattr(memory_plan, "Path", lambda p: meminfo if p == "/proc/meminfo" else real_path(p))
    assert memory_plan.free_memory(torch.device("cpu")) == 42 * 1024
    meminfo.write_text("MemTotal:  100 kB\n")
    with pytest.raises(OSError, match="no MemAvailable"):
        memory_plan.free_memory(torch.device("cpu"))


QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "num_key_value_heads": 8,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}  # fmt: skip
SHAPES = {
    "0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "intermediate_size": 3072,
        "tie_word_embeddings": True,
    },
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
}
GIB = 2**30


@pytest.fixture
def qwen3_folders(tmp_path):
    """config.json alone of Qwen3-0.6B's and Qwen3-8B's shapes (the plan builds them on the meta device)."""
    import json

    folders = {}
    for name, shape in SHAPES.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**QWEN3, **shape}))
        folders[name] = str(tmp_path / name)
    return folders


@pytest.mark.parametrize(
    ("shape", "moments", "checkpointing", "measured_gib"),
    [("0.6b", "fp32", True, 10.31), ("0.6b", "fp32", False, 44.9), ("8b", "fp32", True, 95.0), ("8b", "bf16", True, 64.8)],
)
def test_the_cuda_plan_is_within_ten_percent_of_the_measured_h200_peaks(qwen3_folders, shape, moments, checkpointing, measured_gib):
    """benchmarks/gpu.py's short workload on an H200 (2026-11-28: 64 rows of 32 + 256 tokens, bf16, no KL
    reference, the compiled optimizer step with fp32 moments): the runs' own perf/peak_memory_gib."""
    size = model_size(qwen3_folders[shape])
    kernel = "compiled" if moments == "fp32" else "eager"
    estimate = plan(size, torch.bfloat16, moments, 64 * 288, checkpointing, None, False, optimizer_kernel=kernel, device_type="cuda")
    assert 0.9 <= estimate.peak / GIB / measured_gib <= 1.1, estimate.line()
    # Summing activations and gradients (what a CPU's RSS keeps) lands further off.
    summed = plan(size, torch.bfloat16, moments, 64 * 288, checkpointing, None, False, optimizer_kernel=kernel)
    assert abs(summed.peak / GIB - measured_gib) > abs(estimate.peak / GIB - measured_gib)


def bench_config(folder, **settings):
    """benchmarks/gpu.py's short workload: 8 prompts x 8 completions of 256 tokens, no KL term."""
    return RunConfig(model=folder, prompt_groups_per_step=8, completions_per_prompt=8, max_completion_tokens=256, **settings)


@pytest.mark.parametrize(
    ("free_gb", "moments", "checkpointing"),
    [(140, "fp32", True), (85, "bf16", True), (65, "8bit", True), (45, "offload", True)],
    ids=["h200", "h100-80gb", "65gb", "45gb"],
)
def test_auto_moments_are_the_most_exact_whose_plan_fits_with_headroom(qwen3_folders, free_gb, moments, checkpointing):
    cuda = torch.device("cuda")
    fit = memory_plan.check_fits(
        bench_config(qwen3_folders["8b"]), qwen3_folders["8b"], torch.bfloat16, cuda, None, None, "compiled", free_gb * 10**9
    )
    assert (fit.optimizer_state, fit.checkpointing) == (moments, checkpointing)
    assert fit.plan.peak <= 0.9 * free_gb * 10**9
    assert fit.optimizer_why.startswith("auto: ")
    if moments != "fp32":
        assert re.search(
            rf"fp32 moments' plan peaks at [\d.]+ GB, over 90% of {free_gb}.00 GB free on the cuda; {moments}'s at", fit.optimizer_why
        )
    assert re.match(r"on \(without it the plan peaks at [\d.]+ GB, over 90% of", fit.checkpointing_why), fit.checkpointing_why


def test_checkpointing_is_off_where_the_plan_fits_without_it(qwen3_folders):
    cuda = torch.device("cuda")
    fit = memory_plan.check_fits(
        bench_config(qwen3_folders["0.6b"]), qwen3_folders["0.6b"], torch.bfloat16, cuda, None, None, "compiled", 140 * 10**9
    )
    assert (fit.optimizer_state, fit.checkpointing) == ("fp32", False)
    assert fit.checkpointing_why.startswith("off (the memory plan fits without it: peak")
    # Asked for, it stays on; a tight device turns it on.
    asked = memory_plan.check_fits(
        bench_config(qwen3_folders["0.6b"]), qwen3_folders["0.6b"], torch.bfloat16, cuda, None, True, "compiled", 140 * 10**9
    )
    assert asked.checkpointing and asked.checkpointing_why == "on (--gradient-checkpointing)"
    tight = memory_plan.check_fits(
        bench_config(qwen3_folders["0.6b"]), qwen3_folders["0.6b"], torch.bfloat16, cuda, None, None, "compiled", 24 * 10**9
    )
    assert (tight.optimizer_state, tight.checkpointing) == ("fp32", True)


def test_an_explicit_choice_that_cannot_fit_is_refused_naming_what_would(qwen3_folders):
    from grpo_core.errors import PluginError

    cuda = torch.device("cuda")
    config = bench_config(qwen3_folders["8b"], optimizer_state="fp32", gradient_checkpointing=True)
    with pytest.raises(PluginError) as refused:
        memory_plan.check_fits(config, qwen3_folders["8b"], torch.bfloat16, cuda, None, True, "compiled", 85 * 10**9)
    said = str(refused.value)
    assert re.search(r"cuda has 85.00 GB free\. --optimizer-state bf16 \(peak [\d.]+ GB\) or --optimizer-state 8bit \(peak [\d.]+ GB\) or "
                     r"--optimizer-state offload \(peak [\d.]+ GB\) would fit\. To fit, try --lora-rank 16", said), said  # fmt: skip
    # Nothing fits: auto refuses too, without moments to suggest (it tried them all).
    with pytest.raises(PluginError, match=r"cuda has 10.00 GB free\. To fit, try --lora-rank 16") as nothing:
        memory_plan.check_fits(
            bench_config(qwen3_folders["8b"]), qwen3_folders["8b"], torch.bfloat16, cuda, None, None, "compiled", 10 * 10**9
        )
    assert "--optimizer-state" not in str(nothing.value)
    # --no-memory-check: auto is fp32, unplanned checkpointing on.
    unchecked = bench_config(qwen3_folders["8b"], memory_check=False)
    fit = memory_plan.check_fits(unchecked, qwen3_folders["8b"], torch.bfloat16, cuda, None, None, "compiled", 10 * 10**9)
    assert (fit.optimizer_state, fit.checkpointing) == ("fp32", True) and "--no-memory-check" in fit.optimizer_why


def test_a_kl_reference_is_counted_only_where_the_loss_uses_one(qwen3_folders):
    cuda = torch.device("cuda")
    config = bench_config(qwen3_folders["8b"])
    without = memory_plan.check_fits(config, qwen3_folders["8b"], torch.bfloat16, cuda, None, None, "compiled", 140 * 10**9)
    resident = memory_plan.check_fits(config, qwen3_folders["8b"], torch.bfloat16, cuda, "memory", None, "compiled", 140 * 10**9)
    assert resident.plan.parts["reference"] == model_size(qwen3_folders["8b"]).parameters * 2
    assert "reference" not in without.plan.parts
    # The 8B plan that counted a reference the loss did not use chose fp32 either way on an H200; on 85 GB it costs a form.
    assert (
        memory_plan.check_fits(config, qwen3_folders["8b"], torch.bfloat16, cuda, "memory", None, "compiled", 85 * 10**9).optimizer_state
        == "8bit"
    )


def test_the_local_backend_counts_a_reference_only_for_a_loss_that_uses_one(tiny_model_dir, capsys):
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.selection import select_plugins

    config = RunConfig(model=str(tiny_model_dir), plugin_options={"loss": {"grpo": {"kl_beta": 0}}})
    selection = select_plugins(config)
    assert not selection.needs_reference
    selection.manager.hook.make_trainer(config=config, needs_reference=selection.needs_reference)
    err = capsys.readouterr().err
    assert "no KL reference counted (the loss uses none, or LoRA)" in err
    assert re.search(r"optimizer state: fp32 moments: 16 B per trained parameter on the cpu \(.*\); auto: the most exact; its plan "
                     r"peaks at [\d.]+ GB, within 90% of [\d.]+ GB free on the cpu", err), err  # fmt: skip
    LocalBackend().make_trainer(config=config)  # a direct call counts one: the plan errs on the safe side
    assert "a full fine-tune's KL reference counted" in capsys.readouterr().err
    with_kl = RunConfig(model=str(tiny_model_dir))  # grpo's default kl_beta
    assert select_plugins(with_kl).needs_reference


def test_on_cuda_the_plan_chooses_checkpointing_unless_compiled_layers_need_it(tiny_model_dir, monkeypatch):
    """What a CUDA run hands the plan (asked on this CPU, stopped before anything loads): checkpointing
    undecided (None) for the plan to choose, on for compile=true (compiled layers run whole sequences),
    as asked where asked; a resident reference only where the loss uses one."""
    from grpo_core.plugins.backends import local
    from grpo_core.plugins.backends.local import LocalBackend

    class Planned(Exception):
        pass

    seen = []

    def planned(config, folder, dtype, device, reference, checkpointing, kernel):
        seen.append((checkpointing, reference))
        raise Planned

    monkeypatch.setattr(local, "resolve_precision", lambda device, dtype: (torch.device("cuda"), torch.bfloat16, "bf16"))
    monkeypatch.setattr(local, "resolve_optimizer_kernel", lambda *a: ("eager", "eager"))
    monkeypatch.setattr(local, "check_fits", planned)
    for compile, asked, needs_reference in ((True, None, False), ("auto", None, True), ("auto", False, False), (True, False, False)):
        with pytest.raises(Planned):
            config = RunConfig(model=str(tiny_model_dir), gradient_checkpointing=asked)
            LocalBackend(compile=compile).make_trainer(config=config, needs_reference=needs_reference)
    assert seen == [(True, None), (None, "memory"), (False, None), (False, None)]
