"""Vision-language models: loading one (an image-text-to-text architecture with a processor), an
image prompt's tokens and image tensors, the vision parts that stay frozen, and the image
features written over a forward's image tokens.

The sampler's prefill and the trainer's forwards run the language model over token ids as they
do for a text model; :class:`PlacedImages` writes each prompt's image features (the model's own
``get_image_features``) over the embeddings of that prompt's image tokens. Only prompt positions
are replaced: a completion that samples the image token is embedded as that token, by the sampler
and the trainer alike.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from grpo_core.errors import DataError, PluginError
from grpo_core.images import image_sources, read_image
from grpo_core.types import Prompt

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
"""A processor's outputs that are about the tokens; the others are the images' tensors."""
POSITIONS_FROM_IMAGES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe")
"""Model types whose position ids depend on each image's grid (M-RoPE): grpo-core's forwards give
positions 0..n-1, so these are refused rather than scored wrongly."""
LANGUAGE_MODEL = "language_model"


def image_text_config(path: str) -> Any | None:
    """The config of the model at ``path`` when it is an image-text-to-text model, else None."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    return None if auto_model_class(config) is AutoModelForCausalLM else config


def auto_model_class(config: Any) -> Any:
    """transformers' Auto class that builds a model of ``config``: image-text-to-text for a
    vision-language model, causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(config, "vision_config", None) is not None and type(config) in AutoModelForImageTextToText._model_mapping
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def load_vision_model(path: str, config: Any, device: torch.device, dtype: torch.dtype, attention: str) -> Any:
    """The image-text-to-text model at ``path``, refused where grpo-core cannot score it or its
    processor does not load here (:func:`processor_at`)."""
    from transformers import AutoModelForImageTextToText

    processor_at(path)
    if config.model_type in POSITIONS_FROM_IMAGES:
        raise PluginError(
            f"model type '{config.model_type}': its position ids follow each image's grid (M-RoPE), which grpo-core's "
            "trainer and sampler do not compute; LLaVA-style models (positions 0..n-1) train"
        )
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, device_map=None if device.type == "cpu" else device, attn_implementation=attention
    )
    if image_token_id(model) is None:
        raise PluginError(f"model type '{config.model_type}': its config names no image token (image_token_id)")
    return model


@functools.cache
def processor_at(path: str) -> Any:
    """The model's processor (tokenizer, image processor, chat template), loaded once per path."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers' processors fail in their own ways; the user needs the model and the reason
        why = _first_line(exc)
        if "torchvision" in str(exc).lower():
            broken = _torchvision_problem()
            why = (
                f"it needs torchvision, which does not import beside this torch ({broken})"
                if broken
                else f"it needs torchvision, which is not installed: install the torchvision built for torch {torch.__version__} ({why})"
            )
        raise PluginError(f"cannot load the processor of vision-language model '{path}': {why}") from None
    if getattr(processor, "image_processor", None) is None:
        raise PluginError(f"'{path}' is a vision-language model, but its processor ({type(processor).__name__}) has no image processor")
    return processor


def _torchvision_problem() -> str | None:
    """Why torchvision does not import here (a wheel built for another torch), or None where it does
    or is not installed at all."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a mismatched wheel raises RuntimeError ("operator torchvision::nms does not exist") or others
        return _first_line(exc)
    return None


def _first_line(exc: Exception) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def image_token_id(model: Any) -> int | None:
    config = model.config
    found = getattr(config, "image_token_id", None)
    return found if found is not None else getattr(config, "image_token_index", None)


def vision_parts(model: Any) -> list[str]:
    """The names of a vision-language model's modules that turn images into the language model's
    inputs (vision tower, projector): everything under its base model but the language model.
    Empty for a text model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base.base_model, LANGUAGE_MODEL) or base.base_model is base:
        return []
    prefix = base.base_model_prefix
    return [f"{prefix}.{name}" for name, _ in base.base_model.named_children() if name != LANGUAGE_MODEL]


def frozen_vision_parts(model: Any, train_vision: bool) -> list[str]:
    """The vision parts (:func:`vision_parts`) that stay frozen: all of them unless ``--train-vision``,
    which a text model refuses."""
    parts = vision_parts(model)
    if train_vision and not parts:
        raise PluginError(f"--train-vision: model type '{model.config.model_type}' has no vision tower")
    return [] if train_vision else parts


def parts_pattern(names: Sequence[str]) -> str:
    """A regex that peft matches (``re.fullmatch``) against every module inside ``names``."""
    return "|".join(rf"{re.escape(name)}(\..*)?" for name in names)


def freeze(model: Any, names: Sequence[str]) -> None:
    for name in names:
        model.get_submodule(name).requires_grad_(False)


def save_processor(model: Any, tokenizer: Any, path: str) -> None:
    """Beside a vision-language model's saved weights, the processor it was loaded with (the
    image processor and chat template a loader of the folder needs); nothing for a text model."""
    if vision_parts(model):
        processor_at(tokenizer.name_or_path).save_pretrained(path)


def encode_image_prompt(tokenizer: Any, prompt: Prompt) -> tuple[list[int], dict[str, torch.Tensor]]:
    """An image prompt's tokens (each image's placeholder expanded to its feature count) and its
    images' tensors, from the model's processor and chat template. A missing or unreadable image
    is a DataError naming the prompt."""
    processor = processor_at(tokenizer.name_or_path)
    if getattr(processor, "chat_template", None) is None:
        raise PluginError(f"prompt {prompt.id} has images, but the processor of '{tokenizer.name_or_path}' has no chat template")
    images = [read_image(source, f"prompt {prompt.id}") for source in image_sources(prompt.messages)]
    text = processor.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    try:
        encoded = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    except ValueError as exc:  # the processor's own check of the chat's images against their placeholders
        raise DataError(f"prompt {prompt.id}: {str(exc).splitlines()[0]}") from None
    return encoded["input_ids"][0].tolist(), {name: value for name, value in encoded.items() if name not in TOKEN_INPUTS}


class PlacedImages:
    """The image features of the sequences of one forward, written over their image tokens'
    embeddings while :meth:`placed` is active.

    ``sequences[i]`` is the i-th sequence's token ids, ``images[i]`` its images' tensors (None: no
    images), ``prompt_lengths[i]`` how many of its first tokens are its prompt (only there are
    image tokens replaced). A layout that runs the sequences in one forward says where each starts
    among the forward's flattened positions (``offsets``).
    """

    def __init__(
        self,
        model: Any,
        sequences: Sequence[Sequence[int]],
        images: Sequence[dict[str, torch.Tensor] | None],
        prompt_lengths: Sequence[int],
        where: Sequence[str] | None = None,
    ) -> None:
        self.model = model
        token = image_token_id(model)
        if token is None or not hasattr(model, "get_image_features"):
            raise PluginError(f"image prompts reach a {model.config.model_type} model, which is not a vision-language model")
        self.positions = [
            [t for t, token_id in enumerate(ids[:n]) if token_id == token] if tensors else []
            for ids, tensors, n in zip(sequences, images, prompt_lengths)
        ]
        self.images = list(images)
        self.where = list(where) if where is not None else [f"sequence {i}" for i in range(len(self.images))]

    @contextmanager
    def placed(self, offsets: Sequence[int]) -> Iterator[None]:
        embedding = self.model.get_input_embeddings()
        index_N = torch.tensor([o + t for o, positions in zip(offsets, self.positions) for t in positions], dtype=torch.long)
        features_N_E = self._features()

        def write(module: Any, args: Any, embeds_B_S_E: torch.Tensor) -> torch.Tensor:
            flat_N_E = embeds_B_S_E.reshape(-1, embeds_B_S_E.shape[-1])
            placed_N_E = flat_N_E.index_put((index_N.to(flat_N_E.device),), features_N_E.to(flat_N_E.dtype))
            return placed_N_E.view_as(embeds_B_S_E)

        handle = embedding.register_forward_hook(write)
        try:
            yield
        finally:
            handle.remove()

    def _features(self) -> torch.Tensor:
        """Every sequence's image features, in the order of its image tokens, the sequences in order."""
        parts = []
        for tensors, positions, where in zip(self.images, self.positions, self.where):
            if not tensors:
                continue
            device = self.model.device
            dtype = next(self.model.parameters()).dtype
            inputs = {k: v.to(device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
            features_N_E = _flat_features(self.model.get_image_features(**inputs))
            if len(features_N_E) != len(positions):
                raise ValueError(f"{where}: {len(positions)} image tokens in its prompt, but its images make {len(features_N_E)} features")
            parts.append(features_N_E)
        return torch.cat(parts)


def _flat_features(output: Any) -> torch.Tensor:
    """``get_image_features``' result (a tensor, a list of per-image tensors, or a model output
    holding them as ``pooler_output``) as one ``[features, hidden]`` tensor."""
    if not isinstance(output, (torch.Tensor, list, tuple)):
        output = output.pooler_output
    if isinstance(output, torch.Tensor):
        return output.reshape(-1, output.shape[-1])
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in output])
