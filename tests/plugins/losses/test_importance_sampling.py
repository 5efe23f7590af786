import math

import pytest

from grpo_core import call_loss, make_plugin

from .reference import AGGS, TIS_MODES, assert_matches_reference, check_all_scenarios, one_sequence


@pytest.mark.parametrize("tis", list(TIS_MODES))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("options", [{}, {"clip_rho": 1.5}, {"ratio_log_cap": 0.5}], ids=["default", "clip_rho", "ratio_log_cap"])
def test_matches_reference(options, agg, tis):
    check_all_scenarios("importance_sampling", options, agg, tis)


def test_ratio_gradient_and_clip_rho():
    # r = e^{0.5} and e^{-0.5}; clip_rho=1.5 truncates the first (no gradient), not the second.
    inputs = one_sequence([-1.0, -2.0], [-1.5, -1.5], [1.0, 1.0])
    out = call_loss([make_plugin("importance_sampling", clip_rho=1.5, agg="token-sum")], inputs)
    assert out.loss.item() == pytest.approx(-1.5 - math.exp(-0.5))
    out.loss.backward()
    assert inputs.logprobs[0].grad.tolist() == pytest.approx([0.0, -math.exp(-0.5)])
    assert out.metrics["loss/clip_frac_high"] == pytest.approx(0.5)
    assert out.metrics["loss/ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.5)) / 2)


def test_log_ratio_is_clamped_at_20():
    # π − π_old = ±25: r = e^{±20} with no gradient (the clamp binds); −1: normal gradient.
    seq = {
        "logprobs": [-1.0, -30.0, -2.0],
        "old": [-26.0, -5.0, -1.0],
        "sampling": [-26.0, -5.0, -1.0],
        "ref": [0.0, 0.0, 0.0],
        "mask": [1.0, 1.0, 1.0],
        "adv": [1.0, 1.0, 1.0],
    }
    out = assert_matches_reference("importance_sampling", [seq], {"agg": "token-sum"}, atol=1e-3)
    assert out.loss.item() == pytest.approx(-(math.exp(20) + math.exp(-20) + math.exp(-1)), rel=1e-12)


def test_no_reference_needed():
    assert make_plugin("importance_sampling").needs_reference is False


def test_ratio_log_cap_option():
    # The cookbook-style cap: π − π_old = 3 with ratio_log_cap = 2 gives r = e^{2} and no gradient.
    inputs = one_sequence([0.0, -1.0], [-3.0, -1.0], [1.0, 1.0])
    out = call_loss([make_plugin("importance_sampling", ratio_log_cap=2.0, agg="token-sum")], inputs)
    assert out.loss.item() == pytest.approx(-(math.exp(2.0) + 1.0))
    out.loss.backward()
    assert inputs.logprobs[0].grad.tolist() == pytest.approx([0.0, -1.0])
    assert make_plugin("importance_sampling").ratio_log_cap == 20.0
