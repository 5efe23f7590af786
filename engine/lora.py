"""LoRA adapters (peft) on a transformers model, and the state dicts around them: what training
changes, the base model's weights, the adapters merged in (in memory or written to a folder), and
frozen copies that share what never changes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from grpo_core.engine.architectures import lora_targets
from grpo_core.engine.models import SHARD_SIZE
from grpo_core.engine.reference_offload import FileEntry, read_safetensors_header, weight_files
from grpo_core.engine.vision import parts_pattern
from grpo_core.errors import PluginError

LORA_PREFIX = "lora_"
"""What names an adapter's tensors in a peft model's state dict (peft's own test for LoRA keys)."""


def add_lora(model: Any, rank: int, alpha: float, target_modules: Sequence[str], excluded: Sequence[str] = ()) -> Any:
    """``model`` with LoRA adapters on ``target_modules`` (peft); everything else is frozen.

    ``target_modules`` is a ``--lora-target-modules`` value (``auto``, ``all-linear`` or names;
    see :mod:`architectures`). Returns the transformers model itself, its targets wrapped by
    peft's LoRA layers (B starts at zero, so the policy starts as the base model). No dropout:
    the sampler and the trainer must score the same policy. No module inside ``excluded`` (names
    of modules, such as a vision-language model's vision tower) gets an adapter.
    """
    import peft

    targets = lora_targets(model, target_modules)
    lora = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets.modules),
        target_parameters=list(targets.parameters) or None,
        fan_in_fan_out=targets.fan_in_fan_out,
        lora_dropout=0.0,
        bias="none",
        exclude_modules=parts_pattern(excluded) if excluded else None,
    )
    with _targets_taken_as_named():
        model = peft.inject_adapter_in_model(lora, model)
    tied = model.get_input_embeddings().weight
    on_tied = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and getattr(m.get_base_layer(), "weight", None) is tied]
    if on_tied:
        # Merged, the adapter would change one of two layers that share their weight.
        raise PluginError(f"--lora-target-modules: '{on_tied[0]}' shares its weight with the embedding (tied); leave it out")
    return model.eval()


@contextmanager
def _targets_taken_as_named() -> Iterator[None]:
    """peft reads a MoE model's targets as transformers 4 named them and rewrites them onto
    transformers 5's fused experts (Qwen3-MoE's gate_proj, up_proj, down_proj and Mixtral's w1, w2,
    w3 become the experts' weights, at twice the rank; ``gate`` becomes the router's): the targets
    here are this model's own names (a dense layer's gate_proj is that linear layer), so peft takes
    them as they are."""
    try:
        from peft.utils import transformers_weight_conversion
    except ImportError:  # a peft without the rewrite
        yield
        return
    rewrite = transformers_weight_conversion.convert_peft_config_for_transformers
    transformers_weight_conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        transformers_weight_conversion.convert_peft_config_for_transformers = rewrite


def has_adapters(model: Any) -> bool:
    return any(hasattr(m, "lora_A") for m in model.modules())


def trained_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """What training changes: the adapters of a LoRA model, else the whole state dict."""
    state = model.state_dict()
    return {k: v for k, v in state.items() if LORA_PREFIX in k} if has_adapters(model) else state


def load_trained_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load what :func:`trained_state_dict` gave; a LoRA model's base weights stay as they are."""
    if not has_adapters(model):
        model.load_state_dict(state)
        return
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if LORA_PREFIX in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"the adapters do not fit this model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict, its own key names, with every active adapter added into
    its layer's weight: what peft's merge_and_unload gives, without changing ``model``."""
    state = base_state_dict(model)
    state.update(merged_weights(model, state))
    return state


def base_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """A LoRA model's base weights (no copies), by their names in the base model."""
    return {_without_wrappers(k): v for k, v in model.state_dict().items() if LORA_PREFIX not in k}


def adapted_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """Each LoRA layer not merged into its weight, with that weight's name in the base model."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and not module.merged:
            # An expert weight's adapter (peft's ParamWrapper, nested one per weight) names its weight.
            yield f"{_without_wrappers(name)}.{getattr(module, 'parameter_name', 'weight')}", module


@torch.no_grad()
def merged_weights(model: Any, base: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each adapted weight with its active adapters added in, made one at a time: its name in the
    base model and the merged tensor, in ``base``'s dtype."""
    for key, layer in adapted_layers(model):
        merged = base[key]
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                # float32 adapters on a bf16 base: the merged policy stays in the base's dtype.
                merged = (merged + layer.get_delta_weight(adapter)).to(base[key].dtype)
        yield key, merged


def save_merged_model(model: Any, path: str) -> None:
    """``model`` with its adapters merged in, as a transformers folder, one merged weight in
    memory at a time: the base model is written first (the merged model's very files, names,
    shapes and shards), then each merged weight over its base's bytes, in the layout saving gave
    it (a MoE layer's fused experts as one weight per expert and projection). Where that layout
    cannot be made from one weight alone, the merged state dict is written whole."""
    base = base_state_dict(model)
    model.save_pretrained(path, state_dict=base, max_shard_size=SHARD_SIZE)
    files = [open(f, "r+b") for f in weight_files(Path(path))]  # noqa: SIM115 (closed below)
    try:
        stored: dict[str, FileEntry] = {}
        for i, f in enumerate(files):
            stored.update(read_safetensors_header(f, i))
        layouts = {n: (t.dtype, tuple(t.shape)) for key, _ in adapted_layers(model) for n, t in as_saved(model, key, base[key]).items()}
        if not all(n in stored and (stored[n].dtype, stored[n].shape) == layout for n, layout in layouts.items()):
            model.save_pretrained(path, state_dict=merged_state_dict(model), max_shard_size=SHARD_SIZE)
            return
        for key, merged in merged_weights(model, base):
            _write_over(files, stored, as_saved(model, key, merged))
            del merged
    finally:
        for f in files:
            f.close()


def _write_over(files: list[Any], stored: dict[str, FileEntry], weights: dict[str, torch.Tensor]) -> None:
    for name, weight in weights.items():
        entry = stored[name]
        files[entry.file].seek(entry.start)
        files[entry.file].write(weight.contiguous().cpu().view(torch.uint8).numpy().data)


def as_saved(model: Any, key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` (``key`` in ``model``) under the names and shapes ``save_pretrained`` gives it:
    transformers 5 saves a weight it converted on loading in the checkpoint's layout (Qwen3-MoE's
    and Mixtral's fused experts: one tensor per expert and projection, Mixtral's under their old names)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: weights are saved as the model holds them
        return {key: weight}
    return revert_weight_conversion(model, {key: weight})


def _without_wrappers(name: str) -> str:
    """A parameter's or module's name in the base model: peft's LoRA layers hold the layer they
    wrap as ``base_layer``, nested where several weights of one module are wrapped."""
    return re.sub(r"\.base_layer(?=\.|$)", "", name)


@contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """Run ``model`` as its base model (peft's disable_adapter, on the transformers model)."""
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def frozen_copy(model: Any, weights: bool = True) -> Any:
    """A frozen copy of ``model``; without ``weights``, each parameter an empty tensor of its
    dtype and device, for weights that are put in per call (:mod:`reference_offload`)."""
    if not weights:
        memo = {id(p): torch.nn.Parameter(p.new_empty(0), requires_grad=False) for p in model.parameters()}
    elif has_adapters(model):
        # A LoRA model's base weights never change: the copy shares them and copies only the adapters.
        memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    else:
        memo = {}
    clone = copy.deepcopy(model, memo=memo)
    clone.requires_grad_(False)
    return clone.eval()


ADAPTER_FILE = "adapter_model.safetensors"


def write_peft_adapter(model: Any, folder: Path) -> None:
    """The LoRA adapters of ``model`` as a peft adapter folder (adapter_config.json and the A and
    B of each adapted layer), which vLLM loads as a LoRA adapter."""
    import peft
    from safetensors.torch import save_file

    tensors, targets, shapes = {}, set(), set()
    for key, layer in adapted_layers(model):
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if getattr(layer, "parameter_name", None) is not None or len(active) != 1 or layer.fan_in_fan_out:
            raise PluginError(
                f"a vLLM LoRA adapter holds adapters of linear layers, one per layer; {key.removesuffix('.weight')} has "
                f"{'an adapter on an expert weight' if getattr(layer, 'parameter_name', None) else f'{len(active)} active adapters'}: "
                "sync with method=full or method=delta"
            )
        name, module = active[0], key.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = layer.lora_A[name].weight.detach().to("cpu").contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = layer.lora_B[name].weight.detach().to("cpu").contiguous()
        targets.add(module.rsplit(".", 1)[-1])
        shapes.add((layer.r[name], layer.scaling[name]))
    if len(shapes) != 1:
        raise PluginError(
            f"the adapters have {len(shapes)} ranks and scalings; a vLLM LoRA adapter has one: sync with method=full or method=delta"
        )
    rank, scaling = shapes.pop()
    folder.mkdir(parents=True)
    # alpha as vLLM reads it (scaling = alpha / rank): the trainer's scaling, whichever way it was set.
    peft.LoraConfig(r=rank, lora_alpha=scaling * rank, target_modules=sorted(targets), lora_dropout=0.0, bias="none").save_pretrained(
        str(folder)
    )
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
