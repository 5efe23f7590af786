"""The ``brevity`` reward: shorter completions score higher."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from grpo_core import Prompt, Sample, hookimpl, option


def _validate_limit(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not value > 0:
        raise ValueError(f"limit must be > 0 (completion tokens at which the reward reaches 0), not {value!r}")


@attrs.define
class BrevityReward:
    """Brevity: 1 − completion tokens / limit, floored at 0 (1 for an empty completion).

    A length penalty to add beside a correctness reward with a small weight, e.g.
    `--reward gsm8k --reward brevity:0.1`: among right answers the shorter one wins. It counts
    the tokens the policy generated (the trained tokens), not characters.
    """

    # Read by grpo-core's data loader: brevity scores any row, with or without an answer.
    needs_answer = False

    limit: int = option(256, help="completion tokens at which the reward reaches 0", validator=_validate_limit)

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float]:
        return [max(0.0, 1.0 - s.num_completion_tokens / self.limit) for s in samples]
