"""The memory a local run will need, estimated before its model loads (from config.json alone),
and the check against the device's free memory (in the spirit of ``accelerate estimate-memory``).

The model is built on the ``meta`` device (shapes, no storage): its parameter count is exact for
every architecture transformers knows, LoRA adapters included. The estimate is the largest of a
step's phases, each a sum of what is resident then:

- training: weights + gradients (the trained parameters' dtype) + Adam moments
  (:func:`engine.optim.moment_bytes`) + activations + one chunk of the fused head's logits;
- the optimizer step: weights + gradients + moments + its float32 work buffers (packed slices);
- the reference's forward (a full fine-tune's KL reference, resident or mapped in for it):
  weights + moments + the reference's weights;
- on a CPU run with periodic checkpoints, the checkpoint being written in the background holds a
  copy of the trained weights and moments through the next step (on CUDA that copy is in host
  memory, which this plan does not count).

Activations per token and layer (elements, stored for backward in the compute dtype): the
layer's input and normed input (2 H), q, k, v before and after their norm and rotation
(2 (Hq + 2 Hkv)), the attention output and its projection (Hq + H), the second norm (2 H) and
the MLP's gate, up, activation and product (4 I) plus its output (H). With gradient
checkpointing each layer keeps only its input (H) and one layer's worth is recomputed at a time.
This counts what backward keeps, not the allocator's slack: ``benchmarks/memory_plan.py``
compares it with measured peaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from grpo_core.engine.fused_logprobs import CPU_CHUNK_BYTES
from grpo_core.engine.optim import SLICE_ELEMENTS, moment_bytes

GB = 1e9
CPU_RUNTIME_BYTES = 170 * 10**6
"""What a CPU process's first forward and backward take whatever the model's size: autograd's,
oneDNN's and the allocator's state. Measured 0.17 GB (benchmarks/memory_plan.py, the embedded
model's shape, 2026-11-27); on CUDA the device's free memory is read after its context is made."""
ASSUMED_PROMPT_TOKENS = 128
"""Prompt tokens per sequence the activation estimate assumes (prompts are measured later)."""


@attrs.frozen
class ModelSize:
    parameters: int
    trained: int
    hidden: int
    layers: int
    intermediate: int
    q_width: int
    kv_width: int
    vocab: int


def model_size(
    folder: str | Path,
    lora_rank: int = 0,
    lora_alpha: float = 32.0,
    lora_targets: tuple[str, ...] = ("auto",),
    train_vision: bool = False,
) -> ModelSize:
    """The parameters of the model in ``folder`` (built on the meta device: no weights read) and
    how many of them train (all, or the LoRA adapters' with ``lora_rank``; a vision-language
    model's vision parts only with ``train_vision``)."""
    from transformers import AutoConfig

    from grpo_core.engine.vision import auto_model_class, vision_parts

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    parameters = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    frozen = [] if train_vision else vision_parts(model)
    trained = parameters - sum(p.numel() for name in frozen for p in model.get_submodule(name).parameters())
    if lora_rank:
        from grpo_core.engine.lora import add_lora

        model = add_lora(model, lora_rank, lora_alpha, list(lora_targets), excluded=frozen)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        parameters += trained
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    return ModelSize(
        parameters=parameters,
        trained=trained,
        hidden=hidden,
        layers=text.num_hidden_layers,
        intermediate=intermediate,
        q_width=text.num_attention_heads * head_dim,
        kv_width=kv_heads * head_dim,
        vocab=text.vocab_size,
    )


def activation_bytes(size: ModelSize, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """What backward keeps for ``tokens`` tokens in one forward (see the module's docstring)."""
    per_layer = 6 * size.hidden + 3 * size.q_width + 4 * size.kv_width + 4 * size.intermediate
    if checkpointing:
        return tokens * dtype_bytes * (size.layers * size.hidden + per_layer)
    return tokens * dtype_bytes * size.layers * per_layer


@attrs.frozen
class MemoryPlan:
    parts: dict[str, int]
    """Bytes of each resident part at the peak phase's widest, by name."""
    peak: int
    phase: str

    def line(self) -> str:
        parts = ", ".join(f"{name} {value / GB:.2f}" for name, value in self.parts.items() if value)
        return f"memory plan: peak {self.peak / GB:.2f} GB in {self.phase} ({parts} GB)"


def plan(
    size: ModelSize,
    weight_dtype: torch.dtype,
    optimizer_state: str,
    tokens: int,
    checkpointing: bool,
    reference: str | None,
    sampler_copy: bool,
    checkpoint_copy: bool = False,
    runtime: int = 0,
    optimizer_kernel: str = "eager",
) -> MemoryPlan:
    """The peak of a step. ``reference``: None (no reference: LoRA or no KL), "memory" (resident)
    or "offload" (mapped in for its forward only; on CUDA it waits in host memory, not counted).
    ``checkpoint_copy``: a background checkpoint's copy of the trained weights and moments shares
    this memory (a CPU run's periodic checkpoints). ``runtime``: bytes the first forward and
    backward take whatever the model (:data:`CPU_RUNTIME_BYTES` on a CPU). ``optimizer_kernel``:
    the compiled step updates bfloat16 weights in place, without the eager one's buffers."""
    dtype_bytes = torch.tensor([], dtype=weight_dtype).element_size()
    weights = size.parameters * dtype_bytes
    gradients = size.trained * dtype_bytes
    moments = int(size.trained * moment_bytes(optimizer_state))
    in_place = optimizer_kernel == "compiled" and weight_dtype == torch.bfloat16
    packed = not in_place and (optimizer_state != "fp32" or weight_dtype != torch.float32)
    # Float32 weight and gradient buffers (and both moments' where they are not float32), and the
    # int32 noise table where bf16 values are rounded (bf16 weights or moments).
    buffer_elements = min(size.trained, SLICE_ELEMENTS)
    rounds = weight_dtype == torch.bfloat16 or optimizer_state == "bf16"
    optimizer_work = buffer_elements * 4 * (2 if optimizer_state == "fp32" else 4) + SLICE_ELEMENTS * 4 * rounds if packed else 0
    head_chunk = min(CPU_CHUNK_BYTES, tokens * size.vocab * 4) * 4  # about four logits-sized tensors at once
    activations = activation_bytes(size, tokens, dtype_bytes, checkpointing)
    sampler = weights if sampler_copy else 0
    checkpoint = size.trained * dtype_bytes + moments if checkpoint_copy else 0
    # The packed step's buffers and noise table are kept from step to step: resident after the first.
    resident = {
        "runtime": runtime, "weights": weights, "moments": moments, "optimizer buffers": optimizer_work, "sampler copy": sampler,
        "checkpoint copy": checkpoint,
    }  # fmt: skip
    # The optimizer step holds what training does less its activations: never the peak.
    phases = {"training": {**resident, "gradients": gradients, "activations": activations, "logits chunk": head_chunk}}
    if reference is not None:
        phases["the reference's forward"] = {**resident, "reference": weights}
    if reference == "memory":
        for parts in phases.values():
            parts["reference"] = weights
    phase = max(phases, key=lambda name: sum(phases[name].values()))
    return MemoryPlan(parts=phases[phase], peak=sum(phases[phase].values()), phase=phase)


def free_memory(device: torch.device) -> int:
    """Bytes the run may still take: the CUDA device's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def optimizer_state_line(optimizer_state: str, weight_dtype: torch.dtype, device: torch.device) -> str:
    """The start line that states the bytes per trained parameter."""
    dtype_bytes = torch.tensor([], dtype=weight_dtype).element_size()
    moments = moment_bytes(optimizer_state)
    where = "; 8 more in pinned host memory" if optimizer_state == "offload" else ""
    return (
        f"optimizer state: {optimizer_state} moments: {dtype_bytes + dtype_bytes + moments:g} B per trained parameter on the "
        f"{device.type} (weights {dtype_bytes} + gradients {dtype_bytes} + moments {moments:g}{where})"
    )


def check_fits(
    config: Any,
    folder: str,
    weight_dtype: torch.dtype,
    device: torch.device,
    reference: str | None,
    checkpointing: bool,
    optimizer_kernel: str = "eager",
) -> MemoryPlan:
    """The plan of a local run (printed by the caller); raises ``PluginError`` naming the settings
    that would make it fit when it cannot fit the device's free memory (unless --no-memory-check)."""
    from grpo_core.errors import PluginError

    size = model_size(folder, config.lora_rank, config.lora_alpha, tuple(config.lora_target_modules), config.train_vision)
    samples = config.prompt_groups_per_step * config.completions_per_prompt // config.minibatches_per_step
    tokens = max(1, samples) * (ASSUMED_PROMPT_TOKENS + config.max_completion_tokens)
    periodic = 0 < config.checkpoint_every and (config.max_steps is None or config.checkpoint_every < config.max_steps)
    checkpoint_copy = device.type == "cpu" and periodic
    runtime = CPU_RUNTIME_BYTES if device.type == "cpu" else 0
    memory = plan(
        size,
        weight_dtype,
        config.optimizer_state,
        tokens,
        checkpointing,
        reference,
        config.sampling_runs_ahead,
        checkpoint_copy,
        runtime,
        optimizer_kernel,
    )
    free = free_memory(device)
    if config.memory_check and memory.peak > free:
        raise PluginError(
            f"{memory.line()}: {device.type} has {free / GB:.2f} GB free. To fit, try "
            + "; ".join(ways_to_fit(config, size, weight_dtype, device, checkpointing))
            + ". --no-memory-check runs it anyway"
        )
    return memory


def ways_to_fit(config: Any, size: ModelSize, weight_dtype: torch.dtype, device: torch.device, checkpointing: bool) -> list[str]:
    """The settings that would lower the estimate, most effective first."""
    options = []
    if config.lora_rank == 0:
        options.append("--lora-rank 16 (train adapters only: no full gradients or moments)")
    cheaper = [
        s
        for s in ("bf16", "8bit") + (("offload",) if device.type == "cuda" else ())
        if moment_bytes(s) < moment_bytes(config.optimizer_state)
    ]
    if cheaper:
        options.append(
            f"--optimizer-state {'/'.join(cheaper)} (moments: {', '.join(f'{moment_bytes(s):g}' for s in cheaper)} B per parameter)"
        )
    if weight_dtype == torch.float32:
        options.append("--dtype bfloat16 (half the weights and gradients)")
    if not checkpointing:
        options.append("--gradient-checkpointing (one layer's activations at a time)")
    options.append("--backend fsdp (weights, gradients and moments sharded over GPUs)")
    return options
