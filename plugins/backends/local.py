from __future__ import annotations

import sys
from typing import Any, Literal

import attrs
import torch

from grpo_core import hookimpl, option
from grpo_core.config import RunConfig
from grpo_core.engine.architectures import AUTO
from grpo_core.engine.compile import resolve_compile
from grpo_core.engine.forward import TRAINER_FORWARD
from grpo_core.engine.host_memory import HOST_MEMORY_TIGHT, TRAINING_MMAP_THRESHOLD, set_mmap_threshold
from grpo_core.engine.lora import add_lora, frozen_copy, has_adapters
from grpo_core.engine.memory_plan import ASSUMED_PROMPT_TOKENS, GB, check_fits, free_memory, optimizer_state_line
from grpo_core.engine.models import (
    enable_activation_checkpointing,
    load_model,
    model_folder,
    model_path,
    resolve_checkpointing,
    resolve_precision,
)
from grpo_core.engine.optim import OPTIMIZER_KERNELS, resolve_optimizer_kernel
from grpo_core.engine.reference_offload import offload
from grpo_core.engine.trainer import LocalReference, LocalTrainer
from grpo_core.engine.varlen_attention import choose_attention
from grpo_core.engine.vision import freeze, frozen_vision_parts
from grpo_core.errors import PluginError

REFERENCE_PLACES = (AUTO, "memory", "offload")


@attrs.define
class LocalBackend:
    """Train and sample in this process with PyTorch + transformers (the default backend).

    The trainer implements the Tinker training contract over a transformers causal LM; the
    sampler generates all completions of a step in one batched, KV-cached loop and reports the
    logprob of every sampled token. With weight_sync_interval=1 both share one set of weights,
    so weight sync is free. CUDA is used when present, the CPU otherwise. Precision (--dtype):
    float32 is exact (a resumed run is bitwise the uninterrupted one); bfloat16 holds weights,
    gradients and the KL reference in bf16 with float32 AdamW moments and stochastic rounding
    (12 bytes per trained parameter instead of 16); auto is bfloat16 on CUDA and float32 on a
    CPU, so a CPU run's result does not depend on which CPU it lands on.

    With --lora-rank R > 0 only LoRA adapters (peft) on --lora-target-modules train: checkpoints
    hold the adapters and their optimizer state, the KL reference is the same model with its
    adapters disabled (no second copy), and the policy written for a sampler or as final/ is
    the base model with the adapters merged in (a plain transformers folder).

    A full fine-tune's KL reference (a frozen copy of the initial weights, used for one forward
    per step) is offloaded on a CPU by default (``reference``): it waits in safetensors files
    (the model's own when they hold the initial weights in the run's dtype) and is mapped into
    memory only for its forward, which comes before the trainer's backward, so the step's peak
    holds the weights, gradients and Adam moments without it.
    """

    attn_implementation: str = option(
        AUTO,
        help=(
            "transformers attention implementation; varlen = packed rows through torch's varlen flash kernel (no "
            "[S, S] mask; CUDA, bf16/fp16, plain causal attention; sdpa otherwise); auto = varlen where it can run, "
            "else the one the model folder records, else sdpa where the architecture has it, eager where not "
            "(Gemma2); saved with the policy (varlen as sdpa)"
        ),
    )
    fast_forward: bool = option(
        True,
        help="sample Llama/Qwen2/Qwen3 models (fp32) with grpo-core's fused decoder; off = transformers' own",
    )
    padding_free: bool = option(
        True,
        help=(
            "score sequences that run whole (no shared prompt, or --gradient-checkpointing) packed end to end in rows, "
            "not padded, where the model and attention isolate packed sequences (checked at start); off = always pad"
        ),
    )

    reference: str = option(
        AUTO,
        help=(
            "where a full fine-tune's frozen KL reference waits between its forwards: memory = resident beside "
            "the trainer; offload = off the compute path (on a CPU in safetensors files, the model's own where "
            "they hold the initial weights, mapped for each forward; on CUDA in host memory, copied over for each "
            "forward); auto = offload on a CPU, memory on CUDA"
        ),
        validator=attrs.validators.in_(REFERENCE_PLACES),
    )

    return_freed_memory: bool | Literal["auto"] = option(
        "auto",
        help=(
            "on a CPU, glibc gives every tensor of 1 MiB or more back to the OS when it is freed (a fixed mmap "
            "threshold) and the heap's free pages after each phase (malloc_trim): a lower peak for a slower step "
            "(docs/performance.md, 'The memory targets at the 0.6B shape'); false = glibc's own threshold, which "
            "keeps freed weight-sized tensors; auto = true where the memory plan's peak exceeds a quarter of the "
            "host's available memory"
        ),
    )

    optimizer_kernel: str = option(
        AUTO,
        help=(
            "the AdamW step of bfloat16 weights (float32 moments, stochastic rounding): compiled = one torch.compile'd "
            "pass over each tensor, built at the first step (its time and speed: docs/performance.md, 'Optimizer step'); "
            "eager = float32 buffers and a noise table; auto = compiled on "
            "CUDA where Triton is installed, eager elsewhere"
        ),
        validator=attrs.validators.in_(OPTIMIZER_KERNELS),
    )
    compile: bool | Literal["auto"] = option(
        "auto",
        help=(
            "torch.compile each decoder layer of the trainer's and the reference's forward (dynamic shapes: no "
            "recompile per length); true = compiled (refused where inductor has no C++ compiler / Triton, and without "
            "--gradient-checkpointing, where every forward runs over a shared prompt's cache, eagerly); "
            "auto = off: on a CPU its compiling does not pay for small models, and it is not measured on a GPU "
            "(docs/performance.md, 'Compiled layers')"
        ),
    )

    default_sampler = "local"
    default_weight_sync = "in_process"

    @hookimpl
    def load_tokenizer(self, config: RunConfig) -> tuple[Any, int | None]:
        from transformers import AutoConfig, AutoTokenizer

        path = model_path(config.model)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            max_context = getattr(AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None)
        except (OSError, ValueError) as exc:
            raise PluginError(f"cannot load model '{config.model}': {str(exc).splitlines()[0]}") from None
        return tokenizer, max_context

    @hookimpl
    def check_config(self, config: RunConfig) -> None:
        if config.lora_rank and self.reference == "offload":
            raise PluginError(
                "--backend-opt reference=offload: a LoRA run's reference is the trainer's own model with its adapters off; "
                "there is no copy to offload"
            )
        device, _, _ = resolve_precision(config.device, config.dtype)
        if config.optimizer_state == "offload" and device.type != "cuda":
            raise PluginError(
                f"--optimizer-state offload streams Adam's moments from host memory to a GPU; on {device.type} they are in "
                "host memory already: use fp32, or bf16 / 8bit to make them smaller"
            )

    @hookimpl
    def make_trainer(self, config: RunConfig, needs_reference: bool = True) -> LocalTrainer:
        self.check_config(config)
        device, dtype, why = resolve_precision(config.device, config.dtype)
        reference = (
            None
            if config.lora_rank or not needs_reference
            else "memory"
            if self.reference == "memory" or (self.reference == AUTO and device.type != "cpu")
            else "offload"
        )
        # On CUDA the memory plan chooses checkpointing (off where it fits), but compiled layers need the
        # whole-sequence forwards checkpointing gives; a CPU run keeps it off unless asked.
        planned = config.gradient_checkpointing if config.gradient_checkpointing is not None or device.type == "cuda" else False
        for_compile = planned is None and self.compile is True
        planned = True if for_compile else planned
        fp32_kernel = (
            resolve_optimizer_kernel(self.optimizer_kernel, dtype, "fp32", device)[0]
            if config.optimizer_state in (AUTO, "fp32")
            else "eager"
        )
        fit = check_fits(config, model_path(config.model), dtype, device, reference, planned, fp32_kernel)
        kernel, kernel_why = resolve_optimizer_kernel(self.optimizer_kernel, dtype, fit.optimizer_state, device)
        # A group's completions share their prompt: without checkpointing (or router replay, one pass
        # each) every forward runs the prompt once and the completions over its cache.
        cached = None
        if config.shares_prompts and not fit.checkpointing and config.router_replay == "off":
            cached = f"groups of {config.completions_per_prompt} completions share their prompt and --gradient-checkpointing is off"
        compiled, compile_line = resolve_compile(self.compile, device, cached)
        print(f"precision: {why}", file=sys.stderr)
        print(optimizer_state_line(fit.optimizer_state, dtype, device, fit.optimizer_why), file=sys.stderr)
        print(f"optimizer kernel: {kernel_why}", file=sys.stderr)
        print(f"compile: {compile_line}", file=sys.stderr)
        attention = choose_attention(self.attn_implementation, model_path(config.model), device, dtype, self.padding_free)
        memory = fit.plan
        counted = "a full fine-tune's KL reference counted" if reference else "no KL reference counted (the loss uses none, or LoRA)"
        print(f"{memory.line()}; {counted}; activations assume prompts of {ASSUMED_PROMPT_TOKENS} tokens", file=sys.stderr)
        returned = False
        if device.type == "cpu":
            returned, why = self._returns_freed_memory(memory.peak)
            print(f"host memory: {why}", file=sys.stderr)
            if returned:
                # Weight-sized tensors back to the OS when freed, not kept for sizes never asked again.
                set_mmap_threshold(TRAINING_MMAP_THRESHOLD)
        model, tokenizer = load_model(config.model, device, attention, dtype=dtype)
        frozen = frozen_vision_parts(model, config.train_vision)
        if config.lora_rank:
            model = add_lora(model, config.lora_rank, config.lora_alpha, config.lora_target_modules, excluded=frozen)
        freeze(model, frozen)
        supported = getattr(model, "supports_gradient_checkpointing", False)
        checkpointing, why = (
            resolve_checkpointing(config.gradient_checkpointing, device.type, supported)
            if config.gradient_checkpointing is not None or device.type != "cuda" or not supported
            else (
                fit.checkpointing,
                "on (--backend-opt compile=true compiles whole-sequence forwards)" if for_compile else fit.checkpointing_why,
            )
        )
        print(f"gradient checkpointing: {why}", file=sys.stderr)
        if checkpointing:
            enable_activation_checkpointing(model)
        trainer = LocalTrainer(
            model=model,
            tokenizer=tokenizer,
            device=device,
            padding_free=self.padding_free,
            fast_forward=self.fast_forward,
            seed=config.seed,
            optimizer_state=fit.optimizer_state,
            optimizer_state_chosen=config.optimizer_state == AUTO,
            optimizer_kernel=kernel,
            optimizer_line=kernel_why,
            activation_checkpointing=checkpointing,
            return_freed_memory=returned,
            compile=compiled,
        )
        print(f"trainer forward: {TRAINER_FORWARD}; {trainer.forward_fn.padding_line()}", file=sys.stderr)
        return trainer

    def _returns_freed_memory(self, planned_peak: int) -> tuple[bool, str]:
        returned = "tensors of 1 MiB or more go back to the OS when freed, the heap's free pages after each phase"
        kept = "glibc keeps freed tensors for reuse"
        if self.return_freed_memory != "auto":
            return self.return_freed_memory, f"{returned if self.return_freed_memory else kept} (--backend-opt return_freed_memory)"
        available = free_memory(torch.device("cpu"))
        # Each large tensor a fresh mapping costs its page faults every step; worth it only where memory is tight.
        tight = planned_peak * HOST_MEMORY_TIGHT > available
        verdict = "over" if tight else "under"
        return tight, (
            f"{returned if tight else kept} (planned peak {planned_peak / GB:.2f} GB is {verdict} 1/{HOST_MEMORY_TIGHT} of "
            f"{available / GB:.1f} GB available; --backend-opt return_freed_memory=true|false)"
        )

    @hookimpl
    def make_reference(self, config: RunConfig, trainer: LocalTrainer) -> LocalReference:
        like_trainer = {
            "padding_free": trainer.padding_free,
            "return_freed_memory": trainer.return_freed_memory,
            "compile": trainer.compile,
        }
        if has_adapters(trainer.model):
            # The base model is the initial policy: the trainer's own model, adapters off.
            return LocalReference(trainer.model, trainer.device, adapters_off=True, **like_trainer)
        # Forward-only, in the trainer's dtype: bf16 in a bf16 run, float32 (exact) in a float32 one.
        if self.reference == "memory" or (self.reference == AUTO and trainer.device.type != "cpu"):
            print("reference: memory (a frozen copy beside the trainer)", file=sys.stderr)
            return LocalReference(frozen_copy(trainer.model), trainer.device, **like_trainer)
        model = frozen_copy(trainer.model, weights=False)
        folder = model_folder(config.model)
        offloaded = offload(model, trainer.model, folder)
        print(f"reference: {offloaded.where}", file=sys.stderr)
        return LocalReference(model, trainer.device, offloaded=offloaded, **like_trainer)
