from __future__ import annotations

from typing import Any

import attrs

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import (
    KLPenalty,
    finish_loss,
    log_cap_option,
    service_loss,
    validate_agg,
    validate_eps_low,
    validate_non_negative,
)


@attrs.define
class CISPOLoss(KLPenalty):
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

    Per token: −sg(clip(r, 1−eps_low, 1+eps_high))·A·w·log π. Unlike PPO-style clipping,
    no token ever loses its gradient: only the weight is truncated. Good for off-policy or
    async training and for rare but important tokens (reflection, "wait") that PPO would clip.
    eps_low >= 1 removes the lower bound of the weight, as MiniMax-M1 trains.
    """

    eps_low: float = option(
        0.2, help="lower bound of the ratio weight: 1-eps_low (>= 1: no lower bound, as in MiniMax-M1)", validator=validate_eps_low
    )
    eps_high: float = option(0.28, help="upper bound of the ratio weight: 1+eps_high", validator=validate_non_negative)
    ratio_log_cap: float = log_cap_option("token")
    agg: str = option("token-mean", help="aggregation over tokens and sequences", validator=validate_agg)

    @property
    def service_loss(self) -> dict[str, Any] | None:
        """The Tinker service's cispo loss computes it (declared in hookspecs)."""
        return service_loss(self, CISPOLoss, "cispo")

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        ratio_B_T = padded.ratio_B_T(self.ratio_log_cap).detach()
        weight_B_T = ratio_B_T.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        metrics = {
            # how often the ratio weight is truncated (the token keeps its gradient)
            "loss/clip_frac_low": padded.masked_mean((ratio_B_T < 1.0 - self.eps_low).float()),
            "loss/clip_frac_high": padded.masked_mean((ratio_B_T > 1.0 + self.eps_high).float()),
            "loss/ratio_mean": padded.masked_mean(ratio_B_T),
        }
        policy_B_T = -weight_B_T * padded.advantages_B_T * padded.logprobs_B_T
        return finish_loss(padded, policy_B_T, self.agg, metrics, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
