"""What the local backend knows about model architectures: where LoRA adapters go by default,
and which attention implementation a model loads with.

LoRA targets (``--lora-target-modules``) are ``auto`` (the model type's preset below),
``all-linear`` (every linear layer but the output head, plus a mixture-of-experts model's
experts), or names as in the model. A name is a module (``q_proj`` adapts every module whose
name ends so) or, for weights that no linear layer holds, a parameter (``mlp.experts.gate_up_proj``:
transformers 5 keeps a MoE layer's experts as one 3-D tensor per projection, which peft adapts
with one low-rank pair per expert). Every name must match something: a list written for another
architecture fails instead of leaving layers untrained.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from grpo_core.errors import PluginError

AUTO = "auto"
ALL_LINEAR = "all-linear"
PRESET_NAMES = (AUTO, ALL_LINEAR)

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PROJECTIONS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@attrs.frozen
class LoraTargets:
    """Where adapters go: modules by name, and parameters that no linear layer holds."""

    modules: tuple[str, ...]
    """Module names (a name matches every module whose name ends so)."""
    parameters: tuple[str, ...] = ()
    """3-D expert weights (peft's ``target_parameters``): one adapter per expert."""
    fan_in_fan_out: bool = False
    """The layers store their weight as [in, out] (GPT-2's Conv1D)."""


LORA_PRESETS: dict[str, LoraTargets] = {
    **dict.fromkeys(
        ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2"), LoraTargets(LLAMA_PROJECTIONS)
    ),
    # Fused projections: q, k, v in one layer, gate and up in another.
    "phi3": LoraTargets(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    # Conv1D layers: c_attn is q, k, v fused; c_proj names both the attention's and the MLP's output.
    "gpt2": LoraTargets(("c_attn", "c_proj", "c_fc"), fan_in_fan_out=True),
    # The router (mlp.gate) stays as it is: adapting it changes which experts a token reaches.
    "qwen3_moe": LoraTargets(ATTENTION_PROJECTIONS, EXPERT_PROJECTIONS),
    "mixtral": LoraTargets(ATTENTION_PROJECTIONS, EXPERT_PROJECTIONS),
}
"""The default targets per model type: every projection of attention and MLP (experts included)."""


def lora_targets(model: Any, names: Sequence[str]) -> LoraTargets:
    """The modules and parameters of ``model`` that ``names`` (a ``--lora-target-modules``
    value) asks adapters for; every name must match something in the model."""
    if not names:
        raise PluginError(f"--lora-rank needs at least one --lora-target-modules ({AUTO}, {ALL_LINEAR} or names)")
    preset = [n for n in names if n in PRESET_NAMES]
    if preset and len(names) > 1:
        raise PluginError(f"--lora-target-modules: '{preset[0]}' stands alone, not beside other names ({' '.join(names)})")
    model_type = model.config.model_type
    if list(names) == [AUTO]:
        if model_type in LORA_PRESETS:
            return LORA_PRESETS[model_type]
        names = [ALL_LINEAR]
    if list(names) == [ALL_LINEAR]:
        # Named one by one, not as peft's "all-linear": peft maps that onto a MoE model's router too.
        head = model.get_output_embeddings()
        linear = tuple(n for n, m in model.named_modules() if _is_linear(m) and m is not head)
        preset = LORA_PRESETS.get(model_type)
        targets = LoraTargets(linear, preset.parameters if preset else (), preset.fan_in_fan_out if preset else False)
        _refuse_untargeted_experts(model, targets)
        return targets
    named_modules = list(model.named_modules())
    parameter_names = [n for n, p in model.named_parameters() if p.dim() >= 2]
    modules, parameters = [], []
    for name in names:
        matched = [m for n, m in named_modules if _ends_with(n, name)]
        if matched and not any(_is_linear(m) or isinstance(m, torch.nn.Embedding) for m in matched):
            raise PluginError(
                f"--lora-target-modules: '{name}' is a {type(matched[0]).__name__}, not a linear layer ({_what_can_be_targeted(model)})"
            )
        if matched:
            modules.append(name)
        elif any(_ends_with(p, name) for p in parameter_names):
            parameters.append(name)
        else:
            raise PluginError(
                f"--lora-target-modules: '{name}' matches nothing in this {model_type} model ({_what_can_be_targeted(model)})"
            )
    fan_in_fan_out = model_type in LORA_PRESETS and LORA_PRESETS[model_type].fan_in_fan_out
    return LoraTargets(tuple(modules), tuple(parameters), fan_in_fan_out)


def _ends_with(full_name: str, name: str) -> bool:
    return full_name == name or full_name.endswith("." + name)


def _refuse_untargeted_experts(model: Any, targets: LoraTargets) -> None:
    """An unknown MoE type's experts are no linear layers: ``all-linear`` would skip them unsaid."""
    experts = [n for n, p in model.named_parameters() if p.dim() >= 3 and not any(_ends_with(n, t) for t in targets.parameters)]
    if experts:
        raise PluginError(
            f"--lora-target-modules {ALL_LINEAR}: this {model.config.model_type} model's expert weights ('{experts[0]}', ...) are "
            "not linear layers and would get no adapters; name the targets instead, the experts by their weights "
            f"(e.g. {'.'.join(experts[0].split('.')[-3:])})"
        )


def _what_can_be_targeted(model: Any) -> str:
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m)})
    text = f"its linear layers: {', '.join(linear)}"
    experts = sorted({".".join(n.split(".")[-3:]) for n, p in model.named_parameters() if p.dim() >= 3})
    if experts:
        text += f"; its expert weights: {', '.join(experts)}"
    return text + f"; or {AUTO}, {ALL_LINEAR}"


def _is_linear(module: Any) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, torch.nn.Linear | Conv1D)


def attention_implementation(requested: str, path: str | Path) -> str | None:
    """The attention implementation to load ``path`` with: ``requested``, or for ``auto`` the
    one its config.json records (a policy grpo-core saved), else sdpa where the architecture
    supports it and eager where it does not (Gemma2: sdpa cannot soft-cap attention scores).
    None: a model class transformers does not map, left to transformers (which names the problem)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if requested == "sdpa" and model_class is not None and not model_class._supports_sdpa:
        raise PluginError(f"--backend-opt attn_implementation=sdpa: {model_class.__name__} has no sdpa attention; use auto (eager here)")
    if requested != AUTO:
        return requested
    if config._attn_implementation:
        return config._attn_implementation
    if model_class is None:
        return None
    return "sdpa" if model_class._supports_sdpa else "eager"
