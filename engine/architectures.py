"""What the local backend knows about model architectures: where LoRA adapters go by default,
and which attention implementation a model loads with.

LoRA targets (``--lora-target-modules``) are ``auto`` (the model type's preset below),
``auto-no-experts`` (the same without a mixture-of-experts model's experts), ``all-linear`` (every
linear layer but the output head, plus a MoE model's experts) or names as in the model. A name is
a module (``q_proj`` adapts every module whose name ends so) or, for weights that no linear layer
holds, a parameter (``mlp.experts.gate_up_proj``: transformers 5 keeps a MoE layer's experts as one
3-D tensor per projection, which peft adapts with one low-rank pair per expert). Every name must
match something: a list written for another architecture fails instead of leaving layers untrained.
A MoE layer's router never gets adapters (it picks the experts each token reaches; see
:func:`router_names`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from grpo_core.errors import PluginError

AUTO = "auto"
AUTO_NO_EXPERTS = "auto-no-experts"
ALL_LINEAR = "all-linear"
PRESET_NAMES = (AUTO, AUTO_NO_EXPERTS, ALL_LINEAR)

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERTS = "experts"
"""What transformers names the module that holds a MoE layer's experts."""
ROUTERS = ("gate", "router")
"""What transformers names a MoE layer's router, the module beside its experts."""


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
    # The MLP projections are a dense layer's (Qwen3-MoE's mlp_only_layers); a model with none has the experts only.
    "qwen3_moe": LoraTargets(LLAMA_PROJECTIONS, EXPERT_PROJECTIONS),
    "mixtral": LoraTargets(LLAMA_PROJECTIONS, EXPERT_PROJECTIONS),
}
"""The default targets per model type: every projection of attention and MLP (experts included);
a MoE model's names that one model lacks (dense layers' MLPs) are left out for it."""


def lora_targets(model: Any, names: Sequence[str]) -> LoraTargets:
    """The modules and parameters of ``model`` that ``names`` (a ``--lora-target-modules``
    value) asks adapters for; every name must match something in the model."""
    if not names:
        raise PluginError(f"--lora-rank needs at least one --lora-target-modules ({', '.join(PRESET_NAMES)} or names)")
    preset = [n for n in names if n in PRESET_NAMES]
    if preset and len(names) > 1:
        raise PluginError(f"--lora-target-modules: '{preset[0]}' stands alone, not beside other names ({' '.join(names)})")
    return _preset_targets(model, preset[0]) if preset else _named_targets(model, names)


def router_names(model: Any) -> list[str]:
    """The routers of ``model``'s MoE layers: the ``gate`` or ``router`` beside an ``experts``.

    They get no adapters, whatever ``--lora-target-modules`` says: a router picks the experts each
    token reaches, so an adapter on it would train routing itself, the choice that router replay
    holds to the sampler's; the adapters train what the chosen experts compute instead."""
    routers = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if EXPERTS in children:
            routers += [f"{name}.{child}" if name else child for child in ROUTERS if child in children]
    return routers


def _preset_targets(model: Any, preset: str) -> LoraTargets:
    model_type = model.config.model_type
    known = LORA_PRESETS.get(model_type)
    head, routers = model.get_output_embeddings(), router_names(model)
    linear = [n for n, m in model.named_modules() if _is_linear(m) and m is not head and not _inside(n, routers)]
    if preset != ALL_LINEAR and known is not None:
        # A family's preset names what its models may hold; one model's config may lack some.
        weights = [n for n, p in model.named_parameters() if p.dim() >= 3]
        targets = LoraTargets(
            tuple(t for t in known.modules if any(_ends_with(n, t) for n in linear)),
            tuple(t for t in known.parameters if any(_ends_with(n, t) for n in weights)),
            known.fan_in_fan_out,
        )
    else:
        # Named one by one, not as peft's "all-linear": peft maps that onto a MoE model's router too.
        targets = LoraTargets(tuple(linear), known.parameters if known else (), known.fan_in_fan_out if known else False)
    if preset == AUTO_NO_EXPERTS:
        if not _expert_weights(model):
            raise PluginError(f"--lora-target-modules {AUTO_NO_EXPERTS}: this {model_type} model has no experts; use {AUTO}")
        # By full name: a name such as gate_proj may also name the experts' own layers (transformers 4).
        modules = tuple(n for n in linear if not _is_expert(n) and any(_ends_with(n, t) for t in targets.modules))
        targets = attrs.evolve(targets, modules=modules, parameters=())
    else:
        _refuse_untargeted_experts(model, targets, preset)
    if not targets.modules and not targets.parameters:
        raise PluginError(
            f"--lora-target-modules {preset}: nothing in this {model_type} model would get adapters ({_what_can_be_targeted(model)})"
        )
    return targets


def _named_targets(model: Any, names: Sequence[str]) -> LoraTargets:
    model_type = model.config.model_type
    named_modules = list(model.named_modules())
    parameter_names = [n for n, p in model.named_parameters() if p.dim() >= 2]
    routers = router_names(model)
    modules, parameters = [], []
    for name in names:
        matched = [(n, m) for n, m in named_modules if _ends_with(n, name)]
        matched_parameters = [p for p in parameter_names if _ends_with(p, name)]
        in_router = [n for n in [n for n, _ in matched] + matched_parameters if _inside(n, routers)]
        if in_router:
            raise PluginError(
                f"--lora-target-modules: '{name}' is in a router ({in_router[0]}, which picks the experts each token reaches); "
                "routers get no adapters (docs/performance.md, LoRA)"
            )
        if matched and not any(_is_linear(m) or isinstance(m, torch.nn.Embedding) for _, m in matched):
            raise PluginError(
                f"--lora-target-modules: '{name}' is a {type(matched[0][1]).__name__}, not a linear layer ({_what_can_be_targeted(model)})"
            )
        if matched:
            modules.append(name)
        elif matched_parameters:
            parameters.append(name)
        else:
            raise PluginError(
                f"--lora-target-modules: '{name}' matches nothing in this {model_type} model ({_what_can_be_targeted(model)})"
            )
    fan_in_fan_out = model_type in LORA_PRESETS and LORA_PRESETS[model_type].fan_in_fan_out
    return LoraTargets(tuple(modules), tuple(parameters), fan_in_fan_out)


def _ends_with(full_name: str, name: str) -> bool:
    return full_name == name or full_name.endswith("." + name)


def _inside(name: str, modules: Sequence[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _is_expert(name: str) -> bool:
    return f".{EXPERTS}." in f".{name}." or name.endswith(f".{EXPERTS}")


def _expert_weights(model: Any) -> list[str]:
    """The weights of ``model``'s experts: transformers 5 holds each projection's as one 3-D tensor."""
    convolutions = _convolution_weights(model)
    return [n for n, p in model.named_parameters() if n not in convolutions and (p.dim() >= 3 or (_is_expert(n) and p.dim() >= 2))]


def _convolution_weights(model: Any) -> set[str]:
    """A convolution's weights are 3-D or more too (a vision tower's patch embedding), but no experts."""
    return {
        f"{name}.{own}" if name else own
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.conv._ConvNd)
        for own, _ in module.named_parameters(recurse=False)
    }


def _refuse_untargeted_experts(model: Any, targets: LoraTargets, preset: str) -> None:
    """An unknown MoE type's experts are no linear layers: ``all-linear`` would skip them unsaid."""
    convolutions = _convolution_weights(model)
    experts = [
        n
        for n, p in model.named_parameters()
        if p.dim() >= 3 and n not in convolutions and not any(_ends_with(n, t) for t in targets.parameters)
    ]
    if experts:
        raise PluginError(
            f"--lora-target-modules {preset}: this {model.config.model_type} model's expert weights ('{experts[0]}', ...) are "
            "not linear layers and would get no adapters; name the targets instead, the experts by their weights "
            f"(e.g. {'.'.join(experts[0].split('.')[-3:])}), or leave the experts out with {AUTO_NO_EXPERTS}"
        )


def _what_can_be_targeted(model: Any) -> str:
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m)})
    text = f"its linear layers: {', '.join(linear)}"
    experts = sorted({".".join(n.split(".")[-3:]) for n, p in model.named_parameters() if p.dim() >= 3})
    if experts:
        text += f"; its expert weights: {', '.join(experts)}"
    return text + f"; or {', '.join(PRESET_NAMES)}"


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
