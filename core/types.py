"""Data that flows between the stages of a run: prompts in, samples out.

These are plain attrs classes with Python lists, so a rollout plugin, a remote sampler and a
reward function can build them without touching torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs


@attrs.define
class Prompt:
    """One dataset row, ready to be rolled out.

    ``text`` is a plain prompt; ``messages`` a chat (list of ``{"role", "content"}``); ``tokens``
    the prompt's token ids, given pre-tokenized and sampled as they are (no template, no special
    tokens added); exactly one is set. ``answer`` is the reference a reward compares against
    (e.g. a GSM8K answer).
    """

    id: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    answer: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    tokens: list[int] | None = None
    source: str | None = None
    """The name of the mixture's source the row came from (``--mix NAME=...``); None outside a mixture."""
    decoded: str | None = None
    """A pre-tokenized prompt's ids decoded by the policy's tokenizer, special tokens kept: set
    once the ids are checked against its vocabulary, what :func:`prompt_text` gives a reward or a
    logger that reads text (a judge, a reward model)."""


def prompt_text(prompt: Prompt) -> str:
    """A plain prompt as the model saw it (template applied); a chat as ``role: content`` lines;
    a pre-tokenized prompt as its ids decoded (:attr:`Prompt.decoded`), or as the ids themselves
    where nothing decoded them (a prompt a plugin made)."""
    if prompt.tokens is not None:
        return prompt.decoded if prompt.decoded is not None else f"token ids: {' '.join(map(str, prompt.tokens))}"
    if prompt.messages is not None:
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt.messages)
    return prompt.text or ""


@attrs.define
class PromptImages:
    """An image prompt's images as a sampler takes them (``sample(..., images=...)``)."""

    sources: list[str]
    """Each image as the row gave it, resolved (:mod:`grpo_core.images`): an absolute path, an
    http(s) URL or a data URL; what a server or an engine that reads images itself gets."""
    tensors: dict[str, Any]
    """The model's processor's tensors of them (``pixel_values``...): what an in-process sampler
    places over the prompt's image tokens, and what the samples carry to the trainer."""
    messages: list[dict[str, Any]] | None = None
    """The prompt's chat, its image parts resolved (:func:`grpo_core.images.resolve_images`): what a
    server that renders the chat and reads the images itself gets (the openai sampler)."""


@attrs.define
class Completion:
    """What a sampler returns for one generated continuation of a prompt."""

    tokens: list[int]
    logprobs: list[float]
    """Log-probability of each sampled token under the sampling distribution (temperature,
    top-k and top-p applied), as the sampler drew it."""
    finish_reason: str
    """"stop" (eos or a stop string/token) or "length" (max tokens reached)."""
    routed_experts: Any = None
    """A mixture-of-experts model's routing, where the sampler records it: the experts each token
    it forwarded was routed to, per MoE layer, as a ``[len(prompt) + len(tokens) - 1, layers,
    top_k]`` uint8 (int16 past 256 experts) torch tensor: the prompt's tokens and every drawn token
    but the last (never forwarded). None otherwise."""


@attrs.define
class Turn:
    """One policy turn inside ``Sample.tokens``."""

    start: int
    """First token the policy produced in this turn."""
    end: int
    """One past its last token."""
    context_end: int
    """The conversation up to the next generation point: ``tokens[:context_end]`` is what the
    policy would be prompted with next (this turn, the environment's observation, and the next
    assistant header); ``== len(tokens)`` for the last turn."""


@attrs.define
class EnvStep:
    """What an environment answers to one policy turn."""

    messages: list[dict[str, Any]]
    """Observation messages appended to the conversation (role ``user`` or ``tool``)."""
    reward: float = 0.0
    done: bool = False
    cut_at_max_turns: bool = False
    """With ``done``: the episode ended because the rollout takes no more turns (an environment told
    the rollout's max_turns, as verifiers' seat is), not on its own; counted in multi_turn/max_turns_frac."""


@runtime_checkable
class Episode(Protocol):
    """One conversation with an environment, made by its ``env_reset`` hook for one trajectory.

    ``messages`` are the conversation's first messages (e.g. a system and a user message);
    ``step`` gets each policy turn and answers with an :class:`EnvStep`. An episode serves one
    trajectory only, so it may keep state (turns taken, clues given); ``step`` is not called
    again after it answered ``done=True``.
    """

    messages: list[dict[str, Any]]

    def step(self, text: str, tokens: list[int]) -> EnvStep:
        """The policy's turn as decoded text (special tokens removed) and as its sampled tokens."""


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
    turns: list[Turn] = attrs.field(factory=list)
    """The policy's turns inside ``tokens``, in order (empty for a single-turn sample)."""
    env_reward: float | None = None
    """The sum of the rewards the environment gave in this trajectory (None without an environment)."""
    reward_details: dict[str, str] = attrs.field(factory=dict)
    """What a reward said about this sample beyond its score (an LLM judge's reply), by reward
    name; sample tables show it as ``reward_detail/<name>``."""
    routed_experts: Any = None
    """The sampler's mixture-of-experts routing of ``tokens[:-1]`` (the trainer's model input):
    a ``[len(tokens) - 1, layers, top_k]`` tensor of expert indices (see
    :attr:`Completion.routed_experts`), or None where the sampler records none. What
    ``--router-replay R3`` forces the trainer's forward to use."""
    images: dict[str, Any] | None = None
    """An image prompt's image tensors as its model's processor made them (``pixel_values``, and
    ``image_sizes`` or the like where the model takes them), the same dict for every sample of its
    group: what the trainer's forward places over the prompt's image tokens, as the sampler did.
    None for a prompt without images."""

    def __attrs_post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.sampling_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"sample lists differ in length: tokens={n}, "
                f"sampling_logprobs={len(self.sampling_logprobs)}, loss_mask={len(self.loss_mask)}"
            )
        if self.routed_experts is not None and len(self.routed_experts) != n - 1:
            raise ValueError(f"routed_experts has {len(self.routed_experts)} rows for a sample of {n} tokens (routes cover tokens[:-1])")

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


@attrs.define
class RewardFailures:
    """Samples whose rewards failed in a row, and the last reward error: what stops a run at
    ``--max-reward-failures-in-a-row``. An evaluation scores with its own, never the training's."""

    in_a_row: int = 0
    last_error: str | None = None
    last_was_cut: bool = False
    """The last failure was a sample cut at its token budget that its reward could not score (an
    environment that scores a conversation at its end): more tokens fix it, not the reward."""


CHECKPOINTED = ("step", "policy_version", "reward_failures_in_a_row", "nonfinite_in_a_row", "history", "prompts_taken", "filter_states")
"""The fields of :class:`RunState` a checkpoint holds (its ``state.json``, in this order)."""


@attrs.define
class RunState:
    """The run's one state: what the loops, the evaluation and the checkpoints read and write, and
    what on_step plugins may read and change while the run goes on."""

    run_dir: Path
    total_steps: int = 0
    step: int = 0
    policy_version: int = 0
    reward_failures_in_a_row: int = 0
    """``reward_failures.in_a_row`` when the last step was counted: what its checkpoint holds
    (the async loop's rollouts go on scoring the next steps' groups meanwhile)."""
    nonfinite_in_a_row: int = 0
    history: list[float | None] = attrs.field(factory=list)
    """``reward/total`` of every step so far (the summary compares its first and last steps)."""
    prompts_taken: int = 0
    """``--dynamic-sampling`` or a group filter's ``keep_prompt``: prompts the sync loop took from the run's
    order, those passed over included (a step may take more than its batch)."""
    filter_states: dict[str, Any] = attrs.field(factory=dict)
    """The ``state_dict()`` of each group filter that has one, by name, as the last step left it."""
    stop_reason: str | None = None
    signal: int | None = None
    """The signal (SIGINT, SIGTERM) that asked the run to stop."""
    rng: dict[str, Any] | None = None
    """Every RNG as it was when the last step completed: what a checkpoint of that step holds."""
    data: dict[str, int] = attrs.field(factory=dict)
    """Prompts used and rows skipped (``data/...``), reported in the summary and step 1's metrics."""
    unobserved: dict[str, float] | None = None
    """The metrics of the step counted last while not every plugin has observed it yet (a
    checkpoint written meanwhile keeps them, for the resumed run to record)."""
    reward_failures: RewardFailures = attrs.field(factory=RewardFailures)
    """The training's reward failures as its scoring counts them."""
    start_step: int = 0
    """The step a resumed run continued from (0 for a new run)."""
    groups_trained: float = 0.0
    groups_dropped: dict[str, float] = attrs.field(factory=dict)
    """Prompt groups trained on, and dropped by reason (``failed``: their reward failed; ``skipped``:
    no samples; a group filter's name), by this process's steps."""
    samples_kept: float = 0.0
    samples_masked_truncated: float = 0.0
    tokens_trained: float = 0.0
    """The kept groups' samples, those of them --mask-truncated masked, and the tokens trained, by
    this process's steps: a run whose kept samples had no token to train trained nothing."""

    @property
    def interrupted(self) -> bool:
        return self.signal is not None

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason
