from __future__ import annotations

import math
from typing import Literal

import attrs
import torch

from grpo_core import LossInputs, LossOutput, hookimpl, option
from grpo_core.loss import LOG_RATIO_CLAMP, masked_diff


def _validate_cap(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"cap must be > 0, not {value!r}")


def _validate_icepop(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is None:
        return
    if not value >= 1:
        raise ValueError(f"icepop must be >= 1 (tokens whose ratio is outside [1/icepop, icepop] are dropped) or None, not {value!r}")
    if instance.level != "token":  # type: ignore[attr-defined]
        raise ValueError("icepop works at token level only; set level=token")


@attrs.define
class TISLoss:
    """TIS: truncated importance sampling for the sampler/trainer mismatch (wraps any loss).

    The sampler (vLLM, another precision, stale weights) reports logprobs π_s that differ
    from the trainer's π_old; each token's policy term is multiplied by
    w = min(π_old/π_s, cap) (level=token) or by the sequence's geometric-mean ratio, capped
    (level=sequence). icepop=T instead drops tokens whose ratio leaves [1/T, T]. Use it with
    any loss, e.g. `--loss cispo --loss tis`; it never weights a KL or DRO penalty term.
    """

    cap: float = option(2.0, help="truncate the importance weight at this value", validator=_validate_cap)
    level: Literal["token", "sequence"] = option(
        "token",
        help="token: one weight per token; sequence: one weight per sequence",
        validator=attrs.validators.in_(("token", "sequence")),
    )
    icepop: float | None = option(
        None, help="IcePop: zero the weight where π_old/π_s is outside [1/T, T] (token level; None = off)", validator=_validate_icepop
    )

    @property
    def needs_reference(self) -> bool:
        """TIS uses the sampler's logprobs, never a reference model."""
        return False

    def weights(self, inputs: LossInputs) -> tuple[list[torch.Tensor], dict[str, float]]:
        """The importance weights w (one 1-D tensor per sequence, no gradient) and their metrics."""
        with torch.no_grad():
            padded = inputs.padded()
            mask_B_T = padded.mask_B_T
            trained_B_T = mask_B_T > 0
            log_ratio_B_T = masked_diff(padded, padded.old_logprobs_B_T.detach(), padded.sampling_logprobs_B_T.detach())
            if self.level == "token":
                raw_B_T = torch.exp(log_ratio_B_T.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            else:
                count_B = mask_B_T.sum(-1)
                mean_B = (log_ratio_B_T * mask_B_T).sum(-1) / count_B.clamp(min=1.0)
                raw_B_T = torch.exp(mean_B)[:, None].expand_as(log_ratio_B_T)
            weights_B_T = raw_B_T.clamp(max=self.cap)
            metrics: dict[str, float] = {"tis/clip_frac": padded.masked_mean((raw_B_T > self.cap).float())}
            if self.icepop is not None:
                # compared on the log scale: exp(π_old − π_s) ∉ [1/T, T] ⇔ |π_old − π_s| > log T
                dropped_B_T = log_ratio_B_T.abs() > math.log(self.icepop)
                weights_B_T = torch.where(dropped_B_T, torch.zeros_like(weights_B_T), weights_B_T)
                metrics["tis/icepop_frac"] = padded.masked_mean(dropped_B_T.float())
            # untrained positions get weight 1 (they are masked out of every loss anyway)
            weights_B_T = torch.where(trained_B_T, weights_B_T, torch.ones_like(weights_B_T))
            metrics["tis/weight_mean"] = padded.masked_mean(weights_B_T)
            weights = [weights_B_T[i, : len(seq)] for i, seq in enumerate(inputs.logprobs)]
        return weights, metrics

    @hookimpl(wrapper=True)
    def loss(self, inputs: LossInputs):  # type: ignore[no-untyped-def]
        weights, metrics = self.weights(inputs)
        previous = inputs.tis_weights
        inputs.tis_weights = weights if previous is None else [p * w for p, w in zip(previous, weights)]
        try:
            out: LossOutput = yield
        finally:
            inputs.tis_weights = previous  # the caller's inputs are left as they were
        if out is not None:  # None: no loss plugin answered; call_loss reports it
            out.metrics.update(metrics)
        return out
