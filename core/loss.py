"""The loss contract: inputs, output, aggregation, and ``call_loss`` (formulas: docs/losses.md).

Sequences arrive as lists of 1-D tensors of different lengths. Losses work on the padded
``B x T`` view (``LossInputs.padded()``): padding has mask 0, so it contributes nothing, and
one vectorized expression serves every sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

if TYPE_CHECKING:
    import torch

AGGREGATIONS: tuple[str, ...] = (
    "token-sum",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
LOG_RATIO_CLAMP = 20.0
"""Default of ``ratio_log_cap`` / ``seq_ratio_log_cap``: a log-ratio is clipped to ±this before
exp(), so a far off-policy token cannot overflow (e^20 ≈ 4.9e8)."""
"""Metrics that are a batch's share of a step total: a step split into several calls adds them
up. Every other loss metric is a mean over the batch's trained tokens: a split step weighs each
call's value by its trained tokens, which gives the value of one call with all sequences."""


@attrs.define
class LossInputs:
    """Everything a loss sees for one forward/backward batch.

    Each list holds one 1-D tensor per sequence; the tensors of one sequence share a length.
    The step normalizers (``num_sequences``, ``num_tokens``) belong to the whole optimizer
    step, so a step split into several forward/backward calls gets the gradient of one call;
    left ``None`` they are computed from this batch.
    """

    logprobs: list[torch.Tensor]
    """π_t: the trainer's logprobs of the target tokens, differentiable."""
    old_logprobs: list[torch.Tensor]
    """π_old,t: the policy the ratio anchors on (detached)."""
    sampling_logprobs: list[torch.Tensor]
    """π_s,t: what the sampler reported for the sampled tokens."""
    mask: list[torch.Tensor]
    """m_t: 1.0 on trained tokens, 0.0 elsewhere."""
    advantages: list[torch.Tensor]
    """A_t per token."""
    ref_logprobs: list[torch.Tensor] | None = None
    """π_ref,t, required when a KL term is on."""
    tis_weights: list[torch.Tensor] | None = None
    """w_t set by an importance-sampling wrapper (TIS); ``None`` means 1."""
    num_sequences: int | None = None
    """Sequences with at least one trained token in the whole optimizer step."""
    num_tokens: float | None = None
    """Trained tokens (Σ m) in the whole optimizer step."""
    max_tokens: int | None = None
    """L of ``seq-mean-token-sum-norm``: the run's max completion tokens."""

    def __attrs_post_init__(self) -> None:
        n = len(self.logprobs)
        for name in ("old_logprobs", "sampling_logprobs", "mask", "advantages", "ref_logprobs", "tis_weights"):
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) != n:
                raise ValueError(f"LossInputs.{name} has {len(value)} sequences, logprobs has {n}")
            for i, (a, b) in enumerate(zip(self.logprobs, value)):
                if a.shape != b.shape:
                    raise ValueError(f"LossInputs.{name}[{i}] has shape {tuple(b.shape)}, logprobs[{i}] has {tuple(a.shape)}")

    def padded(self) -> PaddedLossInputs:
        """The same inputs as ``B x T`` tensors, zero-padded (mask 0 on padding)."""
        return PaddedLossInputs.from_inputs(self)


@attrs.define
class PaddedLossInputs:
    logprobs_B_T: torch.Tensor
    old_logprobs_B_T: torch.Tensor
    sampling_logprobs_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    advantages_B_T: torch.Tensor
    ref_logprobs_B_T: torch.Tensor | None
    tis_weights_B_T: torch.Tensor | None
    num_sequences: int
    num_tokens: float
    max_tokens: int | None

    @classmethod
    def from_inputs(cls, inputs: LossInputs) -> PaddedLossInputs:
        import torch

        def pad(seqs: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
            if seqs is None:
                return None
            return torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True)

        mask_B_T = pad(inputs.mask)
        assert mask_B_T is not None
        return cls(
            logprobs_B_T=pad(inputs.logprobs),
            old_logprobs_B_T=pad(inputs.old_logprobs),
            sampling_logprobs_B_T=pad(inputs.sampling_logprobs),
            mask_B_T=mask_B_T,
            advantages_B_T=pad(inputs.advantages),
            ref_logprobs_B_T=pad(inputs.ref_logprobs),
            tis_weights_B_T=pad(inputs.tis_weights),
            num_sequences=(inputs.num_sequences if inputs.num_sequences is not None else int((mask_B_T.sum(-1) > 0).sum())),
            num_tokens=inputs.num_tokens if inputs.num_tokens is not None else float(mask_B_T.sum()),
            max_tokens=inputs.max_tokens,
        )

    def ratio_B_T(self, log_cap: float = LOG_RATIO_CLAMP) -> torch.Tensor:
        """r_t = exp(clip(π_t − π_old,t, −log_cap, log_cap)); no gradient where the clip binds."""
        import torch

        log_ratio = (self.logprobs_B_T - self.old_logprobs_B_T).clamp(-log_cap, log_cap)
        return torch.exp(log_ratio)

    def weighted(self, term_B_T: torch.Tensor) -> torch.Tensor:
        """Multiply by the TIS weight w_t when a wrapper set one."""
        return term_B_T if self.tis_weights_B_T is None else term_B_T * self.tis_weights_B_T

    def masked_mean(self, x_B_T: torch.Tensor) -> float:
        """Mean of x over trained tokens, as a metric (0.0 when nothing is trained)."""
        total = float(self.mask_B_T.sum())
        return float((x_B_T.detach() * self.mask_B_T).sum()) / total if total > 0 else 0.0


SUMMED_LOSS_METRICS: frozenset[str] = frozenset({"loss/policy", "loss/active_tokens"})
"""What every loss reports summed over a step's calls: the aggregated policy term (it carries
the step's normalizer) and the count of trained tokens."""


@attrs.define
class LossOutput:
    loss: torch.Tensor
    """0-d tensor, differentiable in ``inputs.logprobs``."""
    metrics: dict[str, float] = attrs.field(factory=dict)
    """Namespaced metrics (``loss/policy``, ``loss/clip_frac_low``, ``tis/weight_mean``, ...): each a
    mean over the call's trained tokens, but for those named in ``summed``."""
    summed: frozenset[str] = SUMMED_LOSS_METRICS
    """The metrics that add up over a step's forward/backward calls (a loss whose own metric is a
    sum adds its name); every other one is merged as a mean weighted by the calls' trained tokens."""


def aggregate(term_B_T: torch.Tensor, padded: PaddedLossInputs, agg: str) -> torch.Tensor:
    """Reduce per-token terms ℓ_t to the step's scalar, with the step's normalizers."""
    mask_B_T = padded.mask_B_T
    masked_B_T = term_B_T * mask_B_T
    if agg == "token-sum":
        return masked_B_T.sum()
    if agg == "token-mean":
        return masked_B_T.sum() / max(padded.num_tokens, 1.0)
    num_sequences = max(padded.num_sequences, 1)
    if agg == "seq-mean-token-sum":
        return masked_B_T.sum() / num_sequences
    if agg == "seq-mean-token-mean":
        # An all-masked sequence has 0/1 here: it contributes nothing.
        per_seq_B = masked_B_T.sum(-1) / mask_B_T.sum(-1).clamp(min=1.0)
        return per_seq_B.sum() / num_sequences
    if agg == "seq-mean-token-sum-norm":
        if padded.max_tokens is None or padded.max_tokens <= 0:
            raise ValueError("agg=seq-mean-token-sum-norm needs LossInputs.max_tokens (the run's max completion tokens)")
        return masked_B_T.sum() / (num_sequences * padded.max_tokens)
    raise ValueError(f"unknown agg {agg!r}; choose one of: {', '.join(AGGREGATIONS)}")


def validate_agg(instance: Any, attribute: Any, value: str) -> None:
    """attrs validator for the ``agg`` option of every loss."""
    if value not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {', '.join(AGGREGATIONS)}, not {value!r}")


# ---------------------------------------------------------------------------------------------
# Helpers shared by the built-in losses (and available to third-party ones). Every per-token
# tensor is B x T; "masked" positions (mask 0: prompt, tool output, padding) never contribute a
# value or a gradient, and expressions that could overflow there are computed as 0 instead.

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def masked_diff(padded: PaddedLossInputs, a_B_T: torch.Tensor, b_B_T: torch.Tensor) -> torch.Tensor:
    """a − b on trained tokens, exactly 0 elsewhere (so exp() of it is finite everywhere)."""
    import torch

    diff_B_T = a_B_T - b_B_T
    return torch.where(padded.mask_B_T > 0, diff_B_T, torch.zeros_like(diff_B_T))


def kl_term(padded: PaddedLossInputs, estimator: str) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate, differentiable in π (k1, k2 or k3).

    k1 = π − π_ref; k2 = ½(π − π_ref)²; k3 = exp(π_ref − π) − (π_ref − π) − 1.
    """
    import torch

    if padded.ref_logprobs_B_T is None:
        raise ValueError(
            "the loss has a KL term (kl_beta > 0) but LossInputs.ref_logprobs is None: "
            "run a reference forward and pass ref_logprobs, or set kl_beta=0 to train without a reference model"
        )
    diff_B_T = masked_diff(padded, padded.logprobs_B_T, padded.ref_logprobs_B_T)
    if estimator == "k1":
        return diff_B_T
    if estimator == "k2":
        return 0.5 * diff_B_T**2
    if estimator == "k3":
        return torch.exp(-diff_B_T) + diff_B_T - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of: {', '.join(KL_ESTIMATORS)}")


def clipped_surrogate(
    padded: PaddedLossInputs, ratio_B_T: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A) and how often each side of the clip binds.

    ``loss/clip_frac_low``: trained tokens with A < 0 and r < 1−ε_low (no gradient there);
    ``loss/clip_frac_high``: A > 0 and r > 1+ε_high; ``loss/ratio_mean``: mean r.
    """
    import torch

    adv_B_T = padded.advantages_B_T
    clipped_B_T = ratio_B_T.clamp(1.0 - eps_low, 1.0 + eps_high)
    term_B_T = torch.maximum(-ratio_B_T * adv_B_T, -clipped_B_T * adv_B_T)
    r = ratio_B_T.detach()
    metrics = {
        "loss/clip_frac_low": padded.masked_mean(((r < 1.0 - eps_low) & (adv_B_T < 0)).float()),
        "loss/clip_frac_high": padded.masked_mean(((r > 1.0 + eps_high) & (adv_B_T > 0)).float()),
        "loss/ratio_mean": padded.masked_mean(r),
    }
    return term_B_T, metrics


def sequence_log_ratio(padded: PaddedLossInputs, log_cap: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """GSPO's log s_i = Σ_t m_t(π_t − π_old,t) / Σ_t m_t, clipped to [−log_cap, log_cap] (B; 0 when all-masked)."""
    diff_B_T = masked_diff(padded, padded.logprobs_B_T, padded.old_logprobs_B_T)
    count_B = padded.mask_B_T.sum(-1).clamp(min=1.0)
    return ((diff_B_T * padded.mask_B_T).sum(-1) / count_B).clamp(-log_cap, log_cap)


def kl_metrics(padded: PaddedLossInputs) -> dict[str, float]:
    """The KL a run watches, k3 estimates (unbiased, never negative) over trained tokens.

    ``kl/mean``: KL(π ‖ π_ref), when reference logprobs are given, whatever the loss's own
    ``kl_estimator``; ``kl/policy_old``: KL(π_old ‖ π), from tokens sampled near π_old,
    exp(x) − x − 1 with x = π − π_old (log-ratio clipped to ±20): how far this step's policy
    has moved from the one the ratio anchors on.
    """
    import torch

    metrics: dict[str, float] = {}
    if padded.ref_logprobs_B_T is not None:
        metrics["kl/mean"] = padded.masked_mean(kl_term(padded, "k3"))
    x_B_T = masked_diff(padded, padded.logprobs_B_T, padded.old_logprobs_B_T).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics["kl/policy_old"] = padded.masked_mean(torch.exp(x_B_T) - x_B_T - 1.0)
    return metrics


def finish_loss(
    padded: PaddedLossInputs,
    policy_B_T: torch.Tensor,
    agg: str,
    metrics: dict[str, float] | None = None,
    *,
    kl_beta: float = 0.0,
    kl_estimator: str = "k3",
    penalty_B_T: torch.Tensor | None = None,
) -> LossOutput:
    """Assemble a loss from its per-token parts and aggregate it with the step's normalizers.

    ``policy_B_T`` is the policy term before TIS: it is multiplied by w here, while the KL term
    (``kl_beta`` · KL_t, when kl_beta > 0) and ``penalty_B_T`` (a regularizer such as DRO's
    quadratic term) never are. Adds ``loss/policy`` (the aggregated, weighted policy term),
    ``loss/kl`` (mean KL_t over trained tokens, when on), ``loss/active_tokens``, the
    :func:`kl_metrics` and, unless the loss set it, ``loss/ratio_mean``.
    """
    metrics = dict(metrics or {})
    metrics.update(kl_metrics(padded))
    policy_B_T = padded.weighted(policy_B_T)
    term_B_T = policy_B_T
    if penalty_B_T is not None:
        term_B_T = term_B_T + penalty_B_T
    if kl_beta > 0:
        kl_B_T = kl_term(padded, kl_estimator)
        term_B_T = term_B_T + kl_beta * kl_B_T
        metrics["loss/kl"] = padded.masked_mean(kl_B_T)
    metrics["loss/policy"] = float(aggregate(policy_B_T.detach(), padded, agg))
    metrics["loss/active_tokens"] = float(padded.mask_B_T.sum())
    if "loss/ratio_mean" not in metrics:
        metrics["loss/ratio_mean"] = padded.masked_mean(padded.ratio_B_T())
    return LossOutput(loss=aggregate(term_B_T, padded, agg), metrics=metrics)


# attrs validators for loss options (a ValueError becomes a PluginError in make_plugin).


def validate_non_negative(instance: Any, attribute: Any, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attribute.name} must be >= 0, not {value!r}")


def validate_eps_low(instance: Any, attribute: Any, value: float) -> None:
    """eps_low ≥ 0 with no upper limit: eps_low ≥ 1 puts the lower clip 1 − eps_low at or below 0,
    where no ratio reaches it, so the lower clip is off (how MiniMax-M1 runs CISPO)."""
    if not value >= 0:
        raise ValueError(
            f"{attribute.name} must be >= 0 (the ratio is clipped at 1-{attribute.name}; >= 1 removes that bound), not {value!r}"
        )


def validate_positive(instance: Any, attribute: Any, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, not {value!r}")


def log_cap_option(ratio: str) -> Any:
    """The ``ratio_log_cap`` / ``seq_ratio_log_cap`` option of a loss, default 20."""
    return attrs.field(
        default=LOG_RATIO_CLAMP,
        validator=validate_positive,
        metadata={"help": f"clip the {ratio} log-ratio to ±this before exp() (no gradient where it binds)"},
    )


def validate_positive_or_none(instance: Any, attribute: Any, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{attribute.name} must be > 0 or None, not {value!r}")


def validate_kl_estimator(instance: Any, attribute: Any, value: str) -> None:
    if value not in KL_ESTIMATORS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(KL_ESTIMATORS)}, not {value!r}")


def service_loss(loss: Any, cls: type, loss_fn: str, clipped: bool = True) -> dict[str, Any] | None:
    """A built-in loss's ``service_loss`` (declared in hookspecs): the Tinker service's ``loss_fn``
    with the clip range of ``loss``'s ``eps_low``/``eps_high`` when ``clipped``. Only ``cls`` itself:
    a subclass may compute something else, which its loss hook then does."""
    if type(loss) is not cls:
        return None
    config = {"clip_low_threshold": 1.0 - loss.eps_low, "clip_high_threshold": 1.0 + loss.eps_high} if clipped else None
    return {"loss_fn": loss_fn, "agg": loss.agg, "loss_fn_config": config}


@attrs.define
class KLPenalty:
    """Base of the losses that offer a KL penalty to the reference policy: its fields are options."""

    kl_beta: float = attrs.field(
        default=0.0,
        validator=validate_non_negative,
        metadata={"help": "weight of a KL penalty to the reference policy; 0 = none (no reference model)"},
    )
    kl_estimator: Literal["k1", "k2", "k3"] = attrs.field(
        default="k3", validator=validate_kl_estimator, metadata={"help": "KL estimator: k1, k2 or k3"}
    )

    @property
    def needs_reference(self) -> bool:
        """True when the KL term is on: the run computes reference logprobs."""
        return self.kl_beta > 0
