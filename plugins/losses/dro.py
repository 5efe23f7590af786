from __future__ import annotations

import attrs

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import finish_loss, masked_diff, validate_agg, validate_non_negative


@attrs.define
class DROLoss:
    """DRO: the policy gradient −A·w·log π plus a quadratic pull ½·beta·(log π − log π_old)².

    Direct Reward Optimization's regularized objective: instead of clipping a ratio, the
    squared log-ratio keeps the policy near the one that produced the data, with a smooth
    gradient. Useful for offline or stale (off-policy) data. beta sets the pull; the quadratic
    term is never weighted by TIS.
    """

    beta: float = option(0.05, help="weight of the quadratic penalty ½·beta·(log π − log π_old)²", validator=validate_non_negative)
    agg: str = option("seq-mean-token-sum", help="aggregation over tokens and sequences", validator=validate_agg)

    @property
    def needs_reference(self) -> bool:
        """DRO regularizes toward π_old, never toward a reference model."""
        return False

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        policy_B_T = -padded.advantages_B_T * padded.logprobs_B_T
        penalty_B_T = 0.5 * self.beta * masked_diff(padded, padded.logprobs_B_T, padded.old_logprobs_B_T) ** 2
        metrics = {"loss/dro_penalty": padded.masked_mean(penalty_B_T)}
        return finish_loss(padded, policy_B_T, self.agg, metrics, penalty_B_T=penalty_B_T)
