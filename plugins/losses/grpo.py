from __future__ import annotations

from typing import Any

import attrs

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import (
    KLPenalty,
    clipped_surrogate,
    finish_loss,
    log_cap_option,
    service_loss,
    validate_agg,
    validate_eps_low,
    validate_non_negative,
)


@attrs.define
class GRPOLoss(KLPenalty):
    """GRPO: PPO's clipped surrogate on group-normalized advantages, plus an optional KL penalty.

    Per token: max(−r·A, −clip(r, 1−eps_low, 1+eps_high)·A)·w + kl_beta·KL(π‖π_ref), with
    r = π/π_old and w the TIS weight. The default choice: stable and well understood. Set
    kl_beta=0 to drop the reference model (no extra forward pass); k3 is the low-variance,
    always-positive KL estimator, k1 the original one.
    """

    eps_low: float = option(
        0.2, help="lower clip range: ratios below 1-eps_low stop pushing down (>= 1: no lower clip)", validator=validate_eps_low
    )
    eps_high: float = option(0.2, help="upper clip range: ratios above 1+eps_high stop pushing up", validator=validate_non_negative)
    ratio_log_cap: float = log_cap_option("token")
    kl_beta: float = option(
        0.001, help="weight of the KL penalty to the reference policy; 0 = no reference model", validator=validate_non_negative
    )
    agg: str = option("seq-mean-token-sum", help="aggregation over tokens and sequences", validator=validate_agg)

    @property
    def service_loss(self) -> dict[str, Any] | None:
        """The Tinker service's ppo loss computes it (declared in hookspecs)."""
        return service_loss(self, GRPOLoss, "ppo")

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        policy_B_T, metrics = clipped_surrogate(padded, padded.ratio_B_T(self.ratio_log_cap), self.eps_low, self.eps_high)
        return finish_loss(padded, policy_B_T, self.agg, metrics, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
