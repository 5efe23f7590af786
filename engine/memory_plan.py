"""The memory a local run will need, estimated before its model loads (from config.json alone),
and the check against the device's free memory (in the spirit of ``accelerate estimate-memory``).

The model is built on the ``meta`` device (shapes, no storage): its parameter count is exact for
every architecture transformers knows, LoRA adapters included. The estimate is the largest of a
step's phases, each a sum of what is resident then:

- training: weights + gradients (the trained parameters' dtype) + Adam moments
  (:func:`engine.optim.moment_bytes`) + activations + one chunk of the fused head's logits; on
  CUDA, whose allocator counts live tensors, weights + moments + the larger of backward's start
  (activations + the head's chunk) and its end (gradients + one recomputed layer);
- the optimizer step: weights + gradients + moments + its float32 work buffers (packed slices);
- the reference's forward (a full fine-tune's KL reference, resident or mapped in for it):
  weights + moments + the reference's weights;
- on a CPU run with periodic checkpoints, the checkpoint being written in the background holds a
  copy of the trained weights and moments through the next step (on CUDA that copy is in host
  memory, which this plan does not count).

Activations per token and layer (elements, stored for backward in the compute dtype): the
layer's input and normed input (2 H), q, k, v before and after their norm and rotation
(2 (Hq + 2 Hkv)), the attention output and its projection (Hq + H), the second norm (2 H) and
the MLP's gate, up, activation and product (4 I) plus its output (H); in bfloat16 also the
float32 input each of the four RMSNorms keeps (2 H + Hq + Hkv, 2 more bytes each). With gradient
checkpointing each layer keeps only its input (H) and one layer's worth is recomputed at a time.
This counts what backward keeps, not the allocator's slack: ``benchmarks/memory_plan.py``
compares it with measured peaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from grpo_core.engine.fused_logprobs import CPU_CHUNK_BYTES, CUDA_CHUNK_BYTES_CAP
from grpo_core.engine.optim import MOMENT_FORMATS, SLICE_ELEMENTS, moment_bytes

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


def layer_activation_bytes(size: ModelSize, tokens: int, dtype_bytes: int) -> int:
    """What backward keeps of one layer's forward over ``tokens`` tokens (see the module's docstring)."""
    per_layer = dtype_bytes * (6 * size.hidden + 3 * size.q_width + 4 * size.kv_width + 4 * size.intermediate)
    # RMSNorm computes in float32 and keeps its float32 input: in bf16 2 more bytes per element of its four norms.
    upcast = (4 - dtype_bytes) * (2 * size.hidden + size.q_width + size.kv_width)
    return tokens * (per_layer + upcast)


def activation_bytes(size: ModelSize, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """What backward keeps for ``tokens`` tokens in one forward (see the module's docstring)."""
    if checkpointing:
        return tokens * dtype_bytes * size.layers * size.hidden + layer_activation_bytes(size, tokens, dtype_bytes)
    return size.layers * layer_activation_bytes(size, tokens, dtype_bytes)


def logits_chunk_bytes(size: ModelSize, tokens: int, device_type: str) -> int:
    """What the fused head holds at once: about four logits-sized tensors of one chunk (larger on CUDA)."""
    chunk_cap = CUDA_CHUNK_BYTES_CAP if device_type == "cuda" else CPU_CHUNK_BYTES
    return min(chunk_cap, tokens * size.vocab * 4) * 4


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
    device_type: str = "cpu",
) -> MemoryPlan:
    """The peak of a step. ``reference``: None (no reference: LoRA or no KL), "memory" (resident)
    or "offload" (mapped in for its forward only; on CUDA it waits in host memory, not counted).
    ``checkpoint_copy``: a background checkpoint's copy of the trained weights and moments shares
    this memory (a CPU run's periodic checkpoints). ``runtime``: bytes the first forward and
    backward take whatever the model (:data:`CPU_RUNTIME_BYTES` on a CPU). ``optimizer_kernel``:
    the compiled step updates bfloat16 weights in place, without the eager one's buffers.
    ``device_type``: on ``cuda`` a fused-head chunk is larger, and activations and gradients
    overlap only at backward's ends (a CPU's peak RSS keeps both: measured, docs/performance.md)."""
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
    head_chunk = logits_chunk_bytes(size, tokens, device_type)
    activations = activation_bytes(size, tokens, dtype_bytes, checkpointing)
    sampler = weights if sampler_copy else 0
    checkpoint = size.trained * dtype_bytes + moments if checkpoint_copy else 0
    # The packed step's buffers and noise table are kept from step to step: resident after the first.
    resident = {
        "runtime": runtime, "weights": weights, "moments": moments, "optimizer buffers": optimizer_work, "sampler copy": sampler,
        "checkpoint copy": checkpoint,
    }  # fmt: skip
    # The optimizer step holds what training does less its activations: never the peak.
    training = {"gradients": gradients, "activations": activations, "logits chunk": head_chunk}
    if device_type == "cuda":
        # CUDA's allocator counts live tensors: backward frees each layer's activations as its
        # gradients arrive, so the peak is at backward's start (every activation, the head's chunk)
        # or its end (every gradient, the last layer's recomputed activations), not their sum.
        # Measured on an H200 (2026-11-28): Qwen3-8B 95.0 GiB (fp32 moments) and 64.8 (bf16),
        # Qwen3-0.6B 10.3 (checkpointed) and 44.9 (not); tests/engine/test_memory_plan.py.
        recomputed = layer_activation_bytes(size, tokens, dtype_bytes) if checkpointing else 0
        end = {"gradients": gradients, "activations": recomputed}
        start = {"activations": activations - recomputed, "logits chunk": head_chunk}
        training = end if sum(end.values()) > sum(start.values()) else start
    phases = {"training": {**resident, **training}}
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


def optimizer_state_line(optimizer_state: str, weight_dtype: torch.dtype, device: torch.device, why: str = "") -> str:
    """The start line that states the bytes per trained parameter, and why these moments (``why``)."""
    dtype_bytes = torch.tensor([], dtype=weight_dtype).element_size()
    moments = moment_bytes(optimizer_state)
    where = "; 8 more in pinned host memory" if optimizer_state == "offload" else ""
    return (
        f"optimizer state: {optimizer_state} moments: {dtype_bytes + dtype_bytes + moments:g} B per trained parameter on the "
        f"{device.type} (weights {dtype_bytes} + gradients {dtype_bytes} + moments {moments:g}{where})" + (f"; {why}" if why else "")
    )


HEADROOM = 0.1
"""The share of the free memory ``auto`` leaves unplanned, for what the plan does not count (the
allocator's cached blocks and fragmentation, the CUDA context's growth, kernels' workspaces). The
plan counts what backward keeps; a choice that fills the device to the byte would be refused by
the allocator instead."""


@attrs.frozen
class Fit:
    """What the memory plan chose for a local run, and why (the start lines)."""

    optimizer_state: str
    checkpointing: bool
    plan: MemoryPlan
    optimizer_why: str
    checkpointing_why: str


def check_fits(
    config: Any,
    folder: str,
    weight_dtype: torch.dtype,
    device: torch.device,
    reference: str | None,
    checkpointing: bool | None,
    fp32_kernel: str = "eager",
    free: int | None = None,
) -> Fit:
    """The moments' form (``config.optimizer_state``; ``auto``: the most exact whose plan fits the
    device's free memory with :data:`HEADROOM`) and, where ``checkpointing`` is None, gradient
    checkpointing (off where the plan fits without it), and the plan (printed by the caller).
    Raises ``PluginError`` naming what would fit when nothing asked for can (unless
    --no-memory-check, which takes fp32 for auto and checkpointing for None). ``fp32_kernel``: the
    optimizer kernel float32 moments would take (the compiled one updates bf16 weights in place).
    ``free``: the device's free bytes (:func:`free_memory` where not given)."""
    from grpo_core.errors import PluginError

    size = model_size(folder, config.lora_rank, config.lora_alpha, tuple(config.lora_target_modules), config.train_vision)
    tokens = max(1, config.sequences_per_update) * (ASSUMED_PROMPT_TOKENS + config.max_completion_tokens)
    periodic = 0 < config.checkpoint_every and (config.max_steps is None or config.checkpoint_every < config.max_steps)
    checkpoint_copy = device.type == "cpu" and periodic
    runtime = CPU_RUNTIME_BYTES if device.type == "cpu" else 0

    def plan_of(state: str, checkpointed: bool) -> MemoryPlan:
        kernel = fp32_kernel if state == "fp32" else "eager"
        return plan(
            size,
            weight_dtype,
            state,
            tokens,
            checkpointed,
            reference,
            config.sampling_runs_ahead,
            checkpoint_copy,
            runtime,
            kernel,
            device.type,
        )

    auto = config.optimizer_state == "auto"
    # MOMENT_FORMATS runs from the most exact form to the smallest: auto takes the first that fits.
    states = [s for s in MOMENT_FORMATS if s != "offload" or device.type == "cuda"] if auto else [config.optimizer_state]
    checkpointings = [False, True] if checkpointing is None else [checkpointing]
    if not config.memory_check:
        state, checkpointed = "fp32" if auto else config.optimizer_state, True if checkpointing is None else checkpointing
        memory = plan_of(state, checkpointed)
        unplanned = "--no-memory-check: the plan chose nothing"
        return Fit(
            state,
            checkpointed,
            memory,
            _state_why(auto, f"fp32, the most exact ({unplanned})"),
            _checkpointing_why(checkpointing, unplanned),
        )
    free = free_memory(device) if free is None else free
    budget = int(free * (1 - HEADROOM))
    plans = {(s, c): plan_of(s, c) for s in states for c in checkpointings}
    # With headroom where any choice has it, else the first that fits at all.
    chosen = next((key for key, p in plans.items() if p.peak <= budget), None) or next(
        (key for key, p in plans.items() if p.peak <= free), None
    )
    where = f"{free / GB:.2f} GB free on the {device.type}"
    if chosen is None:
        memory = plans[states[0], checkpointings[-1]]
        possible = [s for s in MOMENT_FORMATS if s not in states and (s != "offload" or device.type == "cuda")]
        others = {s: plan_of(s, checkpointings[-1]).peak for s in possible}
        fitting = [f"--optimizer-state {s} (peak {peak / GB:.2f} GB)" for s, peak in others.items() if peak <= free]
        would = f" {' or '.join(fitting)} would fit." if fitting else ""
        raise PluginError(
            f"{memory.line()}: {device.type} has {free / GB:.2f} GB free.{would} To fit, try "
            + "; ".join(ways_to_fit(config, size, weight_dtype, device, checkpointings[-1]))
            + ". --no-memory-check runs it anyway"
        )
    state, checkpointed = chosen
    memory = plans[chosen]
    limit = f"{1 - HEADROOM:.0%} of {where}"
    within = f"within {limit}" if memory.peak <= budget else f"over {limit}, the least of what fits at all"
    if state == states[0]:
        state_why = _state_why(auto, f"the most exact; its plan peaks at {memory.peak / GB:.2f} GB, {within}")
    else:
        over = plans[states[0], checkpointings[-1]].peak
        state_why = _state_why(
            auto, f"{states[0]} moments' plan peaks at {over / GB:.2f} GB, over {limit}; {state}'s at {memory.peak / GB:.2f} GB, {within}"
        )
    if checkpointing is not None:
        checkpointing_why = _checkpointing_why(checkpointing, "")
    elif not checkpointed:
        checkpointing_why = (
            f"off (the memory plan fits without it: peak {memory.peak / GB:.2f} GB, {within}; --gradient-checkpointing turns it on)"
        )
    else:
        without = plans[state, False].peak
        checkpointing_why = (
            f"on (without it the plan peaks at {without / GB:.2f} GB, over {limit}; "
            f"with it {memory.peak / GB:.2f} GB, {within}; --no-gradient-checkpointing turns it off)"
        )
    return Fit(state, checkpointed, memory, state_why, checkpointing_why)


def _state_why(auto: bool, why: str) -> str:
    return f"auto: {why}" if auto else "as asked (--optimizer-state)"


def _checkpointing_why(setting: bool | None, why: str) -> str:
    if setting is None:
        return f"on ({why})"
    return "on (--gradient-checkpointing)" if setting else "off (--no-gradient-checkpointing)"


def ways_to_fit(config: Any, size: ModelSize, weight_dtype: torch.dtype, device: torch.device, checkpointing: bool) -> list[str]:
    """The settings that would lower the estimate, most effective first."""
    options = []
    if config.lora_rank == 0:
        options.append("--lora-rank 16 (train adapters only: no full gradients or moments)")
    # auto has tried every form already.
    cheaper = [
        s
        for s in ("bf16", "8bit") + (("offload",) if device.type == "cuda" else ())
        if config.optimizer_state != "auto" and moment_bytes(s) < moment_bytes(config.optimizer_state)
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


def rank_tokens(config: Any, ranks: int) -> int:
    """The tokens of the rows the widest of ``ranks`` ranks runs in a forward and backward (its
    share of an update's sequences: a minibatch, or sft's examples of a step), each prompt assumed
    :data:`ASSUMED_PROMPT_TOKENS` long."""
    return -(-max(1, config.sequences_per_update) // ranks) * (ASSUMED_PROMPT_TOKENS + config.max_completion_tokens)


def layer_parameters(folder: str | Path) -> int:
    """The parameters of the model's largest decoder layer: the unit the fsdp backend gathers whole
    (the classes its ``_no_split_modules`` names; 0 where it names none). Built on the meta device
    (the fsdp backend trains text models only: ``model_size``'s own build is for every kind)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    names = set(getattr(model, "_no_split_modules", None) or ())
    return max((sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names), default=0)


def sharded_plan(
    size: ModelSize,
    layer: int,
    ranks: int,
    compute_dtype: torch.dtype,
    tokens: int,
    checkpointing: bool,
    reference: bool,
    sampler_copy: bool,
    runtime: int = 0,
    offload: bool = False,
    device_type: str = "cpu",
) -> MemoryPlan:
    """Rank 0's peak in an fsdp step over ``ranks`` ranks (the widest rank: only it holds
    ``sampler_copy``, --sampler local's whole copy of the policy in ``compute_dtype``).

    Every rank holds a 1/N shard of the float32 master weights, their float32 gradients and the
    float32 AdamW moments (whatever ``compute_dtype``; ``offload``: in host memory, not on the
    device), and with a ``reference`` a 1/N shard of it in ``compute_dtype``. Training is the peak
    (the reference's forward and the optimizer step hold less): the root's weights (everything
    outside the decoder layers, ``layer`` parameters each) gathered in ``compute_dtype`` for the
    whole command, a layer gathered and the next one prefetched; in backward the root's and one
    layer's unsharded gradients, reduced in float32; the activations of the rank's share of the
    rows (``tokens``) and a fused-head logits chunk. Their sum, on CUDA too (the local plan's
    overlap of activations and gradients there is not measured for fsdp): an upper bound."""
    compute_bytes = torch.tensor([], dtype=compute_dtype).element_size()
    shard = -(-size.parameters // ranks)
    held = 0 if offload else 1
    root = max(0, size.parameters - size.layers * layer)
    parts = {
        "runtime": runtime,
        "weights": held * 4 * shard,
        "gradients": held * 4 * shard,
        "moments": held * int(shard * moment_bytes("fp32")),
        "gathered weights": (root + 2 * layer) * compute_bytes,
        "unsharded gradients": (root + layer) * 4,
        "activations": activation_bytes(size, tokens, compute_bytes, checkpointing),
        "logits chunk": logits_chunk_bytes(size, tokens, device_type),
        "reference": shard * compute_bytes if reference else 0,
        "sampler copy": size.parameters * compute_bytes if sampler_copy else 0,
    }
    return MemoryPlan(parts=parts, peak=sum(parts.values()), phase="training")


@attrs.frozen
class ShardedFit:
    """An fsdp run's plan: rank 0's, and what the device it runs on must hold."""

    rank0: MemoryPlan
    ranks_here: int
    """The ranks that share this device's memory: one per GPU on CUDA, every rank on this host on a CPU."""
    needed: int
    free: int

    def line(self) -> str:
        where = "one rank per GPU" if self.ranks_here == 1 else f"{self.ranks_here} ranks on this host need {self.needed / GB:.2f} GB"
        others = "; the others hold the same less the sampler copy" if self.rank0.parts["sampler copy"] else ""
        return f"{self.rank0.line()} on rank 0 ({where}{others})"


def check_sharded_fits(
    config: Any,
    folder: str,
    ranks: int,
    ranks_here: int,
    compute_dtype: torch.dtype,
    device: torch.device,
    checkpointing: bool,
    sampler_copy: bool,
    offload: bool = False,
    reference: bool = True,
) -> ShardedFit:
    """The plan of an fsdp run (printed by the caller), before any rank starts; raises
    ``PluginError`` naming what would make it fit when the ranks sharing this device's memory
    (``ranks_here``: all of this host's on a CPU) need more than it has free (unless --no-memory-check).
    ``reference``: the loss uses a KL reference (a second sharded model)."""
    from grpo_core.errors import PluginError

    size = model_size(folder)
    runtime = CPU_RUNTIME_BYTES if device.type == "cpu" else 0
    rank0 = sharded_plan(
        size,
        layer_parameters(folder),
        ranks,
        compute_dtype,
        rank_tokens(config, ranks),
        checkpointing,
        reference=reference,
        sampler_copy=sampler_copy,
        runtime=runtime,
        offload=offload,
        device_type=device.type,
    )
    shared = 1 if device.type == "cuda" else ranks_here
    needed = rank0.peak + (shared - 1) * (rank0.peak - rank0.parts["sampler copy"])
    fit = ShardedFit(rank0=rank0, ranks_here=shared, needed=needed, free=free_memory(device))
    if config.memory_check and fit.needed > fit.free:
        raise PluginError(
            f"{fit.line()}: {device.type} has {fit.free / GB:.2f} GB free. To fit, try "
            + "; ".join(sharded_ways_to_fit(config, ranks, compute_dtype, device, checkpointing, sampler_copy, offload))
            + ". --no-memory-check runs it anyway"
        )
    return fit


def sharded_ways_to_fit(
    config: Any, ranks: int, compute_dtype: torch.dtype, device: torch.device, checkpointing: bool, sampler_copy: bool, offload: bool
) -> list[str]:
    """The settings that would lower an fsdp run's estimate. More ranks only help on CUDA: on a
    CPU every rank's shard is in the same host memory."""
    options = []
    if device.type == "cuda":
        options.append(f"more ranks than {ranks} (weights, gradients and moments split more ways)")
        if not offload:
            options.append("--backend-opt cpu_offload=true (the shards in host memory)")
    if sampler_copy:
        options.append("--sampler openai (rank 0 keeps no whole copy of the policy)")
    if compute_dtype == torch.float32:
        options.append("--dtype bfloat16 (gathered weights and activations in bf16; the shards stay float32)")
    if not checkpointing:
        options.append("--gradient-checkpointing (one layer's activations at a time)")
    if config.command == "run" and 2 * config.minibatches_per_step <= config.prompt_groups_per_step:
        options.append(f"--minibatches-per-step {2 * config.minibatches_per_step} (half the rows in each forward and backward)")
    return options or [f"a {device.type} with more free memory (every setting that lowers the plan is in use)"]
