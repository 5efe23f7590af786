from __future__ import annotations

from collections.abc import Sequence

import attrs

from grpo_core import Sample, hookimpl


@attrs.define
class DrGRPOAdvantage:
    """Dr. GRPO advantage: R_i − mean R, without dividing by the group's std.

    Dividing by the std up-weights groups whose rewards barely differ (too easy or too hard
    prompts); Dr. GRPO removes that bias. Pair it with agg=seq-mean-token-sum-norm to also
    remove the length bias.
    """

    @hookimpl
    def advantage(self, rewards_G: Sequence[float], samples: Sequence[Sample]) -> list[float]:
        n = len(rewards_G)
        if n == 0:
            return []
        mean = sum(rewards_G) / n
        return [r - mean for r in rewards_G]
