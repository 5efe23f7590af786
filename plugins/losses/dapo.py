from __future__ import annotations

from typing import Any

import attrs
import torch

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


def _validate_dual_clip(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 1:
        raise ValueError(f"dual_clip must be > 1 (it caps −r·A at −dual_clip·A for A < 0) or None, not {value!r}")


@attrs.define
class DAPOLoss(KLPenalty):
    """DAPO: GRPO's clipped surrogate with a higher upper clip ("clip-higher") and token-mean.

    Per token: max(−r·A, −clip(r, 1−eps_low, 1+eps_high)·A)·w; with dual_clip=c, a token with
    A < 0 is also capped at −c·A, so a huge ratio on a bad token cannot blow up the loss.
    eps_high > eps_low lets unlikely good tokens grow (keeps entropy up); token-mean weighs
    every token equally, so long answers are not diluted. Use it for long chain-of-thought RL.
    """

    eps_low: float = option(
        0.2, help="lower clip range: ratios below 1-eps_low stop pushing down (>= 1: no lower clip)", validator=validate_eps_low
    )
    eps_high: float = option(
        0.28, help="upper clip range (clip-higher): ratios above 1+eps_high stop pushing up", validator=validate_non_negative
    )
    ratio_log_cap: float = log_cap_option("token")
    dual_clip: float | None = option(
        None, help="dual-clip constant c > 1 for negative advantages (None = off; 3 is common)", validator=_validate_dual_clip
    )
    agg: str = option("token-mean", help="aggregation over tokens and sequences", validator=validate_agg)

    @property
    def service_loss(self) -> dict[str, Any] | None:
        """The Tinker service's ppo loss computes it without dual_clip (declared in hookspecs)."""
        return service_loss(self, DAPOLoss, "ppo") if self.dual_clip is None else None

    @hookimpl
    def loss(self, inputs: LossInputs) -> LossOutput:
        padded = inputs.padded()
        policy_B_T, metrics = clipped_surrogate(padded, padded.ratio_B_T(self.ratio_log_cap), self.eps_low, self.eps_high)
        if self.dual_clip is not None:
            adv_B_T = padded.advantages_B_T
            negative_B_T = adv_B_T < 0
            cap_B_T = -self.dual_clip * adv_B_T
            metrics["loss/clip_frac_dual"] = padded.masked_mean((negative_B_T & (policy_B_T.detach() > cap_B_T)).float())
            policy_B_T = torch.where(negative_B_T, torch.minimum(policy_B_T, cap_B_T), policy_B_T)
        return finish_loss(padded, policy_B_T, self.agg, metrics, kl_beta=self.kl_beta, kl_estimator=self.kl_estimator)
