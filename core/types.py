"""Data that flows between the stages of a run: prompts in, samples out.

These are plain attrs classes with Python lists, so a rollout plugin, a remote sampler and a
reward function can build them without touching torch.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class Prompt:
    """One dataset row, ready to be rolled out.

    ``text`` is a plain prompt; ``messages`` a chat (list of ``{"role", "content"}``); exactly
    one is set. ``answer`` is the reference a reward compares against (e.g. a GSM8K answer).
    """

    id: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    answer: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class Completion:
    """What a sampler returns for one generated continuation of a prompt."""

    tokens: list[int]
    logprobs: list[float]
    """Log-probability of each sampled token under the sampling distribution (temperature,
    top-k and top-p applied), as the sampler drew it."""
    finish_reason: str
    """"stop" (eos or a stop string/token) or "length" (max tokens reached)."""


@attrs.define
class Sample:
    """One trajectory: a prompt and what the policy produced for it, as parallel token lists.

    ``tokens`` holds the whole sequence (prompt and completion; for multi-turn, every turn).
    ``sampling_logprobs[t]`` is the sampler's logprob of ``tokens[t]`` (0.0 where the token was
    not sampled), and ``loss_mask[t]`` is 1.0 where ``tokens[t]`` is trained on. Turns of a
    multi-turn trajectory show as transitions of ``loss_mask``.
    """

    prompt: Prompt
    tokens: list[int]
    sampling_logprobs: list[float]
    loss_mask: list[float]
    text: str
    """The decoded completion (what rewards read)."""
    finish_reason: str
    policy_version: int
    """Version of the weights that produced this sample (0 = the initial policy)."""
    reward: float | None = None
    rewards: dict[str, float | None] = attrs.field(factory=dict)
    """Score of each reward plugin by name, before weighting."""
    advantages: list[float] | None = None
    """Per-token advantages aligned with ``tokens`` (a sequence advantage broadcast)."""

    def __attrs_post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.sampling_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"sample lists differ in length: tokens={n}, "
                f"sampling_logprobs={len(self.sampling_logprobs)}, loss_mask={len(self.loss_mask)}"
            )

    @property
    def num_completion_tokens(self) -> int:
        return int(sum(self.loss_mask))


@attrs.define
class SamplingParams:
    """Generation knobs shared by every sampler backend."""

    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    stop: list[str] = attrs.field(factory=list)
    """Stop strings: generation ends once the decoded completion contains one."""
    stop_token_ids: list[int] = attrs.field(factory=list)
    """Stop tokens besides the tokenizer's eos."""
