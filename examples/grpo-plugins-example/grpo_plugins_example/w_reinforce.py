"""The ``w_reinforce`` loss: the policy gradient with positive samples down-weighted."""

from __future__ import annotations

import attrs
import torch

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import KLPenalty, finish_loss, validate_agg, validate_non_negative


@attrs.define
class WReinforceLoss(KLPenalty):
    """W-REINFORCE: the policy gradient with positive advantages weighted by positive_weight.

    Per token: −λ_t·A_t·r_t·w, with r_t = π_t/π_old,t, λ_t = positive_weight where A_t > 0 and 1
    elsewhere, w the TIS weight (1 without a TIS wrapper), plus kl_beta·KL_t when kl_beta > 0.
    On-policy r = 1 and the gradient is REINFORCE's, −λ_t·A_t·∇log π; the ratio keeps it
    unbiased when samples are off-policy. Zhu et al., "The Surprising Effectiveness of Negative
    Reinforcement in LLM Reasoning" (arXiv:2506.01347): penalizing wrong samples keeps pass@k
    high while reinforcing right ones narrows the policy; they recommend λ = 0.1.
    positive_weight=1 is importance_sampling; 0 trains on negative samples only (NSR).
    """

    positive_weight: float = option(
        0.1,
        help="λ: weight of tokens with a positive advantage (1 = plain policy gradient, 0 = negative samples only)",
        validator=validate_non_negative,
    )
    agg: str = option("token-mean", help="aggregation over tokens and sequences", validator=validate_agg)

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        adv_B_T = padded.advantages_B_T
        positive_B_T = adv_B_T > 0
        weight_B_T = torch.where(positive_B_T, torch.full_like(adv_B_T, self.positive_weight), torch.ones_like(adv_B_T))
        policy_B_T = -weight_B_T * adv_B_T * padded.ratio_B_T()
        metrics = {"loss/positive_frac": padded.masked_mean(positive_B_T.float())}
        return finish_loss(padded, policy_B_T, self.agg, metrics, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
