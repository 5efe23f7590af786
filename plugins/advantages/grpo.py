from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import attrs

from grpo_core import Sample, hookimpl, option


@attrs.define
class GRPOAdvantage:
    """Group-normalized advantage: (R_i − mean R) / (std R + 1e-8); all zero when std < 1e-8.

    The classic GRPO advantage. std=unbiased divides by G−1, std=population by G.
    """

    std: Literal["unbiased", "population"] = option("unbiased", help="std of the group: unbiased (G-1) or population (G)")

    @hookimpl
    def advantage(self, rewards_G: Sequence[float], samples: Sequence[Sample]) -> list[float]:
        n = len(rewards_G)
        mean = sum(rewards_G) / n
        dof = n - 1 if self.std == "unbiased" else n
        var = sum((r - mean) ** 2 for r in rewards_G) / dof if dof > 0 else 0.0
        std = math.sqrt(var)
        if std < 1e-8:
            return [0.0] * n
        return [(r - mean) / (std + 1e-8) for r in rewards_G]
