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
    validate_positive_or_none,
)


@attrs.define
class ImportanceSamplingLoss(KLPenalty):
    """Importance-sampled policy gradient: −A·w·ρ with ρ = π/π_old, optionally min(ρ, clip_rho).

    The unbiased off-policy correction (Tinker's importance_sampling loss): the gradient is
    −A·ρ·∇log π. With no clipping a large ratio makes a large step; set clip_rho (e.g. 2) to
    truncate the ratio when data is noticeably off-policy.
    """

    clip_rho: float | None = option(
        None, help="truncate the ratio at this value (None = no truncation)", validator=validate_positive_or_none
    )
    ratio_log_cap: float = log_cap_option("token")
    agg: str = option("seq-mean-token-sum", help="aggregation over tokens and sequences", validator=validate_agg)

    @property
    def service_loss(self) -> dict[str, Any] | None:
        """The Tinker service's importance_sampling loss computes it without clip_rho (declared in hookspecs)."""
        return service_loss(self, ImportanceSamplingLoss, "importance_sampling", clipped=False) if self.clip_rho is None else None

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        ratio_B_T = padded.ratio_B_T(self.ratio_log_cap)
        metrics = {"loss/ratio_mean": padded.masked_mean(ratio_B_T)}
        rho_B_T = ratio_B_T
        if self.clip_rho is not None:
            rho_B_T = ratio_B_T.clamp(max=self.clip_rho)
            metrics["loss/clip_frac_high"] = padded.masked_mean((ratio_B_T.detach() > self.clip_rho).float())
        policy_B_T = -padded.advantages_B_T * rho_B_T
        return finish_loss(padded, policy_B_T, self.agg, metrics, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
