"""The ``env`` reward: what the environment itself gave the conversation."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from grpo_core import Prompt, Sample, hookimpl


@attrs.define
class EnvReward:
    """The environment's reward: the sum of the rewards the selected --env gave over the
    conversation (Sample.env_reward). The default reward when an environment is selected.
    """

    needs_env = True
    """Not an option: tells the run to refuse this reward without --env."""

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        # None (no environment stepped this sample) marks it failed rather than scoring it 0.
        return [s.env_reward for s in samples]
