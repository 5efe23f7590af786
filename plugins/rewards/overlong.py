from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core import PluginError, Prompt, Sample, hookimpl, option
from grpo_core.loss import validate_non_negative


@attrs.define
class OverlongReward:
    """DAPO's soft overlong punishment: 0 up to `max_tokens` − `buffer` completion tokens, then
    falling linearly to −`penalty` at `max_tokens` (and −`penalty` past it).

    Add it beside a correctness reward (`--reward gsm8k --reward overlong`): a completion that runs
    into the length limit is punished by how far into the buffer it went, rather than all at once,
    so the policy learns to finish within the limit. Each turn is measured on its own, as
    `--max-completion-tokens` limits each: a multi-turn sample gets its longest turn's penalty.
    `max_tokens` 0 is the run's `--max-completion-tokens` (`grpo-core eval` needs it given);
    `buffer` 0 is a fifth of it (DAPO: 4096 of 20480).
    """

    max_tokens: int = option(
        0,
        help="L_max: tokens of one completion (one turn) at which the penalty is whole (0 = --max-completion-tokens)",
        validator=validate_non_negative,
    )
    buffer: int = option(
        0, help="L_cache: tokens before max_tokens over which the penalty grows (0 = max_tokens // 5)", validator=validate_non_negative
    )
    penalty: float = option(1.0, help="the penalty at max_tokens and past it", validator=validate_non_negative)
    _run_max_tokens: int = attrs.field(default=0, init=False)

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        self._run_max_tokens = config.max_completion_tokens

    @hookimpl
    def check_config(self, config: Any) -> None:
        self.budget(config.max_completion_tokens)

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float]:
        limit, buffer = self.budget(self._run_max_tokens)
        return [self.penalty * overlong_punishment(longest_turn(s), limit, buffer) for s in samples]

    def budget(self, run_max_tokens: int) -> tuple[int, int]:
        """``max_tokens`` and ``buffer`` as they apply under a run's ``--max-completion-tokens``; refused
        in ``check_config`` before anything loads, and where a reward is asked without a run (eval's, a test's)."""
        limit = self.max_tokens or run_max_tokens
        if not limit:
            raise PluginError("reward overlong: set --reward-opt overlong.max_tokens=N (the run sets it from --max-completion-tokens)")
        buffer = self.buffer or max(1, limit // 5)
        if buffer > limit:
            raise PluginError(f"reward overlong: buffer {buffer} is longer than max_tokens {limit}")
        return limit, buffer


def longest_turn(sample: Sample) -> int:
    """The most tokens the policy generated in one turn of ``sample`` (its completion, single-turn)."""
    if not sample.turns:
        return sample.num_completion_tokens
    return max(turn.end - turn.start for turn in sample.turns)


def overlong_punishment(length: int, max_tokens: int, buffer: int) -> float:
    """0, then (max_tokens − buffer − length) / buffer in (−1, 0] over the buffer, then −1 (DAPO eq. 13)."""
    if length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return (max_tokens - buffer - length) / buffer
    return -1.0
