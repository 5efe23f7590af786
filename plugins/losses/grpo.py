from __future__ import annotations

from typing import Literal

import attrs

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import aggregate, clipped_surrogate, kl_term, validate_agg


@attrs.define
class GRPOLoss:
    """GRPO: PPO's clipped surrogate on group-normalized advantages, plus an optional KL penalty.

    Per token: max(−r·A, −clip(r, 1−eps_low, 1+eps_high)·A)·w + kl_beta·KL(π‖π_ref), where
    r = π/π_old. The default choice: stable, well understood. Set kl_beta=0 to drop the
    reference model (no extra forward pass); k3 is the low-variance, always-positive KL
    estimator, k1 the original one.
    """

    eps_low: float = option(0.2, help="lower clip range: ratios below 1-eps_low stop pushing down")
    eps_high: float = option(0.2, help="upper clip range: ratios above 1+eps_high stop pushing up")
    kl_beta: float = option(0.001, help="weight of the KL penalty to the reference policy; 0 = no reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = option("k3", help="KL estimator: k1, k2 or k3")
    agg: str = option("seq-mean-token-sum", help="aggregation over tokens and sequences", validator=validate_agg)

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        policy_B_T, metrics = clipped_surrogate(padded, padded.ratio_B_T(), self.eps_low, self.eps_high)
        policy_B_T = padded.weighted(policy_B_T)
        term_B_T = policy_B_T
        if self.kl_beta > 0:
            kl_B_T = kl_term(padded, self.kl_estimator)
            term_B_T = term_B_T + self.kl_beta * kl_B_T
            metrics["loss/kl"] = padded.masked_mean(kl_B_T)
        metrics["loss/policy"] = float(aggregate(policy_B_T.detach(), padded, self.agg))
        metrics["loss/active_tokens"] = float(padded.mask_B_T.sum())
        return LossOutput(loss=aggregate(term_B_T, padded, self.agg), metrics=metrics)
