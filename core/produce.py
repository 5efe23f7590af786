"""Producing training groups, the same for both loops and for evaluation: roll prompts out, score
them, compute their advantages and filter the groups (:func:`roll_and_score`); and the run's prompt
order as a loop takes prompts from it one at a time (:class:`PromptQueue`).

The async loop runs the two halves apart (:func:`roll` in a worker, retried, once per trajectory
where the rollout asks; the :class:`Scorer` once the group is whole); evaluation scores rewards only.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from grpo_core.config import RunConfig
from grpo_core.metrics import Metrics, scope
from grpo_core.stages import compute_advantages, score_groups
from grpo_core.types import Prompt, RewardFailures, Sample, SamplingParams

if TYPE_CHECKING:
    from grpo_core.selection import Selection


@attrs.define
class Produced:
    """The groups rolled out (all, and those kept for training), their metrics (the rollout's, the
    rewards', the advantages') and the seconds spent scoring them."""

    groups: list[list[Sample]]
    kept: list[list[Sample]]
    metrics: Metrics
    reward_seconds: float


@attrs.define
class Scorer:
    """What turns rolled-out groups into training groups: the rewards (their failures counted in
    ``failures``), then, when ``advantages``, the advantages and the group filters (the
    ``zero_variance`` one first when ``drop_zero_variance``)."""

    selection: Selection
    failures: RewardFailures
    max_failures_in_a_row: float
    timeout: float
    advantages: bool = True
    drop_zero_variance: bool = True
    trainer: Any = None
    """The trainer an advantage that scores with the policy reads (``prepare_advantages``)."""
    max_samples_per_call: int | None = None
    lock: contextlib.AbstractContextManager[Any] | None = None
    """Held while scoring: rewards and their failure count are shared by the async loop's workers."""
    trainer_lock: contextlib.AbstractContextManager[Any] | None = None
    """Held by the policy scorer's forwards while a step changes the weights meanwhile (async loop)."""

    @classmethod
    def for_training(cls, config: RunConfig, selection: Selection, failures: RewardFailures, trainer: Any, **locks: Any) -> Scorer:
        return cls(
            selection, failures, config.max_reward_failures_in_a_row, config.reward_timeout,
            drop_zero_variance=config.drop_zero_variance_groups, trainer=trainer, max_samples_per_call=config.max_samples_per_fwd_bwd,
            **locks,
        )  # fmt: skip

    def __call__(self, groups: Sequence[Sequence[Sample]]) -> tuple[list[list[Sample]], Metrics]:
        """The groups kept for training (none without ``advantages``) and the scoring's metrics."""
        with self.lock if self.lock is not None else contextlib.nullcontext():
            metrics = score_groups(self.selection, groups, self.max_failures_in_a_row, self.timeout, self.failures)
            if not self.advantages:
                return [], metrics
            kept, advantage_metrics = compute_advantages(
                self.selection.manager, groups, self.drop_zero_variance, self.trainer, self.max_samples_per_call, self.trainer_lock,
                self.selection.group_filters,
            )  # fmt: skip
        metrics.merge(advantage_metrics)
        return kept, metrics


def roll(selection: Selection, prompts: Sequence[Prompt], num_samples: int, sampler: Any, params: SamplingParams) -> tuple[Any, Metrics]:
    """The rollout hook's groups of ``prompts``, and what the rollout and the sampler recorded meanwhile."""
    with scope() as rolled:
        groups = selection.manager.hook.rollout(
            prompts=prompts, num_samples=num_samples, sampler=sampler, params=params, **selection.rollout_args
        )
    return groups, rolled


def roll_and_score(scorer: Scorer, prompts: Sequence[Prompt], num_samples: int, sampler: Any, params: SamplingParams) -> Produced:
    """Rollout, rewards, advantages, filters: ``num_samples`` samples of each prompt, scored."""
    groups, metrics = roll(scorer.selection, prompts, num_samples, sampler, params)
    t0 = time.perf_counter()
    kept, scored = scorer(groups)
    metrics.merge(scored)
    return Produced(groups, kept, metrics, time.perf_counter() - t0)


@attrs.define
class Taken:
    """A prompt taken from the run's order: ``index`` is its place there (unique across epochs)."""

    index: int
    prompt: Prompt
    requeued: int = 0
    """Times its group came back too stale; from the first, the trainer waits for it rather than go past its bound."""


class PromptQueue:
    """Prompts in the run's order, after the ones to sample again (stale or in flight at a checkpoint).

    ``admit`` (the group filters' ``keep_prompt``) is asked of each prompt of the order as the
    queue comes to it: one it refuses is passed over (the cursor moves past it, counted in
    ``passed_over``) and the next one takes its place."""

    def __init__(self, stream: Iterator[Taken], cursor: int, again: list[Taken], admit: Callable[[Prompt], bool] | None = None) -> None:
        self.stream = stream
        self.cursor = cursor
        self.again: collections.deque[Taken] = collections.deque(again)
        self.peeked: Taken | None = None
        self.admit = admit
        self.passed_over = 0

    def has_more(self) -> bool:
        if self.again or self.peeked:
            return True
        for taken in self.stream:
            if self.admit is None or self.admit(taken.prompt):
                self.peeked = taken
                return True
            self.cursor += 1
            self.passed_over += 1
        return False

    def take(self, n: int) -> list[Taken]:
        taken: list[Taken] = []
        while len(taken) < n and self.has_more():
            if self.again:
                taken.append(self.again.popleft())
            else:
                taken.append(self.peeked)
                self.peeked = None
                self.cursor += 1
        return taken


def prompt_admission(selection: Selection) -> Callable[[Prompt], bool] | None:
    """What decides whether the run's order rolls a prompt out: every group filter's ``keep_prompt``
    (None when no filter implements it)."""
    hook = selection.manager.hook.keep_prompt
    if not hook.get_hookimpls():
        return None
    return lambda prompt: all(hook(prompt=prompt))


def prompt_stream(batches: Iterator[list[Prompt]], first_index: int, cursor: int) -> Iterator[Taken]:
    """The run's prompt order from ``cursor`` on; ``batches`` (a run's) starts at the prompt of index ``first_index``."""
    index = first_index
    for batch in batches:
        for prompt in batch:
            if index >= cursor:
                yield Taken(index, prompt)
            index += 1
