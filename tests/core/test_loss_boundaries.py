"""core/loss.py's shared loss helpers at the boundaries their code draws (mutation testing, CONTRIBUTING.md)."""

import math
from types import SimpleNamespace

import pytest
import torch

from grpo_core import LossInputs
from grpo_core.loss import (
    KLPenalty,
    clipped_surrogate,
    finish_loss,
    kl_metrics,
    sequence_log_ratio,
    validate_eps_low,
    validate_kl_estimator,
    validate_non_negative,
    validate_positive,
    validate_positive_or_none,
)


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def inputs(logprobs, old, adv, mask=None, ref=None):
    """One LossInputs from per-sequence lists; mask 1 everywhere unless given."""
    return LossInputs(
        logprobs=[t(lp).requires_grad_() for lp in logprobs],
        old_logprobs=[t(o) for o in old],
        sampling_logprobs=[t(o) for o in old],
        mask=[t(m) for m in mask] if mask is not None else [torch.ones(len(lp), dtype=torch.float64) for lp in logprobs],
        advantages=[t(a) for a in adv],
        ref_logprobs=None if ref is None else [t(r) for r in ref],
    )


def test_clipped_surrogate_terms_and_which_side_of_the_clip_binds():
    # (r, A) per token with eps_low = 0.2, eps_high = 0.3: the clip range is [0.8, 1.3].
    ratios = [0.5, 0.5, 0.5, 1.5, 1.5, 1.0]
    advs = [-1.0, 0.0, 0.5, 0.5, 0.0, 2.0]
    padded = inputs([[0.0] * 6], [[0.0] * 6], [advs]).padded()
    term_B_T, metrics = clipped_surrogate(padded, t([ratios]), eps_low=0.2, eps_high=0.3)
    # max(−r·A, −clip(r)·A): A < 0 below the range takes the clip (0.8), A > 0 above it too (1.3).
    assert term_B_T[0].tolist() == pytest.approx([0.8, 0.0, -0.25, -0.65, 0.0, -2.0])
    # Only A < 0 counts below the range and only A > 0 above it; A = 0 is neither side.
    assert metrics["loss/clip_frac_low"] == pytest.approx(1 / 6)
    assert metrics["loss/clip_frac_high"] == pytest.approx(1 / 6)
    assert metrics["loss/ratio_mean"] == pytest.approx(5.5 / 6)


def test_sequence_log_ratio_is_the_mean_over_trained_tokens_clipped_to_the_cap():
    # B = 4 sequences of up to T = 3 tokens: one trained token of two, three tokens, a large
    # negative ratio, and an all-masked sequence (0).
    lp = [[5.0, 0.4], [0.1, 0.2, 0.6], [-1.0], [3.0, 3.0]]
    old = [[0.0, 0.0], [0.0, 0.0, 0.0], [0.0], [0.0, 0.0]]
    mask = [[0.0, 1.0], [1.0, 1.0, 1.0], [1.0], [0.0, 0.0]]
    padded = inputs(lp, old, old, mask=mask).padded()
    assert sequence_log_ratio(padded).tolist() == pytest.approx([0.4, 0.3, -1.0, 0.0])
    assert sequence_log_ratio(padded, log_cap=0.35).tolist() == pytest.approx([0.35, 0.3, -0.35, 0.0])


def test_kl_metrics_values_with_and_without_a_reference():
    # x = π − π_old = (0.5, 0); π − π_ref = (0, −1).
    with_ref = inputs([[-1.0, -2.0]], [[-1.5, -2.0]], [[1.0, 1.0]], ref=[[-1.0, -1.0]]).padded()
    metrics = kl_metrics(with_ref)
    assert metrics["kl/policy_old"] == pytest.approx((math.exp(0.5) - 0.5 - 1.0) / 2)
    assert metrics["kl/mean"] == pytest.approx((math.e - 1.0 - 1.0) / 2)
    assert "kl/mean" not in kl_metrics(inputs([[-1.0]], [[-1.0]], [[1.0]]).padded())


def test_finish_loss_adds_the_penalty_and_a_kl_term_only_when_kl_beta_is_above_zero():
    # π = π_old (r = 1), π − π_ref = (0, −1): k3 = (0, e − 2).
    padded = inputs([[-1.0, -2.0]], [[-1.0, -2.0]], [[1.0, 1.0]], ref=[[-1.0, -1.0]]).padded()
    policy_B_T = t([[1.0, 2.0]])
    plain = finish_loss(padded, policy_B_T, "token-sum")
    assert plain.loss.item() == 3.0
    assert "loss/kl" not in plain.metrics
    assert plain.metrics["loss/policy"] == 3.0
    assert plain.metrics["loss/active_tokens"] == 2.0
    assert plain.metrics["loss/ratio_mean"] == 1.0
    assert "loss/kl" not in finish_loss(padded, policy_B_T, "token-sum", kl_beta=0.0).metrics
    penalized = finish_loss(padded, policy_B_T, "token-sum", penalty_B_T=t([[0.5, 0.25]]))
    assert penalized.loss.item() == 3.75
    assert penalized.metrics["loss/policy"] == 3.0
    with_kl = finish_loss(padded, policy_B_T, "token-sum", kl_beta=0.5)
    assert with_kl.loss.item() == pytest.approx(3.0 + 0.5 * (math.e - 2.0))
    assert with_kl.metrics["loss/kl"] == pytest.approx((math.e - 2.0) / 2)


def test_finish_loss_keeps_the_metrics_and_the_ratio_mean_a_loss_set():
    padded = inputs([[-1.0]], [[-2.0]], [[1.0]]).padded()
    out = finish_loss(padded, t([[1.0]]), "token-sum", {"loss/ratio_mean": 7.0, "loss/clip_frac_low": 0.5})
    assert out.metrics["loss/ratio_mean"] == 7.0
    assert out.metrics["loss/clip_frac_low"] == 0.5
    assert finish_loss(padded, t([[1.0]]), "token-sum").metrics["loss/ratio_mean"] == pytest.approx(math.e)


def test_option_validators_accept_and_refuse_at_their_bounds():
    attribute = SimpleNamespace(name="opt")
    for validate in (validate_non_negative, validate_eps_low):
        validate(None, attribute, 0.0)
        validate(None, attribute, 0.5)
        validate(None, attribute, 1.5)
        for bad in (-0.1, math.nan):
            with pytest.raises(ValueError, match="opt must be >= 0"):
                validate(None, attribute, bad)
    validate_positive(None, attribute, 0.5)
    with pytest.raises(ValueError, match="opt must be > 0"):
        validate_positive(None, attribute, 0.0)
    validate_positive_or_none(None, attribute, None)
    validate_positive_or_none(None, attribute, 0.5)
    with pytest.raises(ValueError, match="opt must be > 0 or None"):
        validate_positive_or_none(None, attribute, 0.0)
    validate_kl_estimator(None, attribute, "k2")
    with pytest.raises(ValueError, match="opt must be one of k1, k2, k3"):
        validate_kl_estimator(None, attribute, "k4")


def test_kl_penalty_needs_a_reference_exactly_when_kl_beta_is_above_zero():
    assert KLPenalty().kl_beta == 0.0
    assert not KLPenalty().needs_reference
    assert KLPenalty(kl_beta=0.5).needs_reference
    assert KLPenalty(kl_beta=2.0).needs_reference
