from __future__ import annotations

from typing import Literal

import attrs

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import (
    finish_loss,
    validate_agg,
    validate_kl_estimator,
    validate_non_negative,
    validate_positive_or_none,
)


@attrs.define
class ImportanceSamplingLoss:
    """Importance-sampled policy gradient: −A·w·ρ with ρ = π/π_old, optionally min(ρ, clip_rho).

    The unbiased off-policy correction (Tinker's importance_sampling loss): the gradient is
    −A·ρ·∇log π. With no clipping a large ratio makes a large step; set clip_rho (e.g. 2) to
    truncate the ratio when data is noticeably off-policy.
    """

    clip_rho: float | None = option(None, help="truncate the ratio at this value (None = no truncation)", validator=validate_positive_or_none)
    kl_beta: float = option(0.0, help="weight of a KL penalty to the reference policy; 0 = none (no reference model)", validator=validate_non_negative)
    kl_estimator: Literal["k1", "k2", "k3"] = option("k3", help="KL estimator: k1, k2 or k3", validator=validate_kl_estimator)
    agg: str = option("seq-mean-token-sum", help="aggregation over tokens and sequences", validator=validate_agg)

    @property
    def needs_reference(self) -> bool:
        """True when the KL term is on: the run computes reference logprobs."""
        return self.kl_beta > 0

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        ratio_B_T = padded.ratio_B_T()
        metrics = {"loss/ratio_mean": padded.masked_mean(ratio_B_T)}
        rho_B_T = ratio_B_T
        if self.clip_rho is not None:
            rho_B_T = ratio_B_T.clamp(max=self.clip_rho)
            metrics["loss/clip_frac_high"] = padded.masked_mean((ratio_B_T.detach() > self.clip_rho).float())
        policy_B_T = -padded.advantages_B_T * rho_B_T
        return finish_loss(padded, policy_B_T, self.agg, metrics, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
