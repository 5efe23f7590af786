"""The ``agent`` reward: what the agent program printed as its reward."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from grpo_core import Prompt, Sample, hookimpl


@attrs.define
class AgentReward:
    """The reward the agent rollout's program printed as its last stdout line, {"reward": x}
    (Sample.env_reward: the program is the policy's environment). The default reward of
    --rollout agent; a program that printed none is a failed score (reward/failed), never 0.
    """

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        return [s.env_reward for s in samples]
