"""Losses at the boundaries their code draws: a ratio exactly at a clip bound is not clipped."""

import math

import pytest
import torch

from grpo_core import LossInputs, call_loss, make_plugin
from grpo_core.loss import aggregate

from .reference import one_sequence


def test_importance_sampling_a_ratio_equal_to_clip_rho_is_not_counted_as_clipped():
    # r = 1 exactly (π = π_old) and clip_rho = 1: the clip does not bind.
    inputs = one_sequence([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    out = call_loss([make_plugin("importance_sampling", clip_rho=1.0, agg="token-sum")], inputs)
    assert out.metrics["loss/clip_frac_high"] == 0.0
    assert out.loss.item() == 0.0


@pytest.mark.parametrize("loss", ["grpo", "dapo", "cispo"])
def test_a_ratio_exactly_at_either_clip_bound_is_not_counted_as_clipped(loss):
    # eps_low = eps_high = 0 puts both bounds at 1 and r = 1 exactly: neither side of the clip binds.
    inputs = one_sequence([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    out = call_loss([make_plugin(f"loss.{loss}", eps_low=0.0, eps_high=0.0, kl_beta=0.0, agg="token-sum")], inputs)
    assert out.metrics["loss/clip_frac_low"] == 0.0
    assert out.metrics["loss/clip_frac_high"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_a_weight_exactly_at_the_cap_is_not_counted_as_clipped(level):
    # π_old = π_s: every raw weight is exactly 1, and cap = 1 (a cap at or below 1 is valid).
    inputs = one_sequence([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    out = call_loss([make_plugin("tis", cap=1.0, level=level), make_plugin("loss.reinforce", agg="token-sum")], inputs)
    assert out.metrics["tis/clip_frac"] == 0.0
    assert out.metrics["tis/weight_mean"] == 1.0
    assert make_plugin("tis", cap=0.5).cap == 0.5


def test_tis_icepop_keeps_a_ratio_exactly_at_the_band_edge():
    # icepop = 1 makes the band [1, 1]: a ratio of exactly 1 is inside it, so nothing is dropped.
    inputs = one_sequence([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    out = call_loss([make_plugin("tis", icepop=1.0), make_plugin("loss.reinforce", agg="token-sum")], inputs)
    assert out.metrics["tis/icepop_frac"] == 0.0
    assert out.metrics["tis/weight_mean"] == 1.0
    assert out.loss.item() == pytest.approx(-(1.0 * -1.0) - (-1.0 * -2.0))


def test_dapo_a_term_exactly_at_the_dual_clip_cap_is_not_counted_as_capped():
    # A = −1 and r = 2 exactly: −r·A = 2 = −dual_clip·A, so the dual clip does not bind.
    inputs = one_sequence([-1.0 + math.log(2.0)], [-1.0], [-1.0])
    assert inputs.padded().ratio_B_T().item() == 2.0
    out = call_loss([make_plugin("dapo", eps_low=0.2, eps_high=2.0, dual_clip=2.0, agg="token-sum")], inputs)
    assert out.metrics["loss/clip_frac_dual"] == 0.0
    assert out.loss.item() == 2.0


def test_tis_multiplies_weights_the_caller_already_set():
    # π_old/π_s = 1.5 (under the cap of 2) on top of a weight of 0.5 already in the inputs: w = 0.75.
    inputs = LossInputs(
        logprobs=[torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)],
        old_logprobs=[torch.tensor([-1.0], dtype=torch.float64)],
        sampling_logprobs=[torch.tensor([-1.0 - math.log(1.5)], dtype=torch.float64)],
        mask=[torch.ones(1, dtype=torch.float64)],
        advantages=[torch.ones(1, dtype=torch.float64)],
        tis_weights=[torch.tensor([0.5], dtype=torch.float64)],
    )
    out = call_loss([make_plugin("tis"), make_plugin("loss.reinforce", agg="token-sum")], inputs)
    assert out.loss.item() == pytest.approx(0.75)  # −A·w·log π = −1 · 0.75 · (−1)
    assert inputs.tis_weights[0].item() == 0.5


def test_token_mean_of_a_single_trained_token_is_that_tokens_term():
    # num_tokens = 1: the normalizer's floor of 1 token does not bind, the mean is the term itself.
    inputs = one_sequence([-3.0, -1.0], [-3.0, -1.0], [1.0, 1.0], mask=[0.0, 1.0])
    padded = inputs.padded()
    assert padded.num_tokens == 1.0
    assert aggregate(padded.logprobs_B_T, padded, "token-mean").item() == -1.0


def test_seq_mean_token_sum_norm_refuses_a_max_tokens_of_zero():
    inputs = one_sequence([-1.0], [-1.0], [1.0])
    inputs.max_tokens = 0
    padded = inputs.padded()
    with pytest.raises(ValueError, match="needs LossInputs.max_tokens"):
        aggregate(padded.logprobs_B_T, padded, "seq-mean-token-sum-norm")
    padded.max_tokens = 1
    assert aggregate(padded.logprobs_B_T, padded, "seq-mean-token-sum-norm").item() == -1.0
