from __future__ import annotations

from collections.abc import Sequence

import attrs

from grpo_core import Sample, hookimpl


@attrs.define
class RLOOAdvantage:
    """RLOO advantage: R_i − mean of the other samples' rewards (leave-one-out baseline).

    An unbiased baseline: a sample's own reward does not enter its baseline. Equals
    G/(G−1)·(R_i − mean R); a group of one sample gets 0 (no baseline, no signal).
    """

    @hookimpl
    def advantage(self, rewards_G: Sequence[float], samples: Sequence[Sample]) -> list[float]:
        n = len(rewards_G)
        if n < 2:
            return [0.0] * n
        total = sum(rewards_G)
        return [r - (total - r) / (n - 1) for r in rewards_G]
