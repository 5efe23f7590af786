"""The ``reward_model`` reward: a local Hugging Face sequence-classification model's score."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from grpo_core import PluginError, Prompt, Sample, hookimpl, option
from grpo_core.loss import validate_non_negative, validate_positive
from grpo_core.options import missing_folder
from grpo_core.types import prompt_text

__all__ = ["RewardModelReward"]


def _names_a_model(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not value.strip():
        raise ValueError("model: name the reward model, a folder or a hub name: --reward-opt model=PATH")
    if missing_folder(value):
        raise ValueError(f"model={value}: no such folder (a reward model is a local folder or a hub name)")


@attrs.define
class RewardModelReward:
    """A reward model: the score of a local Hugging Face AutoModelForSequenceClassification (a
    folder, or a hub name already in the cache) for each prompt and completion.

    The model runs forward-only in batches of `batch_size` on the trainer's device (the run's
    --device), in its own `dtype` (auto: bfloat16 on CUDA, float32 on CPU). Its input is the
    prompt and the completion as a chat (a user and an assistant message) through the reward
    model's chat template when it has one (format=auto or chat), else the prompt's text followed
    by the completion (format=text); an input over `max_length` tokens loses its start, so the
    end of the completion is always scored. The reward is the logit of class `label` (a
    single-output model: its one score). Loaded at the run's start, or at the first call.
    """

    model: str = option("", help="folder or cached hub name of the sequence-classification reward model", validator=_names_a_model)
    dtype: Literal["auto", "float32", "bfloat16"] = option("auto", help="the reward model's dtype: auto = bfloat16 on CUDA, float32 on CPU")
    max_length: int = option(1024, help="tokens of one input; a longer one is cut from its start", validator=validate_positive)
    batch_size: int = option(8, help="inputs per forward pass", validator=validate_positive)
    label: int = option(0, help="which output is the score (a model with several classes)", validator=validate_non_negative)
    format: Literal["auto", "chat", "text"] = option(
        "auto", help="chat: the model's chat template; text: prompt + completion; auto: chat if it has a template"
    )

    _device: str = attrs.field(init=False, default="auto", repr=False)
    _loaded: tuple[Any, Any, Any] | None = attrs.field(init=False, default=None, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        self._device = config.device
        self._load()

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        with self._lock:
            self._loaded = None

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        import torch

        tokenizer, network, device = self._load()
        texts = [self._input(tokenizer, prompt, s.text) for s in samples]
        scores: list[float | None] = []
        # One forward at a time: a call the run gave up on (--reward-timeout) may still be running.
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=not self._chat(tokenizer),
                    return_tensors="pt",
                ).to(device)
                logits = network(**batch).logits.float()
                scores.extend(float(v) for v in logits[:, self.label])
        return scores

    def _chat(self, tokenizer: Any) -> bool:
        return self.format == "chat" or (self.format == "auto" and bool(getattr(tokenizer, "chat_template", None)))

    def _input(self, tokenizer: Any, prompt: Prompt, completion: str) -> str:
        # A pre-tokenized prompt is read as its decoded text: template and special tokens included.
        text = prompt_text(prompt) if prompt.tokens is not None else prompt.text or ""
        if not self._chat(tokenizer):
            return (text if prompt.messages is None else "\n".join(str(m.get("content")) for m in prompt.messages)) + completion
        messages = list(prompt.messages) if prompt.messages is not None else [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}], tokenize=False)

    def _load(self) -> tuple[Any, Any, Any]:
        with self._lock:
            if self._loaded is None:
                self._loaded = self._build()
            return self._loaded

    def _build(self) -> tuple[Any, Any, Any]:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from grpo_core.engine.models import model_path, resolve_precision

        device, dtype, _ = resolve_precision(self._device, self.dtype)
        path = model_path(self.model)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            network = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise PluginError(f"reward_model: cannot load {self.model!r} as a sequence-classification model: {exc}") from exc
        if self.label >= network.config.num_labels:
            raise PluginError(f"reward_model: label {self.label} is out of range: {self.model!r} has {network.config.num_labels} output(s)")
        if self.format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise PluginError(f"reward_model: format=chat, but the tokenizer of {self.model!r} has no chat template; use format=text")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        # The model reads its score at the last token that is not padding, found by this id.
        network.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.truncation_side = "left"
        tokenizer.padding_side = "right"
        return tokenizer, network.to(device).eval(), device
