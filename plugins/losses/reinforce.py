from __future__ import annotations

from typing import Literal

import attrs

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import finish_loss, validate_agg, validate_kl_estimator, validate_non_negative


@attrs.define
class ReinforceLoss:
    """REINFORCE: the plain policy gradient −A·w·log π, with no ratio and no clipping.

    Exact on-policy gradient of the expected advantage; nothing limits the step size, so
    use it when samples come from the current policy (synchronous, one step per batch) or as
    a baseline. Off-policy data needs importance_sampling, grpo or cispo instead.
    """

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
        policy_B_T = -padded.advantages_B_T * padded.logprobs_B_T
        return finish_loss(padded, policy_B_T, self.agg, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
