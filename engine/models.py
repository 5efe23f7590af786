"""Loading a model for training or scoring: where it comes from, its precision, dropout off,
activation checkpointing, and the shape of the weight files saved from it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from grpo_core.embedded import ASSETS
from grpo_core.engine.architectures import attention_implementation
from grpo_core.engine.varlen_attention import SAVED_AS, VARLEN, varlen_problem
from grpo_core.engine.vision import image_text_config, load_vision_model
from grpo_core.errors import PluginError

PRECISION_NOTES = {
    "float32": "float32 (exact: a resumed run repeats the uninterrupted one bit for bit)",
    "bfloat16": "bfloat16 weights, gradients and reference; float32 AdamW moments, stochastic rounding",
}


def resolve_precision(device: str, dtype: str) -> tuple[torch.device, torch.dtype, str]:
    """The device, the dtype the model is held in, and one line saying which and why."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PluginError("--device cuda was asked for, but no CUDA device is available")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
        why = "--dtype auto on cuda" if device == "cuda" else "--dtype auto on cpu, so that a result does not depend on which CPU ran it"
    else:
        why = f"--dtype {dtype} on {device}"
    return torch.device(device), getattr(torch, dtype), f"{PRECISION_NOTES[dtype]}; {why}"


def model_path(name: str) -> str:
    """The embedded model's folder, a local folder, or a hub name that can be reached.

    A hub name is tried in the local cache first; otherwise the hub is probed once, so that
    a machine without network fails at once with one line instead of a minute of retries.
    """
    if name == "default":
        return str(ASSETS)
    if Path(name).exists() or os.environ.get("HF_HUB_OFFLINE") or name.count("/") > 1:
        return name
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name
    import httpx

    try:
        httpx.head(f"{constants.ENDPOINT}/api/models/{name}", timeout=10, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise PluginError(
            f"cannot load model '{name}': it is not a local folder nor in the Hugging Face cache, and "
            f"{constants.ENDPOINT} cannot be reached ({exc}); download it where there is network or pass a folder"
        ) from None
    return name


def model_folder(name: str) -> Path | None:
    """The local folder a model loads from (a hub name's cached snapshot), if there is one."""
    path = model_path(name)
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    return Path(cached).parent if isinstance(cached, str) else None


def load_model(name: str, device: torch.device, attn_implementation: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # The run shows its own progress; per-shard load bars would only interleave with it.
    hf_logging.disable_progress_bar()
    path = model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        attention = attention_implementation(attn_implementation, path)
        if attention == VARLEN:
            _refuse_varlen(path, device, dtype)
        vision = image_text_config(path)
        # Straight into the run's dtype and onto its device: no float32 host copy on the way.
        model = (
            AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, device_map=None if device.type == "cpu" else device, attn_implementation=attention
            )
            if vision is None
            else load_vision_model(path, vision, device, dtype, attention)
        )
    except (OSError, ValueError) as exc:
        raise PluginError(f"cannot load model '{name}': {str(exc).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Written into every config.json saved from this model, so that a saved policy loads with the
    # attention it was trained with (grpo-core eval, export, from_pretrained).
    # varlen is sdpa for everything but packed rows, and only grpo-core registers it.
    model.config.attn_implementation = SAVED_AS if attention == VARLEN else model.config._attn_implementation
    disable_dropout(model)
    return model.eval(), tokenizer


def _refuse_varlen(path: str, device: torch.device, dtype: torch.dtype) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    problem = varlen_problem(device, dtype, config, AutoModelForCausalLM._model_mapping.get(type(config), None))
    if problem:
        raise PluginError(f"attn_implementation=varlen: {problem}; use auto or sdpa")


def disable_dropout(model: Any) -> None:
    """Dropout off even in train mode (which activation checkpointing needs): the sampler's and
    the trainer's logprobs must describe the same policy."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        # transformers' attention modules read their dropout probability from a float attribute.
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def resolve_checkpointing(setting: bool | None, device: str, supported: bool = True) -> tuple[bool, str]:
    """Whether the trainer recomputes each layer's activations in backward (``--gradient-checkpointing``:
    True, False, or None for the device's default) on ``device`` (``cuda``, ``cpu``), and one
    line saying which and why. ``supported``: whether transformers checkpoints the model at all
    (asked for, and not supported, :func:`enable_activation_checkpointing` refuses it)."""
    if setting is not None:
        return setting, "on (--gradient-checkpointing)" if setting else "off (--no-gradient-checkpointing)"
    if device != "cuda":
        return False, (
            f"off (default on {device}: a CPU run is small and checkpointing costs ~1/3 more training compute; "
            "--gradient-checkpointing turns it on)"
        )
    if not supported:
        return False, "off (default on cuda, but transformers does not checkpoint this model type)"
    return True, (
        "on (default on cuda: activations are most of a step's GPU memory, for a little more step time, docs/performance.md; "
        "--no-gradient-checkpointing turns it off)"
    )


def enable_activation_checkpointing(model: Any) -> None:
    """transformers' per-layer checkpointing (non-reentrant: gradients reach LoRA adapters and
    frozen inputs alike); it acts only while the model is in train mode, see :func:`train_mode`."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise PluginError(f"--gradient-checkpointing: transformers does not checkpoint model type '{model.config.model_type}'")
    # transformers 5.x renamed gradient_checkpointing_enable (removed in 6).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextmanager
def train_mode(model: Any) -> Iterator[None]:
    """``model`` in train mode for one call (dropout is off: only checkpointing changes)."""
    model.train()
    try:
        yield
    finally:
        model.eval()


SHARD_SIZE = "2GB"
"""Largest safetensors file written (the sampler's policy, checkpoints' weights)."""


def shared_storage_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name: the first name with the same storage} for the tensors of ``state`` that share one
    (tied embeddings): safetensors stores each storage once."""
    first: dict[tuple[int, int], str] = {}
    aliases = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def save_state_as_model(model: Any, state: dict[str, torch.Tensor], path: str) -> None:
    """``model``'s folder with ``state`` as its weights; config.json names the dtype of those tensors
    (save_pretrained writes the parameters' own: an fsdp policy's float32 master weights, say, where
    the bfloat16 tensors gathered from them are what is written)."""
    import json

    model.save_pretrained(path, state_dict=state, max_shard_size=SHARD_SIZE)
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        config_file = Path(path) / "config.json"
        config = json.loads(config_file.read_text())
        config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
