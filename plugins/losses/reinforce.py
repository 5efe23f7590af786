from __future__ import annotations

import attrs

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import (
    KLPenalty,
    finish_loss,
    validate_agg,
)


@attrs.define
class ReinforceLoss(KLPenalty):
    """REINFORCE: the plain policy gradient −A·w·log π, with no ratio and no clipping.

    Exact on-policy gradient of the expected advantage; nothing limits the step size, so
    use it when samples come from the current policy (synchronous, one step per batch) or as
    a baseline. Off-policy data needs importance_sampling, grpo or cispo instead.
    """

    agg: str = option("seq-mean-token-sum", help="aggregation over tokens and sequences", validator=validate_agg)

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        policy_B_T = -padded.advantages_B_T * padded.logprobs_B_T
        return finish_loss(padded, policy_B_T, self.agg, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
