from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from grpo_core import Prompt, Sample, SamplingParams, hookimpl, option
from grpo_core.backend import Sampler
from grpo_core.engine.vision import encode_image_prompt
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.images import has_images, image_sources
from grpo_core.types import PromptImages


@attrs.define
class SingleTurnRollout:
    """One prompt, one completion: the prompt's text or chat messages become tokens, the
    sampler continues them, and the completion tokens are trained on.

    Chat messages (and, with chat_template=true, plain prompts) go through the tokenizer's
    chat template when it has one; a pre-tokenized row's token ids are sampled as they are.
    """

    token_prompts = True

    chat_template: bool = option(True, help="wrap plain-text prompts in the tokenizer's chat template when it has one")
    long_prompts: Literal["error", "skip"] = option(
        "error", help="a prompt that leaves no room for max_tokens: stop with an error, or skip its group (counted)"
    )
    _token_cache: dict[str, list[int]] = attrs.field(factory=dict, init=False, repr=False)

    @hookimpl
    def rollout(self, prompts: Sequence[Prompt], num_samples: int, sampler: Sampler, params: SamplingParams) -> list[list[Sample]]:
        tokenizer = sampler.tokenizer
        # An image prompt's images are read once per rollout, for all of its group's samples.
        images = [self._encode_images(tokenizer, p, sampler) if has_images(p) else None for p in prompts]
        encoded = [self.encode(tokenizer, p) for p in prompts]
        fits = [self._fits(p, tokens, sampler.max_context, params.max_tokens) for p, tokens in zip(prompts, encoded)]
        prompt_tokens = [tokens for tokens, ok in zip(encoded, fits) if ok]
        with_images = {"images": [i for i, ok in zip(images, fits) if ok]} if any(i is not None for i in images) else {}
        groups = iter(sampler.sample(prompt_tokens, num_samples, params, **with_images) if prompt_tokens else [])
        kept = [(p, tokens, next(groups), i) for p, tokens, ok, i in zip(prompts, encoded, fits, images) if ok]
        texts = iter(tokenizer.batch_decode([c.tokens for _, _, g, _ in kept for c in g], skip_special_tokens=True))
        by_prompt: dict[int, list[Sample]] = {}
        for prompt, tokens, group, prompt_images in kept:
            by_prompt[id(prompt)] = [
                Sample(
                    prompt=prompt,
                    tokens=tokens + c.tokens,
                    sampling_logprobs=[0.0] * len(tokens) + c.logprobs,
                    loss_mask=[0.0] * len(tokens) + [1.0] * len(c.tokens),
                    text=next(texts),
                    finish_reason=c.finish_reason,
                    policy_version=sampler.version,
                    routed_experts=c.routed_experts,
                    images=None if prompt_images is None else prompt_images.tensors,
                )
                for c in group
            ]
        # A skipped prompt keeps its place as an empty group.
        return [by_prompt.get(id(p), []) for p in prompts]

    # The dataset's length check at start-up (grpo_core.data.check_prompt_lengths) finds long
    # prompts before the model loads; this one catches a rollout called on other prompts.
    def _fits(self, prompt: Prompt, tokens: list[int], max_context: int | None, max_tokens: int) -> bool:
        if max_context is None or len(tokens) + max_tokens <= max_context:
            return True
        if self.long_prompts == "skip":
            return False
        raise PluginError(
            f"prompt {prompt.id} has {len(tokens)} tokens; with max_completion_tokens={max_tokens} that exceeds "
            f"the model's {max_context}: shorten it, lower --max-completion-tokens, or pass --rollout-opt long_prompts=skip"
        )

    def _encode_images(self, tokenizer: Any, prompt: Prompt, sampler: Sampler) -> PromptImages:
        if not declared(sampler, "sampler object", "takes_images"):
            raise PluginError(f"prompt {prompt.id} has images, but the {type(sampler).__name__} does not take image prompts")
        tokens, tensors = encode_image_prompt(tokenizer, prompt)
        self._token_cache[prompt.id] = tokens
        return PromptImages(image_sources(prompt.messages), tensors, prompt.messages)

    def encode(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The prompt's tokens as the sampler will see them (chat template applied or not).

        The start-up length check calls this for every dataset row; the tokens are kept, so
        the rollout does not encode a prompt twice.
        """
        cached = self._token_cache.get(prompt.id)
        if cached is None:
            cached = self._token_cache[prompt.id] = encode_prompt(tokenizer, prompt, self.chat_template)
        return cached


def encode_prompt(tokenizer: Any, prompt: Prompt, chat_template: bool) -> list[int]:
    if prompt.tokens is not None:
        return list(prompt.tokens)
    if has_images(prompt):
        return encode_image_prompt(tokenizer, prompt)[0]
    has_template = getattr(tokenizer, "chat_template", None) is not None
    messages = prompt.messages
    if messages is None and chat_template and has_template:
        messages = [{"role": "user", "content": prompt.text}]
    if messages is not None:
        if not has_template:
            raise PluginError(f"prompt {prompt.id} is a chat (messages) but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt.text)["input_ids"])
