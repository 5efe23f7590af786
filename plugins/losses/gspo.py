from __future__ import annotations

import attrs
import torch

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import (
    KLPenalty,
    clipped_surrogate,
    finish_loss,
    log_cap_option,
    sequence_log_ratio,
    validate_agg,
    validate_eps_low,
    validate_non_negative,
)


@attrs.define
class GSPOLoss(KLPenalty):
    """GSPO: the clipped surrogate on a sequence-level ratio s = exp(mean log(π/π_old)).

    Per token: max(−s·A, −clip(s, 1−eps_low, 1+eps_high)·A)·w, with s the sequence's
    geometric-mean ratio (token form: value s, gradient s·∇log π_t). Clipping whole sequences
    instead of single tokens is more stable for long sequences and mixture-of-experts models,
    whose token ratios are noisy. Its clip range is tiny (3e-4/4e-4) since s averages tokens.
    """

    eps_low: float = option(3e-4, help="lower clip range of the sequence ratio (>= 1: no lower clip)", validator=validate_eps_low)
    eps_high: float = option(4e-4, help="upper clip range of the sequence ratio", validator=validate_non_negative)
    seq_ratio_log_cap: float = log_cap_option("sequence")
    agg: str = option("seq-mean-token-mean", help="aggregation over tokens and sequences", validator=validate_agg)

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        logprobs_B_T = padded.logprobs_B_T
        log_s_B = sequence_log_ratio(padded, self.seq_ratio_log_cap).detach()
        # log s_{i,t} = π_t − sg(π_t) + sg(log s_i): the value of s_i, the gradient s_i·∇π_t.
        seq_ratio_B_T = torch.exp(logprobs_B_T - logprobs_B_T.detach() + log_s_B[:, None])
        policy_B_T, metrics = clipped_surrogate(padded, seq_ratio_B_T, self.eps_low, self.eps_high)
        return finish_loss(padded, policy_B_T, self.agg, metrics, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
